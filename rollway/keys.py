"""The admin key, found the same way by every command: `ROLLWAY_ADMIN_KEY`, else `DATA_DIR/admin_key`.

`rollway serve` generates the file on first start (0600) when the environment has no key; `rollway rollout`,
`rollway train` and `rollway demo` read the same two places, so a key set once works everywhere.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV = "ROLLWAY_ADMIN_KEY"
FILE = "admin_key"


def find_admin_key(data_dir: str | Path) -> str | None:
    """The environment's key, else the one stored in data_dir; None when neither exists."""
    env = os.environ.get(ENV)
    if env:
        return env
    path = Path(data_dir) / FILE
    return path.read_text().strip() or None if path.is_file() else None


def admin_key(data_dir: str | Path) -> tuple[str, bool]:
    """Like find_admin_key, but generates and stores a key (0600) when there is none.
    Returns (key, newly_generated)."""
    found = find_admin_key(data_dir)
    if found:
        return found, False
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "rw-admin-" + secrets.token_urlsafe(32)
    fd = os.open(data_dir / FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, True


def missing_key_message(data_dir: str | Path) -> str:
    return (f"no admin key: set {ENV}, or point --data-dir at the gateway's data folder "
            f"(looked for {Path(data_dir) / FILE})")


def private_data_dir(data_dir: str | Path, db_url: str) -> None:
    """A data directory (and an SQLite store) made before files were created private: for this user only.
    The store holds session ids, which open the keyless /sessions/{id}/v1/... URLs."""
    data_dir = Path(data_dir)
    if data_dir.is_dir() and data_dir.stat().st_uid == os.getuid():
        data_dir.chmod(0o700)
    if db_url.startswith("sqlite:///"):
        db = Path(db_url.removeprefix("sqlite:///"))
        for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            if path.is_file() and path.stat().st_uid == os.getuid():
                path.chmod(0o600)
