"""Shared fixtures: the tiny model, databases (SQLite file and PostgreSQL), and a live gateway.

PostgreSQL tests use 127.0.0.1:5432 when it answers; ROLLWAY_TEST_POSTGRES=required (set by .ci/run)
makes them fail instead of skipping when it does not. Each test module gets a fresh database.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_HOST, PG_PORT = "127.0.0.1", 5432


def postgres_available() -> bool:
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=0.5):
            return True
    except OSError:
        return False


def _pg_admin(sql: str) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user="postgres", database="postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


def _fresh_db(kind: str, tmp: Path) -> Iterator[str]:
    from gateway.store.db import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{tmp / 'rollway.db'}"
        upgrade(url)
        yield url
        return
    if not postgres_available():
        if os.environ.get("ROLLWAY_TEST_POSTGRES") == "required":
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is required (ROLLWAY_TEST_POSTGRES=required) but not reachable")
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is not reachable")
    name = f"rollway_test_{secrets.token_hex(6)}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    url = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}"
    upgrade(url)
    try:
        yield url
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, migrated database per test module, on SQLite and on PostgreSQL."""
    yield from _fresh_db(request.param, tmp_path_factory.mktemp("db"))


@pytest.fixture(scope="module")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SQLite only: for tests whose subject is not the database."""
    yield from _fresh_db("sqlite", tmp_path_factory.mktemp("db"))
