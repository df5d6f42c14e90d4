"""Run an ASGI app with uvicorn on a loopback port in a background thread (tests), or in the foreground
(`python -m tests.fakes.<name> --port N`). Stopping and starting again keeps the port, so a test can
take a fake server down (connection refused) and bring it back."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, loop: str = "asyncio") -> None:
        self.app = app
        self.host = host
        self.port = port
        self._loop = loop
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            loop=self._loop,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise RuntimeError(f"fake server on port {self.port} did not start")
            time.sleep(0.005)
        self._server, self._thread = server, thread

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)


def serve_forever(app: Any, host: str, port: int, *, fast: bool = False) -> None:
    """`python -m` entry: serve `app` in the foreground until interrupted."""
    options: dict[str, Any] = {"loop": "uvloop", "http": "httptools"} if fast else {}
    uvicorn.run(app, host=host, port=port, lifespan="off", log_level="warning", access_log=False, **options)
