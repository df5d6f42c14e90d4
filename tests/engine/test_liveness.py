"""The engine's `/health`, `/ping` and `/ready` as SGLang 0.5.23's (engine/liveness.py): `/health` is a one-token
generation that a pause or a weight load holds back for SGLANG_HEALTH_CHECK_TIMEOUT, then 503 and the server marked
unhealthy; `/ping` a flag check, 200 while paused; `/ready` 200 only while up and not paused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.server import create_app
from tests.engine.conftest import LiveServer


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, Any]]:
    app = create_app(tiny_model_dir, max_batch_size=4)
    with LiveServer(app) as server:
        yield server, app.state.engine


def codes(url: str) -> dict[str, int]:
    return {p: httpx.get(url + p, timeout=30).status_code for p in ("/ping", "/ready")}


def test_health_waits_out_a_pause_then_marks_the_server_unhealthy(served: tuple[LiveServer, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = served
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")  # read per request; the server runs in this process
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert codes(server.url) == {"/ping": 200, "/ready": 200}
    assert httpx.post(server.url + "/pause_generation", json={"mode": "abort"}).status_code == 200
    try:
        assert codes(server.url) == {"/ping": 200, "/ready": 503}  # paused: alive, not ready
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
        assert 0.9 < time.monotonic() - t0 < 10  # it waited out the timeout
        assert codes(server.url) == {"/ping": 503, "/ready": 503}  # marked unhealthy
    finally:
        assert httpx.post(server.url + "/continue_generation", json={}).status_code == 200
    assert codes(server.url) == {"/ping": 503, "/ready": 503}  # until a /health passes
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert codes(server.url) == {"/ping": 200, "/ready": 200}


def test_health_waits_while_weights_load(served: tuple[LiveServer, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    server, engine = served
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    with engine.liveness.loads():
        assert httpx.get(server.url + "/ping", timeout=30).status_code == 200
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert codes(server.url) == {"/ping": 200, "/ready": 200}
