"""What an admin may register as a backend, and how the gateway reaches a secured one (issue 29 item 12):
the URL policy (gateway.backend_policy), a health probe that never follows a redirect, and SGLang's
`--api-key` / `--admin-api-key` scheme, enforced by the CPU engine (engine.auth) and sent by the gateway's
client, over real HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from engine.auth import ADMIN_ROUTES, allowed
from gateway.backend_policy import check_registrable
from gateway.settings import backend_url
from tests.fakes.serve import ServerThread
from tests.gateway.test_hostile_input import OK, chat
from tests.harness import LiveGateway

API, ADMIN = "rw-engine-api", "rw-engine-admin"


# --- the URL policy ---


@pytest.mark.parametrize("url", [
    "http://169.254.169.254", "http://169.254.169.254/latest/meta-data", "http://169.254.170.2:80",
    "http://[fe80::1]:30000", "http://[fe80::a9fe:a9fe]", "http://[::ffff:169.254.169.254]:80",
    "http://[fd00:ec2::254]", "http://100.100.100.200",
    "http://metadata.google.internal", "http://METADATA.google.internal.:80", "http://metadata",
    "http://instance-data", "http://metadata.goog",
    "http://2852039166", "http://0xa9fea9fe", "http://0251.0376.0251.0376", "http://169.254.43518",
    "http://0xa9.0xfe.0xa9.0xfe", "http://127.1:30000", "http://017700000001:30000",
    "http://0.0.0.0:30000", "http://[::]:30000", "http://224.0.0.1", "http://255.255.255.255",
])
def test_refused_backend_urls(gateway: LiveGateway, url: str) -> None:
    before = gateway.admin.get("/v1/backends").json()["data"]
    r = gateway.admin.post("/v1/backends", json={"url": url})
    assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
    assert gateway.admin.get("/v1/backends").json()["data"] == before


@pytest.mark.parametrize("url", ["http://127.0.0.1:30000", "http://localhost:30000", "http://10.0.0.5:30000",
                                 "http://192.168.1.20:8000", "http://[::1]:30000", "https://sglang.internal.example",
                                 "http://sglang:30000", "http://beef.cafe", "http://node-1.cluster.local:30000"])
def test_accepted_backend_urls(url: str) -> None:
    assert check_registrable(backend_url(url)) == url


def test_a_name_that_resolves_to_a_refused_address_is_refused(gateway: LiveGateway, monkeypatch: Any) -> None:
    """`localhost.` resolves to loopback; a name resolving to link-local is refused at registration. The
    resolver is the gateway's own (its loop's getaddrinfo), so this uses a name every resolver knows: none
    resolves to 169.254.x by default, hence the check through the policy function itself."""
    import asyncio

    from gateway import backend_policy

    async def fake_getaddrinfo(*_: Any, **__: Any) -> list[Any]:
        return [(2, 1, 6, "", ("169.254.169.254", 80))]

    async def run() -> str:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "getaddrinfo", fake_getaddrinfo)
        try:
            await backend_policy.check_resolved("http://innocent.example:80")
        except ValueError as e:
            return str(e)
        return ""

    assert "169.254.169.254" in asyncio.run(run())


# --- the health probe never follows a redirect ---


class Hits:
    def __init__(self) -> None:
        self.n = 0


@pytest.fixture
def redirecting() -> Iterator[tuple[str, Hits]]:
    """A server whose every path redirects (307) to another server on another port, which counts its hits."""
    hits = Hits()

    async def target(request: Request) -> Response:
        hits.n += 1
        return JSONResponse({"model_path": "m", "weight_version": "0"})

    other = ServerThread(Starlette(routes=[Route("/{p:path}", target, methods=["GET", "POST"])]))
    other.start()

    async def redirect(request: Request) -> Response:
        return RedirectResponse(f"{other.url}{request.url.path}", 307)

    front = ServerThread(Starlette(routes=[Route("/{p:path}", redirect, methods=["GET", "POST"])]))
    front.start()
    try:
        yield front.url, hits
    finally:
        front.stop()
        other.stop()


def test_the_health_probe_does_not_follow_redirects(gateway: LiveGateway, redirecting: tuple[str, Hits]) -> None:
    url, hits = redirecting
    r = gateway.admin.post("/v1/backends", json={"url": url})
    assert r.status_code == 400 and r.json()["error"]["code"] == "backend_unusable", r.text
    assert hits.n == 0


# --- SGLang's key scheme ---


@pytest.mark.parametrize("api_key, admin_key, path, sent, ok", [
    # no keys: everything open
    ("", "", "/generate", None, True), ("", "", "/pause_generation", None, True),
    # --api-key only: every route but the probes needs it (SGLang's legacy behaviour)
    (API, "", "/generate", None, False), (API, "", "/generate", API, True),
    (API, "", "/pause_generation", API, True), (API, "", "/pause_generation", "x", False),
    # --admin-api-key only: normal routes stay open, the admin ones take the admin key only
    ("", ADMIN, "/generate", None, True), ("", ADMIN, "/pause_generation", None, False),
    ("", ADMIN, "/pause_generation", ADMIN, True), ("", ADMIN, "/model_info", None, True),
    # both: the API key on normal routes (not the admin key), the admin key on admin routes (not the API key)
    (API, ADMIN, "/generate", API, True), (API, ADMIN, "/generate", ADMIN, False),
    (API, ADMIN, "/pause_generation", API, False), (API, ADMIN, "/pause_generation", ADMIN, True),
    (API, ADMIN, "/update_weights_from_disk", ADMIN, True), (API, ADMIN, "/server_info", API, True),
    # the probes are always open
    (API, ADMIN, "/health", None, True), (API, ADMIN, "/health_generate", None, True),
    (API, ADMIN, "/metrics", None, True),
])
def test_the_engine_decides_as_sglang(api_key: str, admin_key: str, path: str, sent: str | None, ok: bool) -> None:
    header = None if sent is None else f"Bearer {sent}"
    assert allowed("POST", path, header, api_key, admin_key) is ok


def test_every_admin_route_the_gateway_calls_is_an_admin_route() -> None:
    from gateway.sglang import NORMAL_ROUTES

    assert {"/pause_generation", "/continue_generation", "/abort_request", "/update_weights_from_disk",
            "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
            "/load_lora_adapter", "/unload_lora_adapter", "/flush_cache", "/update_weight_version"} <= ADMIN_ROUTES
    assert not NORMAL_ROUTES & ADMIN_ROUTES


@pytest.fixture(scope="module")
def secured_engine(tiny_model_dir: Path) -> Iterator[str]:
    from engine.server import create_app
    from tests.engine.conftest import LiveServer

    app = create_app(tiny_model_dir, max_batch_size=4, api_key=API, admin_api_key=ADMIN)
    with LiveServer(app) as server:
        yield server.url
    app.state.engine.scheduler.stop()


def test_the_secured_engine_refuses_callers_without_its_keys(secured_engine: str) -> None:
    assert httpx.get(f"{secured_engine}/health").status_code == 200
    for headers in ({}, {"Authorization": f"Bearer {API}"}, {"Authorization": "Bearer nope"}):
        r = httpx.post(f"{secured_engine}/pause_generation", json={"mode": "abort"}, headers=headers)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = httpx.post(f"{secured_engine}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 401
    assert httpx.get(f"{secured_engine}/model_info", headers={"Authorization": f"Bearer {API}"}).status_code == 200


def test_the_gateway_sends_the_keys(secured_engine: str, tiny_model_dir: Path, db_url: str) -> None:
    with LiveGateway(backends=[secured_engine], tokenizer=str(tiny_model_dir), db=db_url,
                     backend_api_key=API, backend_admin_api_key=ADMIN) as gw:
        cred = gw.group(1)["sessions"][0]
        assert chat(gw, cred, OK).status_code == 200
        assert chat(gw, cred, {**OK, "stream": True}).status_code == 200
        # a publish: pause, load, continue, each with the admin key
        r = gw.admin.post("/v1/weights", json={"version": 1, "model_path": str(tiny_model_dir)})
        assert r.status_code == 200 and r.json()["failed_backends"] == {}, r.text
        info = httpx.get(f"{secured_engine}/model_info", headers={"Authorization": f"Bearer {API}"}).json()
        assert info["weight_version"] == "1"


def test_a_gateway_without_the_keys_gets_no_generation(secured_engine: str, tiny_model_dir: Path,
                                                        sqlite_url: str) -> None:
    """The engine's 401 is that backend failing (its configuration), not the client's request: a 503."""
    with LiveGateway(backends=[secured_engine], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        cred = gw.group(1)["sessions"][0]
        r = chat(gw, cred, OK)
        assert r.status_code == 503, r.text
