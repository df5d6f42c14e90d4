"""Bad input: each case answers the right status and OpenAI envelope, and stores no partial turn."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.services import app_serving
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


def envelope(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cred(gateway: LiveGateway) -> dict[str, Any]:
    return gateway.group(2)["sessions"][0]


def post(gateway: LiveGateway, cred: dict[str, Any], body: Any, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {cred['api_key']}", **kw.pop("headers", {})}
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers, timeout=30)
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def turn_count(gateway: LiveGateway, cred: dict[str, Any]) -> int:
    return len(gateway.session(cred["session_id"])["turns"])


OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "m"}, 400, "messages"),
    ({"model": "m", "messages": "hi"}, 400, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({**OK, "max_tokens": "ten"}, 400, "max_tokens"),
    ({**OK, "temperature": 7}, 400, "temperature"),
    ({**OK, "n": 3}, 400, "n"),
    ({**OK, "max_tokens": 100_000}, 400, "max_tokens"),
    ({**OK, "messages": [{"role": "user", "content": "7 " * 5000}]}, 400, "messages"),
    ({**OK, "tool_choice": "required"}, 400, "tool_choice"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
])
def test_bad_request_bodies(gateway: LiveGateway, fake: FakeSGLang, cred: dict[str, Any], body: Any, status: int,
                            param: str | None) -> None:
    before_turns, before_calls = turn_count(gateway, cred), len(fake.requests)
    err = envelope(post(gateway, cred, body), status)
    if param:
        assert err["param"] == param
    assert turn_count(gateway, cred) == before_turns  # no partial turn
    assert len(fake.requests) == before_calls  # nothing reached the backend


def test_context_length_is_checked_before_the_backend(gateway: LiveGateway, fake: FakeSGLang,
                                                      cred: dict[str, Any]) -> None:
    before = len(fake.requests)
    err = envelope(post(gateway, cred, {**OK, "max_tokens": app_serving(gateway.app).context_length}), 400)
    assert err["code"] == "context_length_exceeded"
    assert len(fake.requests) == before


def test_body_over_the_limit_is_413(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    big = {**OK, "messages": [{"role": "user", "content": "x" * (gateway.settings.max_body_bytes + 10)}]}
    envelope(post(gateway, cred, big), 413)


def test_auth_statuses(gateway: LiveGateway) -> None:
    g = gateway.group(2)
    a, b = g["sessions"]
    envelope(httpx.post(f"{gateway.url}/v1/chat/completions", json=OK), 401)
    envelope(post(gateway, {"api_key": "rw-nope"}, OK), 401)
    envelope(post(gateway, {"api_key": gateway.admin.headers["Authorization"].split()[1]}, OK), 403)
    # a session key can neither read nor write another session, nor use admin routes
    hdr = {"Authorization": f"Bearer {a['api_key']}"}
    envelope(httpx.get(f"{gateway.url}/v1/sessions/{b['session_id']}", headers=hdr), 403)
    envelope(httpx.post(f"{gateway.url}/v1/sessions/{b['session_id']}/reward", json={"reward": 1}, headers=hdr), 403)
    envelope(httpx.post(f"{gateway.url}/v1/groups", json={"task": 1}, headers=hdr), 403)
    envelope(httpx.post(f"{gateway.url}/v1/batches", json={}, headers=hdr), 403)
    assert httpx.get(f"{gateway.url}/v1/sessions/{a['session_id']}", headers=hdr).status_code == 200
    envelope(gateway.admin.get("/v1/sessions/sess_unknown"), 404)
    envelope(httpx.post(f"{gateway.url}/sessions/sess_unknown/v1/chat/completions", json=OK), 404)
    envelope(gateway.admin.get("/no/such/route"), 404)


def test_ended_session_is_409(gateway: LiveGateway) -> None:
    cred = gateway.group(2)["sessions"][0]
    assert gateway.admin.post(f"/v1/sessions/{cred['session_id']}/finish").status_code == 200
    envelope(post(gateway, cred, OK), 409)
    assert turn_count(gateway, cred) == 0


def test_backend_down_is_503_with_retry_after(tiny_model_dir: Any, sqlite_url: str) -> None:
    fake = FakeSGLang()
    fake.start()
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        cred = gw.group(2)["sessions"][0]
        fake.stop()
        r = post(gw, cred, OK)
        envelope(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
        assert turn_count(gw, cred) == 0


def test_admin_key_errors(gateway: LiveGateway) -> None:
    envelope(httpx.post(f"{gateway.url}/v1/groups", json={"task": 1}), 401)
    envelope(gateway.admin.post("/v1/groups", json={"task": 1, "n_samples": 0}), 400)
    envelope(gateway.admin.post("/v1/groups", json={"n_samples": 2}), 400)
    envelope(gateway.admin.post("/v1/sessions/x/reward", content=b"nope"), 400)


def test_an_unreachable_or_locked_store_is_503_with_retry_after() -> None:
    """Store failures from any driver (SQLAlchemy's, sqlite3's, asyncpg's) are the same retryable answer."""
    import sqlite3

    import asyncpg
    import orjson

    from gateway.routes.common import error_response

    for exc in (sqlite3.OperationalError("database is locked"), asyncpg.CannotConnectNowError("starting up"),
                asyncpg.TooManyConnectionsError("too many")):
        r = error_response(exc)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert orjson.loads(r.body)["error"]["code"] == "store_unavailable"
