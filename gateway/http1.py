"""A lean keep-alive HTTP/1.1 client for the gateway's one hot backend call: the non-streaming `/generate`.

Every agent turn makes this call, and aiohttp's general-purpose request machinery was ~0.1 ms of the
gateway's CPU per turn (py-spy, `benchmarks/gateway.py`); a request here is one `write` and one parse with
httptools (which uvicorn already uses), ~0.03 ms. Streaming and the control calls stay on aiohttp.

What it does: POST a body, read one response with a Content-Length or chunked body, keep the connection for
the next request unless the server closes it. A connection idle for `idle_timeout` is dropped before the
server's own keep-alive timeout (uvicorn's default is 5 s) could close it under a request. A reused
connection that dies without a byte of answer within `STALE_WINDOW_S` of the request being written is taken
for one the server had closed while idle (the request most likely never reached it) and the request is sent
once more on a fresh connection, with what is left of the timeout; later, it is an error for the caller
(the pool fails over). Anything that ends a request early — a timeout, a cancelled caller, a broken answer —
closes its connection (for SGLang, closing aborts the request).

Errors: `OSError` (refused, reset, closed; `ConnectionError` included), `TimeoutError`, and `BadResponse`
for bytes that are not HTTP.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.parse

import httptools

STALE_WINDOW_S = 0.25


class BadResponse(Exception):
    """The server's bytes were not a valid HTTP/1.1 response."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.status = 0
        self.body: list[bytes] = []
        self.answered = False
        """Whether any byte of the current answer arrived."""
        self.reusable = True
        self.idle_since = 0.0
        """When it went back to the idle list (`time.monotonic()`)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop it was made on: `asyncio.get_running_loop()` costs a getpid() system call a use on Python 3.11."""

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection cannot be trusted
            self._close(BadResponse("unsolicited bytes from the server"))
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._close(BadResponse(f"malformed HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(exc or ConnectionResetError("the server closed the connection"))

    # -- httptools callbacks --

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.reusable = self.reusable and self.parser.should_keep_alive()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.status, b"".join(self.body)))

    # -- ours --

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _close(self, exc: BaseException) -> None:
        self.reusable = False
        self._fail(exc)
        if self.transport is not None:
            self.transport.close()


class Http1Client:
    """Keep-alive connections to one server (`http://` or `https://`); no limit on how many are open."""

    def __init__(self, url: str, *, connect_timeout: float = 5.0, idle_timeout: float = 2.0,
                 headers: dict[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = parts.netloc.rsplit("@", 1)[-1].encode("idna")
        self._base = parts.path.rstrip("/").encode()
        # Extra header lines of every request (`Authorization: Bearer <key>` for a server with `--api-key`).
        if any(c in k + v for k, v in (headers or {}).items() for c in "\r\n"):
            raise ValueError("a header holds a line break")
        self._extra = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                               for k, v in (headers or {}).items())
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, *, timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body) of one POST of a JSON body; `timeout` bounds the wait for the whole answer."""
        head = (b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
                % (self._base, path.encode(), self._host_header, self._extra, len(body)))
        conn = self._take()
        if conn is not None:
            sent = time.monotonic()
            try:
                return await self._exchange(conn, head + body, timeout)
            except ConnectionError:
                waited = time.monotonic() - sent
                if conn.answered or waited > STALE_WINDOW_S:
                    raise
                if timeout is not None:
                    timeout -= waited
        return await self._exchange(await self._connect(), head + body, timeout)

    def close(self) -> None:
        """Close the idle connections (requests in flight keep theirs until they end)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.reusable = False
            if conn.transport is not None:
                conn.transport.close()

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be stale
            usable = conn.reusable and conn.transport is not None and not conn.transport.is_closing()
            if usable and now - conn.idle_since < self.idle_timeout:
                return conn
            if conn.transport is not None:
                conn.transport.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, self.host, self.port, ssl=self._ssl), self.connect_timeout
        )
        return conn

    async def _exchange(self, conn: _Connection, request: bytes, timeout: float | None) -> tuple[int, bytes]:
        assert conn.transport is not None and conn.loop is not None  # both set by connection_made
        if conn.transport.is_closing():
            # Lost between connecting and now (a server killed after its kernel accepted): nothing would answer; a
            # write would raise RuntimeError on uvloop, or be dropped unanswered on asyncio's loop.
            conn.transport.close()
            raise ConnectionResetError("the server closed the connection before the request was sent")
        loop = conn.loop
        waiter: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        conn.waiter, conn.status, conn.body, conn.answered = waiter, 0, [], False
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, _expire, waiter, timeout)
        conn.transport.write(request)
        try:
            answer = await waiter
        except BaseException:  # timed out, cancelled or broken: its answer may still come, so it is done for
            conn.reusable = False
            conn.waiter = None
            conn.transport.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if conn.reusable:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.transport.close()
        return answer


def _expire(waiter: asyncio.Future[tuple[int, bytes]], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"no complete answer within {timeout} s"))
