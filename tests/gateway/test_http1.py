"""The lean HTTP/1.1 client (gateway/http1.py) against a raw asyncio server on a loopback socket, scripted per
request: keep-alive reuse, chunked bodies, `Connection: close`, a connection the server closed while idle,
timeouts, cancellation and bytes that are not HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.http1 import BadResponse, Http1Client


class Close(bytes):
    """An answer after which the server closes the connection."""


Answer = Callable[[int, int, bytes], bytes | None]
"""(connection number, request number on it, request body) -> the raw answer (a `Close` to close after it),
or None to close at once without a byte."""


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        extra, len(body), body)


@dataclass
class Server:
    answer: Answer
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_peer: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def drop(self) -> None:
        """Close every connection now."""
        for w in self.writers:
            w.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        self.connections += 1
        conn, n = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests.append(body)
                n += 1
                raw = self.answer(conn, n, body)
                if raw is None:
                    break
                if raw:
                    writer.write(raw)
                    await writer.drain()
                if isinstance(raw, Close):
                    break
        except asyncio.IncompleteReadError:
            self.closed_by_peer.set()
        finally:
            writer.close()


Serve = Callable[[Answer], Awaitable[Server]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def started(answer: Answer) -> Server:
        s = Server(answer)
        srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        servers.append(srv)
        s.port = srv.sockets[0].getsockname()[1]
        return s

    yield started
    for srv in servers:
        srv.close()


async def test_connections_are_kept_and_reused(serve: Serve) -> None:
    server = await serve(lambda c, n, body: ok(b'{"n": %d}' % n))
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    for i in range(1, 4):
        assert await client.post("/generate", b'{"x": 1}') == (200, b'{"n": %d}' % i)
    assert server.connections == 1 and server.requests == [b'{"x": 1}'] * 3
    together = await asyncio.gather(*(client.post("/generate", b"{}") for _ in range(5)))
    assert all(status == 200 for status, _ in together) and server.connections == 5  # one per request in flight
    client.close()


async def test_chunked_body_and_connection_close(serve: Serve) -> None:
    chunked = b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n"
    server = await serve(lambda c, n, body: chunked if n == 1 else ok(b"done", b"Connection: close\r\n"))
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    assert await client.post("/x", b"1") == (503, b'{"a": 1}')
    assert await client.post("/x", b"2") == (200, b"done")
    assert await client.post("/x", b"3") == (503, b'{"a": 1}')  # the server said close: a new connection
    assert server.connections == 2
    client.close()


async def test_a_connection_closed_while_idle_is_retried_once_on_a_new_one(serve: Serve) -> None:
    # Each connection answers one request, then closes on the next without a byte: a server that timed the
    # connection out just as the client reused it.
    server = await serve(lambda c, n, body: ok(b"c%d" % c) if n == 1 else None)
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    assert await client.post("/generate", b"a") == (200, b"c1")
    assert await client.post("/generate", b"b") == (200, b"c2")
    assert server.requests == [b"a", b"b", b"b"]


async def test_a_connection_older_than_the_idle_timeout_is_not_reused(serve: Serve) -> None:
    server = await serve(lambda c, n, body: ok(b"c%d" % c))
    client = Http1Client(f"http://127.0.0.1:{server.port}", idle_timeout=0.05)
    assert await client.post("/", b"a") == (200, b"c1")
    await asyncio.sleep(0.1)
    assert await client.post("/", b"b") == (200, b"c2")
    client.close()


async def test_an_answer_cut_short_is_an_error_and_not_retried(serve: Serve) -> None:
    server = await serve(lambda c, n, body: ok(b"x") if n == 1 else Close(ok(b"0123456789")[:-4]))
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    assert await client.post("/", b"a") == (200, b"x")
    with pytest.raises(ConnectionError):
        await client.post("/", b"b")
    assert server.requests == [b"a", b"b"] and server.connections == 1  # bytes came: never sent again


async def test_a_cancelled_request_closes_its_connection(serve: Serve) -> None:
    server = await serve(lambda c, n, body: b"")  # never answers
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    task = asyncio.ensure_future(client.post("/", b"a"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.closed_by_peer.wait(), 5)  # for SGLang: the request is aborted


async def test_timeout_closes_the_connection(serve: Serve) -> None:
    server = await serve(lambda c, n, body: b"")  # never answers
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    with pytest.raises(TimeoutError):
        await client.post("/", b"a", timeout=0.1)
    await asyncio.wait_for(server.closed_by_peer.wait(), 5)
    assert server.requests == [b"a"]  # a timeout is not retried


async def test_bytes_that_are_not_http(serve: Serve) -> None:
    server = await serve(lambda c, n, body: b"SSH-2.0-OpenSSH\r\n\r\n")
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    with pytest.raises(BadResponse):
        await client.post("/", b"a")


async def test_refused_connection_is_an_os_error() -> None:
    client = Http1Client("http://127.0.0.1:9")
    with pytest.raises(OSError):
        await client.post("/", b"a")
    with pytest.raises(ValueError):
        Http1Client("ftp://example.com")


async def test_a_reused_connection_that_dies_late_is_not_retried(serve: Serve) -> None:
    # The second request is held past the stale window, then its connection is closed without a byte: the
    # server had the request (not an idle close), so it is the caller's error and is not sent again.
    server = await serve(lambda c, n, body: ok(b"x") if n == 1 else b"")
    client = Http1Client(f"http://127.0.0.1:{server.port}")
    assert await client.post("/", b"a") == (200, b"x")
    task = asyncio.ensure_future(client.post("/", b"b"))
    await asyncio.sleep(0.5)
    assert not task.done()
    server.drop()
    with pytest.raises(ConnectionError):
        await task
    assert server.requests == [b"a", b"b"] and server.connections == 1


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_new_connection_lost_before_the_request_is_written_is_a_connection_error(loop: str) -> None:
    # The server accepted (the kernel did) and died before the request went out: its connection_lost ran while the
    # caller waited to be resumed after connecting. Writing then raises RuntimeError on uvloop (the handle is
    # closed) and is dropped silently on asyncio's loop (an answer awaited until the timeout): both must be a
    # prompt ConnectionError, which the gateway's pool takes for an unavailable backend.
    async def scenario() -> None:
        async def die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.abort()  # RST: what a SIGKILLed server's socket sends

        srv = await asyncio.start_server(die, "127.0.0.1", 0)
        client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        connect = client._connect

        async def connect_then_lose() -> Any:
            conn = await connect()
            for _ in range(200):
                if not conn.reusable:  # connection_lost ran (a fresh connection has answered nothing)
                    break
                await asyncio.sleep(0.01)
            assert not conn.reusable
            return conn

        client._connect = connect_then_lose  # type: ignore[method-assign]
        try:
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(client.post("/", b"a", timeout=30), 5)
        finally:
            srv.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(scenario())
    else:
        asyncio.run(scenario())
