"""A live gateway for tests: `create_app` under uvicorn on a loopback port, in a background thread.

Real HTTP, so the official `openai` client can connect; lifespan on, so the app builds its services
exactly as `rollway serve` does.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.settings import Settings
from rollway.serve import server_config

ADMIN_KEY = "rw-admin-test-key"


class LiveGateway:
    def __init__(self, **settings: Any) -> None:
        settings.setdefault("health_interval_s", 0.5)
        self.settings = Settings(**settings)
        self.app = create_app(self.settings, admin_key=ADMIN_KEY)
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveGateway:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = server_config(self.app, lifespan="on", timeout_graceful_shutdown=2)  # as `rollway serve` runs it
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start (see the log above)")
            time.sleep(0.01)
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.admin.close()
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(15)

    # --- conveniences ---

    def group(self, n: int = 2, task: Any = None, **extra: Any) -> dict[str, Any]:
        r = self.admin.post("/v1/groups", json={"task": task or {"q": "x"}, "n_samples": n, **extra})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def session(self, session_id: str) -> dict[str, Any]:
        r = self.admin.get(f"/v1/sessions/{session_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def openai(self, cred: dict[str, Any], **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, **kw)

    def async_openai(self, cred: dict[str, Any], **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, **kw)
