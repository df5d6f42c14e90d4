"""`GET /ready` is readiness (200 while a backend takes traffic, 503 with a reason otherwise), `GET /health`
liveness (200 whatever the backends do). Real gateway over real HTTP, a fake SGLang as the backend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from rollway.embedded import free_port
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


def _get(gw: LiveGateway, path: str) -> httpx.Response:
    return httpx.get(gw.url + path, timeout=10)  # no key: a load balancer has none


def _eventually(gw: LiveGateway, status: int, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = _get(gw, "/ready")
        if r.status_code == status or time.monotonic() > deadline:
            assert r.status_code == status, r.text
            body: dict[str, Any] = r.json()
            return body
        time.sleep(0.1)


def test_ready_follows_the_backend_and_health_does_not(tiny_model_dir: Path, sqlite_url: str) -> None:
    with FakeSGLang() as fake, LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url,
                                           health_interval_s=0.2) as gw:
        r = _get(gw, "/ready")
        assert r.status_code == 200 and r.json() == {"ready": True, "backends_healthy": 1, "backends": 1}
        fake.healthy = False  # /health answers 503: the pool's health loop takes it out of rotation
        body = _eventually(gw, 503)
        assert body["ready"] is False and body["backends_healthy"] == 0 and "no healthy backend" in body["reason"]
        assert fake.url not in str(body)  # served without a key: no internal address in it
        assert _get(gw, "/health").status_code == 200  # liveness: the process is fine
        fake.healthy = True
        assert _eventually(gw, 200)["ready"] is True


def test_a_dead_backend_is_not_ready_before_the_first_health_round(tiny_model_dir: Path, sqlite_url: str) -> None:
    # The pool admits the backends given at start before it has checked them; a health round an hour away
    # must not make /ready say yes meanwhile.
    dead = f"http://127.0.0.1:{free_port()}"
    with LiveGateway(backends=[dead], tokenizer=str(tiny_model_dir), db=sqlite_url, health_interval_s=3600) as gw:
        r = _get(gw, "/ready")
        assert r.status_code == 503, r.text
        assert r.json()["backends"] == 1 and r.json()["backends_healthy"] == 0
        with FakeSGLang(port=int(dead.rsplit(":", 1)[1])):  # it comes up: ready without waiting for a round
            assert _get(gw, "/ready").status_code == 200


def test_no_backend_at_all(tiny_model_dir: Path, sqlite_url: str) -> None:
    with LiveGateway(backends=[], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        r = _get(gw, "/ready")
        assert r.status_code == 503 and "POST /v1/backends" in r.json()["reason"]
        assert _get(gw, "/health").status_code == 200
