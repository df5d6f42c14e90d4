"""Alembic stays quiet at INFO: `rollway db upgrade` and every start of `rollway serve` (the same
`gateway.store.db.upgrade`, then `current_revision` on PostgreSQL) log no plugin setup, "Context impl" or
"Will assume ... DDL" lines; a revision actually applied is one line; alembic's warnings still show."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.store import db

ALEMBIC_NOISE = ("setup plugin", "Context impl", "Will assume")


def db_upgrade(url: str) -> subprocess.CompletedProcess[str]:
    """The command in a fresh process, with the CLI's own logging set-up (INFO)."""
    return subprocess.run([sys.executable, "-m", "rollway.cli", "db", "upgrade", "--db", url],
                          capture_output=True, text=True, timeout=120, check=True)


def test_db_upgrade_logs_only_the_revision_it_applies(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    first = db_upgrade(url)
    head = db.head_revision()
    assert f"database at revision {head}" in first.stdout
    assert [line for line in first.stderr.splitlines() if any(n in line for n in ALEMBIC_NOISE)] == []
    applied = [line for line in first.stderr.splitlines() if "INFO rollway.store: store upgrade: " in line]
    assert applied and "empty -> " in applied[0] and f"-> {head} (" in applied[-1]
    again = db_upgrade(url)  # what every later start of `rollway serve` does: nothing to apply, nothing logged
    assert again.stderr == ""


def test_alembic_info_is_dropped_and_its_warnings_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # everything reaches the handler unless a logger's own level stops it
    url = f"sqlite:///{tmp_path / 'store.db'}"
    db.upgrade(url)
    assert db.current_revision(url) == db.head_revision()
    alembic_info = [r.getMessage() for r in caplog.records if r.name.startswith("alembic") and r.levelno < logging.WARNING]
    assert alembic_info == []
    applied = [r.getMessage() for r in caplog.records if r.name == "rollway.store"]
    assert applied[0].startswith("store upgrade: empty -> ") and f"-> {db.head_revision()} (" in applied[-1]
    logging.getLogger("alembic.runtime.migration").warning("a warning of alembic's")
    assert "a warning of alembic's" in caplog.messages
