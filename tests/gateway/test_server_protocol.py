"""The gateway's server protocol (gateway/server_protocol.py): a response's headers go out in the same write as its
body, never later than the event loop's next turn, and HTTP stays what uvicorn serves (checked over real sockets
with `rollway serve`'s uvicorn configuration: answers, keep-alive, streams whose first event is late, bodiless
answers, a client gone before its answer)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.server_protocol import GatewayHttpProtocol, OneWrite
from rollway.serve import server_config


class Recording:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        self.writes.append(b"".join(chunks))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_headers_and_body_go_out_in_one_write() -> None:
    async def main() -> None:
        t = Recording()
        w = OneWrite(t, asyncio.get_running_loop())  # type: ignore[arg-type]
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        assert t.writes == []
        w.write(b"body")
        w.write(b"more")
        assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]
        await asyncio.sleep(0)  # the scheduled flush finds nothing held
        assert len(t.writes) == 2 and w.get_extra_info("peername") == "info:peername"

    asyncio.run(main())


def test_held_headers_go_out_on_the_next_turn_and_before_a_close() -> None:
    async def main() -> None:
        t = Recording()
        w = OneWrite(t, asyncio.get_running_loop())  # type: ignore[arg-type]
        w.write(b"HEAD")
        await asyncio.sleep(0)
        assert t.writes == [b"HEAD"]  # a stream's first event may be late: its headers are not
        w.write(b"chunk")
        assert t.writes == [b"HEAD", b"chunk"]

        t2 = Recording()
        w2 = OneWrite(t2, asyncio.get_running_loop())  # type: ignore[arg-type]
        w2.write(b"HEAD")
        w2.close()
        assert t2.writes == [b"HEAD"] and t2.closed

        t3 = Recording()
        w3 = OneWrite(t3, asyncio.get_running_loop())  # type: ignore[arg-type]
        w3.write(b"HEAD")
        t3.closing = True  # the client left: nothing is written to a closing transport
        await asyncio.sleep(0)
        assert t3.writes == []

    asyncio.run(main())


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/json":
        out = b'{"echo": ' + str(len(body)).encode() + b"}"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})
    elif path == "/late-stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(1.0)
        await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    elif path == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = server_config(app, lifespan="on", timeout_graceful_shutdown=1)
    assert config.http is GatewayHttpProtocol
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)


def test_answers_and_keep_alive_over_real_sockets(server: str) -> None:
    with httpx.Client(base_url=server) as client:
        for n in (0, 5, 70_000):  # a body larger than one read
            r = client.post("/json", content=b"x" * n)
            assert r.status_code == 200 and r.json() == {"echo": n}
            assert r.headers["content-length"] == str(len(r.content))
        r = client.get("/empty")
        assert r.status_code == 204 and r.content == b""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:  # two requests on one connection, raw bytes back
        raw.sendall(b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
                    b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nz")
        data = b""
        raw.settimeout(5)
        while data.count(b"HTTP/1.1 200 OK") < 2 or not data.endswith(b'{"echo": 1}'):
            chunk = raw.recv(65536)
            assert chunk, data
            data += chunk
        assert data.index(b'{"echo": 3}') < data.index(b'{"echo": 1}')


def test_a_stream_sends_its_headers_before_its_late_first_event(server: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as client:
        t0 = time.monotonic()
        with client.stream("GET", "/late-stream") as r:
            headers_after = time.monotonic() - t0
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            text = b"".join(r.iter_bytes())
        assert headers_after < 0.8, headers_after  # the first event comes after 1 s
        assert text == b"data: one\n\ndata: [DONE]\n\n"


def test_a_client_gone_before_its_answer_leaves_the_server_serving(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"GET /late-stream HTTP/1.1\r\nhost: x\r\n\r\n")
    raw.close()
    time.sleep(1.3)
    with httpx.Client(base_url=server) as client:
        assert client.post("/json", content=b"ok").json() == {"echo": 2}
