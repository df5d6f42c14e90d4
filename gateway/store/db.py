"""Database engines and migrations.

URLs: `sqlite:///file.db` or `postgresql://...` (drivers are chosen here: aiosqlite, asyncpg).
SQLite runs in WAL mode with synchronous=NORMAL, which survives kill -9 of the gateway (design:
"Durability"). Alembic revisions live in the `migrations` package and are found from the installed code.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def async_url(url: str) -> str:
    """Normalise a user URL to the async driver the gateway uses."""
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        u = u.set(drivername="sqlite+aiosqlite")
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    elif backend == "postgresql":
        u = u.set(drivername="postgresql+asyncpg")
    else:
        raise ValueError(f"unsupported database {url!r}: use sqlite:///FILE or postgresql://...")
    return u.render_as_string(hide_password=False)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
    # We issue BEGIN ourselves (below): the driver's implicit deferred BEGIN lets a read lock be upgraded to
    # a write lock mid-transaction, which SQLite refuses at once ("database is locked") under concurrency.
    dbapi_conn.isolation_level = None


def _sqlite_begin(conn: Any) -> None:
    # IMMEDIATE takes the write lock up front, so concurrent writers wait (busy_timeout) instead of failing.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def create_engine(url: str, **kw: Any) -> AsyncEngine:
    aurl = async_url(url)
    if is_sqlite(url):
        engine = create_async_engine(aurl, **kw)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        event.listen(engine.sync_engine, "begin", _sqlite_begin)
        return engine
    kw.setdefault("pool_size", 20)
    kw.setdefault("max_overflow", 20)
    return create_async_engine(aurl, **kw)


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return cfg


def _in_thread(fn: Any, *args: Any) -> Any:
    """Alembic's env runs its own event loop; keep it off any loop already running here."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (Alembic)."""
    from alembic import command

    _in_thread(command.upgrade, _alembic_config(url), revision)


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return str(ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head())


def current_revision(url: str) -> str | None:
    """The revision the database is at (None for an empty database)."""
    import asyncio

    from alembic.runtime.migration import MigrationContext

    async def read() -> str | None:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
        finally:
            await engine.dispose()

    return _in_thread(asyncio.run, read())
