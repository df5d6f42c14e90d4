"""The direct PostgreSQL statements' connections (`direct.PgStatements`): a set of asyncpg connections handed out
one statement or one transaction at a time, without asyncpg's `Pool`.

`Pool.fetchval` costs a statement 40-75 us more of the gateway's CPU than the same statement here (this 2-core VM,
`python benchmarks/pg_pool.py`: 93 against 53 us a statement at 16 at once, 188 against 115 one at a time, where one
connection held throughout takes 116): a proxy object, a timeout context and the connection's reset bookkeeping on
every acquire and release. A chat call runs two statements (the session lookup and the turn insert). Here an idle
connection is popped from a list and pushed back.

What the pool's release guarded against is kept, plainly:
- a statement cancelled mid-flight (its caller's task was cancelled) leaves asyncpg cancelling the query on the
  server: that connection is closed, not reused (the server rolls back whatever it was in);
- a connection that broke (the server restarted, the socket reset) is closed and dropped; the next statement opens
  a new one, so the store recovers once the server is back, and meanwhile callers get the driver's error (a 503:
  `db.STORE_UNAVAILABLE`);
- a transaction that raised was rolled back by asyncpg's `transaction()` before the connection comes back.

At most `max_size` connections are open; a caller beyond them waits for one to come back, first come first served.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any


class PgConnections:
    def __init__(self, connect: Callable[[], Awaitable[Any]], max_size: int, loop: asyncio.AbstractEventLoop) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self._connect = connect
        self._max = max_size
        self._idle: list[Any] = []
        self._open = 0  # connections open or being opened
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._closed = False
        self._loop = loop
        """The loop they are used on (`open`'s): `asyncio.get_running_loop()` is a getpid() system call on Python
        3.11, and past 16 statements at once every acquire waits."""

    @classmethod
    async def open(cls, connect_args: dict[str, Any], max_size: int) -> PgConnections:
        """One connection opened now (a bad URL or an unreachable server fails at start, as `create_pool` did)."""
        import asyncpg

        conns = cls(lambda: asyncpg.connect(**connect_args), max_size, asyncio.get_running_loop())
        conns._release(await conns._new())
        return conns

    @property
    def size(self) -> int:
        """Connections open (idle or in use)."""
        return self._open

    async def _new(self) -> Any:
        self._open += 1
        try:
            return await self._connect()
        except BaseException:
            self._open -= 1
            self._wake_opener()
            raise

    async def acquire(self) -> Any:
        if self._closed:
            raise RuntimeError("the store's connections are closed")
        if self._idle:
            return self._idle.pop()
        if self._open < self._max:
            return await self._new()
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            conn = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()  # handed over as this caller was cancelled: pass it on
                if handed is None:
                    self._wake_opener()
                else:
                    self._release(handed)
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise
        if conn is None:  # a slot freed up (a connection was dropped): open one in it
            return await self._new()
        return conn

    def _release(self, conn: Any) -> None:
        """A connection back from a statement that completed (or raised a server error): to the first waiter, else
        idle."""
        if self._closed or conn.is_closed():
            self._drop(conn)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _drop(self, conn: Any) -> None:
        """A connection that must not be reused: closed without waiting, its slot freed for a new one."""
        if not conn.is_closed():
            conn.terminate()
        self._open -= 1
        self._wake_opener()

    def _wake_opener(self) -> None:
        while self._waiters and not self._closed:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter opens a connection in the freed slot
                return

    def release(self, conn: Any, failed: BaseException | None) -> None:
        """After a statement or transaction: `failed` is what it raised, if anything. The connection is reused after
        an error the server answered (a constraint, a bad value) or one raised in the caller's own code once its
        transaction was rolled back; it is dropped when the statement was cancelled (asyncpg is still cancelling
        its query), when the connection broke, or when asyncpg refused it as busy."""
        if failed is None or _still_good(conn, failed):
            self._release(conn)
        else:
            self._drop(conn)

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        return await self._statement("fetchrow", sql, args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self._statement("fetchval", sql, args)

    async def _statement(self, method: str, sql: str, args: tuple[Any, ...]) -> Any:
        """One statement on a connection of the set (asyncpg's `method` of it), the connection then released."""
        conn = await self.acquire()
        try:
            result = await getattr(conn, method)(sql, *args)
        except BaseException as e:
            self.release(conn, e)
            raise
        self._release(conn)
        return result

    def holding(self) -> _Held:
        """`async with conns.holding() as conn:` one connection for several statements (a transaction)."""
        return _Held(self)

    async def close(self, timeout: float = 10) -> None:
        """Idle connections closed (waiting up to `timeout` s for each, then terminated); those in use are closed
        as they come back. Waiters get an error."""
        self._closed = True
        idle, self._idle = self._idle, []
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(RuntimeError("the store's connections are closed"))
        self._waiters.clear()
        for conn in idle:
            self._open -= 1
            try:
                await asyncio.wait_for(conn.close(), timeout)
            except Exception:  # a connection stuck (TimeoutError) or gone: terminate it
                conn.terminate()

    def terminate(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._open -= 1
            conn.terminate()


class _Held:
    __slots__ = ("_conn", "_conns")

    def __init__(self, conns: PgConnections) -> None:
        self._conns = conns
        self._conn: Any = None

    async def __aenter__(self) -> Any:
        self._conn = await self._conns.acquire()
        return self._conn

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        conn, self._conn = self._conn, None
        self._conns.release(conn, exc)


def _still_good(conn: Any, failed: BaseException) -> bool:
    import asyncpg

    if not isinstance(failed, Exception) or conn.is_closed() or conn.is_in_transaction():
        return False  # cancelled (asyncio.CancelledError is a BaseException), broken, or left in a transaction
    if isinstance(failed, asyncpg.PostgresError):
        return not isinstance(failed, asyncpg.PostgresConnectionError)
    return not isinstance(failed, asyncpg.InterfaceError | OSError)
