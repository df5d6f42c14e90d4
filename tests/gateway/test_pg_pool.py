"""The direct PostgreSQL statements' connections (gateway/store/pg_pool.py), on the real server: statements and
transactions run, callers beyond the limit wait their turn, and a connection is reused only when it is still good
(a server error keeps it; a cancelled statement, a broken connection or a busy one drops it, and the next statement
opens a new one)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg
import pytest

from gateway.store.pg_pool import PgConnections
from tests.conftest import PG_HOST, PG_PORT, postgres_available

pytestmark = pytest.mark.postgres

ARGS = {"host": PG_HOST, "port": PG_PORT, "user": "postgres", "database": "postgres"}


@pytest.fixture(autouse=True)
def _server() -> None:
    if not postgres_available():
        if os.environ.get("ROLLWAY_TEST_POSTGRES") == "required":
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is required (ROLLWAY_TEST_POSTGRES=required) but not reachable")
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is not reachable")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_statements_beyond_the_limit_wait_and_all_complete() -> None:
    async def main() -> None:
        conns = await PgConnections.open(ARGS, max_size=3)
        try:
            assert conns.size == 1
            most = 0

            async def one(i: int) -> int:
                nonlocal most
                value = await conns.fetchval("SELECT $1::int FROM pg_sleep(0.02)", i)
                most = max(most, conns.size)
                return int(value)

            assert await asyncio.gather(*(one(i) for i in range(20))) == list(range(20))
            assert most == 3 and conns.size == 3  # opened up to the limit, never past it, all kept
            row = await conns.fetchrow("SELECT 1 AS a, 'x' AS b")
            assert (row["a"], row["b"]) == (1, "x")
        finally:
            await conns.close()

    run(main())


def test_a_server_error_keeps_the_connection() -> None:
    async def main() -> None:
        conns = await PgConnections.open(ARGS, max_size=2)
        try:
            pid = await conns.fetchval("SELECT pg_backend_pid()")
            with pytest.raises(asyncpg.DivisionByZeroError):
                await conns.fetchval("SELECT 1 / $1::int", 0)
            assert await conns.fetchval("SELECT pg_backend_pid()") == pid and conns.size == 1
        finally:
            await conns.close()

    run(main())


def test_a_cancelled_statement_drops_its_connection_and_the_next_opens_one() -> None:
    async def main() -> None:
        conns = await PgConnections.open(ARGS, max_size=1)
        try:
            pid = await conns.fetchval("SELECT pg_backend_pid()")
            task = asyncio.ensure_future(conns.fetchval("SELECT pg_sleep(30)"))
            waiting = asyncio.ensure_future(conns.fetchval("SELECT pg_backend_pid()"))  # waits: the limit is 1
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            new_pid = await asyncio.wait_for(waiting, 10)  # the freed slot went to the waiter, on a new connection
            assert new_pid != pid and conns.size == 1
        finally:
            await conns.close()

    run(main())


def test_a_broken_connection_is_an_error_then_the_store_recovers() -> None:
    async def main() -> None:
        conns = await PgConnections.open(ARGS, max_size=2)
        admin = await asyncpg.connect(**ARGS)
        try:
            pid = await conns.fetchval("SELECT pg_backend_pid()")
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            await asyncio.sleep(0.2)
            with pytest.raises((asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError)):
                await conns.fetchval("SELECT 1")
            assert conns.size == 0
            assert await conns.fetchval("SELECT pg_backend_pid()") != pid and conns.size == 1
        finally:
            await admin.close()
            await conns.close()

    run(main())


def test_a_transaction_that_raised_is_rolled_back_and_its_connection_kept() -> None:
    async def main() -> None:
        conns = await PgConnections.open(ARGS, max_size=1)
        try:
            await conns.fetchval("CREATE TEMP TABLE t (x int)")  # temp: this connection's own
            with pytest.raises(LookupError):
                async with conns.holding() as conn, conn.transaction():
                    await conn.execute("INSERT INTO t VALUES (1)")
                    raise LookupError("the caller's own error")
            async with conns.holding() as conn:
                assert not conn.is_in_transaction()
                assert await conn.fetchval("SELECT count(*) FROM t") == 0  # rolled back, same connection
        finally:
            await conns.close()

    run(main())


def test_closed_connections_refuse_and_close_what_comes_back() -> None:
    async def main() -> None:
        conns = await PgConnections.open(ARGS, max_size=1)
        held = conns.holding()
        conn = await held.__aenter__()
        waiter = asyncio.ensure_future(conns.fetchval("SELECT 1"))
        await asyncio.sleep(0.05)
        await conns.close()
        with pytest.raises(RuntimeError, match="closed"):
            await waiter
        await held.__aexit__(None, None, None)
        assert conn.is_closed() and conns.size == 0
        with pytest.raises(RuntimeError, match="closed"):
            await conns.fetchval("SELECT 1")

    run(main())


def test_an_unreachable_server_fails_at_open() -> None:
    with pytest.raises(OSError):
        run(PgConnections.open({**ARGS, "port": 1}, max_size=2))
