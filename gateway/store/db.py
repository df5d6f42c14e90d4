"""Database engines and migrations.

URLs: `sqlite:///file.db` or `postgresql://...`. PostgreSQL goes through SQLAlchemy's async engine (asyncpg).
SQLite goes through `InLoopEngine`: the standard sqlite3 driver called on the event loop's own thread, behind
the same async interface. A SQLite statement on a local file takes tens of microseconds, less than the two
thread hops per statement of an async driver (aiosqlite: measured ~35% of the gateway's CPU in the demo,
57 context switches a request). What makes that safe: this process's writers queue on the store's asyncio
lock (never two write transactions here at once), WAL readers never wait for a writer, and no fsync happens
on commit (WAL + synchronous=NORMAL, which survives kill -9 of the gateway: docs/architecture.md
"Durability"). The cost: a writer of *another* process holding the lock stalls this loop (up to
busy_timeout), so SQLite is for one gateway process; several gateways share PostgreSQL. Alembic revisions
live in the `migrations` package and are found from the installed code.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy
import sqlalchemy.exc
from sqlalchemy import event
from sqlalchemy.engine import Connection, CursorResult, Dialect, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
STORE_UNAVAILABLE = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlite3.OperationalError,
                     asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.TooManyConnectionsError,
                     asyncpg.CannotConnectNowError)
"""The store could not be reached or locked: through SQLAlchemy, or from the direct statements' own drivers
(each dialect's; the routes answer these with a 503)."""


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
    cur.execute("PRAGMA busy_timeout=10000")  # first: the next pragma may wait for another process's writer
    if cur.execute("PRAGMA journal_mode").fetchone()[0] != "wal":  # persistent: set once per file
        cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
    # We issue BEGIN ourselves (below): the driver's implicit deferred BEGIN lets a read lock be upgraded to
    # a write lock mid-transaction, which SQLite refuses at once ("database is locked") under concurrency.
    dbapi_conn.isolation_level = None


def _sqlite_begin(conn: Connection) -> None:
    # A write transaction takes the write lock up front (IMMEDIATE), so a writer of another process waits
    # (busy_timeout) instead of failing; a read is a plain deferred transaction (one snapshot, no lock).
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("rollway_write") else "BEGIN")


class InLoopConnection:
    """The subset of AsyncConnection the store uses, over a sync Connection, run on the caller's thread."""

    def __init__(self, conn: Connection) -> None:
        self.sync_connection = conn
        self.dialect: Dialect = conn.dialect

    async def execute(self, statement: Any, parameters: Any = None) -> CursorResult[Any]:
        return self.sync_connection.execute(statement, parameters)

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.sync_connection, *args)

    async def commit(self) -> None:
        self.sync_connection.commit()

    async def rollback(self) -> None:
        self.sync_connection.rollback()


class InLoopEngine:
    """The subset of AsyncEngine the store uses, over a sync SQLite engine (see the module docstring)."""

    def __init__(self, sync_engine: Engine) -> None:
        self.sync_engine = sync_engine
        self.dialect: Dialect = sync_engine.dialect
        self._hot: Any = None

    def hot_connection(self) -> sqlite3.Connection | None:
        """One sqlite3 connection kept out of the pool for the store's per-call statements (its pragmas set,
        autocommit: the caller writes BEGIN IMMEDIATE / COMMIT itself). None for an in-memory database,
        where every connection would be a database of its own."""
        if self.sync_engine.url.database in (None, "", ":memory:"):
            return None
        if self._hot is None:
            self._hot = self.sync_engine.raw_connection()
        conn: sqlite3.Connection = self._hot.driver_connection
        return conn

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[InLoopConnection]:
        with self.sync_engine.connect() as conn:
            yield InLoopConnection(conn)

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[InLoopConnection]:
        with self.sync_engine.connect().execution_options(rollway_write=True) as conn, conn.begin():
            yield InLoopConnection(conn)

    async def dispose(self) -> None:
        if self._hot is not None:
            self._hot.close()
            self._hot = None
        self.sync_engine.dispose()


DbEngine = AsyncEngine | InLoopEngine
DbConnection = AsyncConnection | InLoopConnection


def create_engine(url: str, **kw: Any) -> DbEngine:
    # An SQL error's message leaves out the statement's parameters: they hold session ids, key hashes and
    # content, and the message reaches the log (an error the routes did not foresee is logged whole).
    kw.setdefault("hide_parameters", True)
    if is_sqlite(url):
        u = make_url(async_url(url))  # validated, its folder created
        if u.database and u.database != ":memory:":
            # The pool never makes the loop wait for a connection: past pool_size it opens more.
            kw.setdefault("pool_size", 8)
            kw.setdefault("max_overflow", -1)
        engine = sqlalchemy.create_engine(u.set(drivername="sqlite+pysqlite"),
                                          connect_args={"check_same_thread": False}, **kw)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return InLoopEngine(engine)
    kw.setdefault("pool_size", 20)
    kw.setdefault("max_overflow", 20)
    return create_async_engine(async_url(url), **kw)


def _quiet_alembic() -> None:
    """Alembic logs at INFO on every use: each plugin it sets up, "Context impl SQLiteImpl.", "Will assume
    non-transactional DDL." That is noise at every start of `rollway serve`; its warnings and errors still
    show, and the revisions a migration applies are logged by migrations/env.py."""
    for name in ("alembic.runtime.plugins", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


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
    _quiet_alembic()  # before alembic's imports: its plugins log as they are imported
    from alembic import command

    _in_thread(command.upgrade, _alembic_config(url), revision)


def head_revision() -> str:
    _quiet_alembic()
    from alembic.script import ScriptDirectory

    return str(ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head())


def current_weights(url: str) -> tuple[int, str | None]:
    """The store's current published weights (version, model path); (0, None) when nothing was published."""
    import asyncio

    from sqlalchemy import select

    from gateway.store.models import WeightState

    table = WeightState.__table__

    async def read() -> tuple[int, str | None]:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                row = (await conn.execute(select(table.c.version, table.c.model_path)
                                          .order_by(table.c.version.desc()).limit(1))).first()
        finally:
            await engine.dispose()
        return (int(row.version), row.model_path) if row else (0, None)

    return _in_thread(asyncio.run, read())


def current_revision(url: str) -> str | None:
    """The revision the database is at (None for an empty database)."""
    import asyncio

    _quiet_alembic()
    from alembic.runtime.migration import MigrationContext

    async def read() -> str | None:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
        finally:
            await engine.dispose()

    return _in_thread(asyncio.run, read())
