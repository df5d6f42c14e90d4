"""Hostile input found by an adversarial probe: each request that once got a 500, poisoned training data or
was silently misread now gets a 400 in the OpenAI envelope, on SQLite and PostgreSQL, and nothing of it is
generated or stored."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import httpx
import orjson
import pytest

from gateway.protocol import MAX_LOGGED_UNKNOWN, ChatCompletionRequest, note_unknown_fields
from gateway.routes.common import MAX_JSON_DEPTH
from gateway.services import app_serving
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def nested(depth: int, leaf: Any = 1, *, as_list: bool = False) -> Any:
    """A value `depth` levels deep (the outermost container counts as level 1)."""
    value = leaf
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value


def bad_request(r: httpx.Response, text: str = "") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and text in err["message"], err


@pytest.fixture
def cred(gateway: LiveGateway) -> dict[str, Any]:
    return gateway.group(2)["sessions"][0]  # type: ignore[no-any-return]


def dumps(value: Any) -> bytes:
    """JSON of any depth (orjson, like the gateway's writer, stops at 254 levels)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(value).encode()
    finally:
        sys.setrecursionlimit(limit)


def chat(gateway: LiveGateway, cred: dict[str, Any], body: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else dumps(body)
    return httpx.post(f"{gateway.url}/v1/chat/completions", content=raw, timeout=30,
                      headers={"Authorization": f"Bearer {cred['api_key']}", "Content-Type": "application/json"})


def reward(gateway: LiveGateway, cred: dict[str, Any], raw: bytes) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/sessions/{cred['session_id']}/reward", content=raw, timeout=30,
                      headers={"Authorization": f"Bearer {cred['api_key']}", "Content-Type": "application/json"})


# --- 1. non-finite numbers ---


@pytest.mark.parametrize("raw", [
    b'{"reward": "NaN", "finish": true}',
    b'{"reward": "Infinity", "finish": true}',
    b'{"reward": "-Infinity", "finish": true}',
    b'{"reward": NaN, "finish": true}',
    b'{"reward": 1e400, "finish": true}',
    b'{"turn_rewards": [{"turn_id": "t", "reward": "NaN"}], "finish": true}',
    b'{"turn_rewards": [{"turn_id": "t", "reward": "-Infinity"}]}',
])
def test_non_finite_reward_is_refused(gateway: LiveGateway, cred: dict[str, Any], raw: bytes) -> None:
    bad_request(reward(gateway, cred, raw))
    s = gateway.session(cred["session_id"])
    assert s["reward"] is None and s["state"] != "finished"


@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("top_p", "Infinity"),
                                          ("presence_penalty", "-Infinity")])
def test_non_finite_sampling_parameter_is_refused(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang,
                                                  field: str, value: str) -> None:
    before = len(fake.requests)
    bad_request(chat(gateway, cred, {**OK, field: value}), field)
    assert len(fake.requests) == before


def test_non_finite_sampling_policy_is_refused(gateway: LiveGateway) -> None:
    r = gateway.admin.post("/v1/groups", json={"task": {"q": 1}, "sampling": {"temperature": "NaN"}})
    bad_request(r, "temperature")


# --- 3. deep nesting: refused at parse time, before any generation ---


@pytest.mark.parametrize("make", [
    lambda: {**OK, "extra_field": nested(300)},
    lambda: {**OK, "metadata": nested(300)},
    lambda: {**OK, "extra_field": nested(1000, as_list=True)},
    lambda: {**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]},
])
def test_deep_chat_body_is_refused_before_generation(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang,
                                                     make: Any) -> None:
    before = len(fake.requests)
    bad_request(chat(gateway, cred, make()), "nested")
    assert len(fake.requests) == before
    assert gateway.session(cred["session_id"])["turns"] == []


def test_deep_streamed_chat_is_refused_before_the_stream(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    bad_request(chat(gateway, cred, {**OK, "stream": True, "extra_field": nested(300)}), "nested")


def test_deep_group_task_is_refused(gateway: LiveGateway) -> None:
    bad_request(gateway.admin.post("/v1/groups", content=dumps({"task": nested(1000, as_list=True)})),
                "nested")


def test_the_deepest_accepted_body_is_stored(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    """At the limit (the body itself is level 1), the turn generates and is stored, its extras included."""
    body = {**OK, "metadata": nested(MAX_JSON_DEPTH - 2)}
    assert chat(gateway, cred, body).status_code == 200
    assert len(gateway.session(cred["session_id"])["turns"]) == 1
    r = gateway.admin.post("/v1/groups", content=orjson.dumps({"task": nested(MAX_JSON_DEPTH - 2)}))
    assert r.status_code == 201, r.text


# --- 4. NUL characters (PostgreSQL can't store them; both stores now answer the same) ---


def test_nul_in_bodies_is_refused(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang) -> None:
    before = len(fake.requests)
    bad_request(chat(gateway, cred, {**OK, "messages": [{"role": "user", "content": "a\u0000b"}]}), "NUL")
    assert len(fake.requests) == before
    sid, key = cred["session_id"], cred["api_key"]
    r = httpx.post(f"{gateway.url}/v1/sessions/{sid}/abandon", json={"reason": "r\u0000"},
                   headers={"Authorization": f"Bearer {key}"})
    bad_request(r, "NUL")
    bad_request(reward(gateway, cred, orjson.dumps({"turn_rewards": [{"turn_id": "t\u0000", "reward": 1.0}]})), "NUL")
    assert gateway.session(sid)["state"] not in ("abandoned", "finished")
    # The text `\u0000` itself (an escaped backslash, then "u0000") is ordinary content.
    assert chat(gateway, cred, {**OK, "messages": [{"role": "user", "content": "a\\u0000b"}]}).status_code == 200


def test_a_replayed_history_is_checked_as_a_fresh_one(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    """A long session's replayed messages are handed over as their models (`MessageReuse`) and its body walked
    without the byte scans (`check_json_shape(walk=True)`): a NUL or a too-deep value in the new messages, or
    in the rest of the body, is refused as in a body seen for the first time."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    for i in range(6):
        history += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    assert chat(gateway, cred, {**OK, "messages": history}).status_code == 200
    assert chat(gateway, cred, {**OK, "messages": history}).status_code == 200  # the history is now kept
    bad_request(chat(gateway, cred, {**OK, "messages": [*history, {"role": "user", "content": "a\u0000b"}]}), "NUL")
    bad_request(chat(gateway, cred, {**OK, "messages": [*history, {"role": "user\u0000", "content": "x"}]}), "NUL")
    bad_request(chat(gateway, cred, {**OK, "messages": history, "metadata": nested(MAX_JSON_DEPTH)}), "nested")
    deep_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": json.dumps(nested(MAX_JSON_DEPTH + 1))}}]}
    bad_request(chat(gateway, cred, {**OK, "messages": [*history, deep_call]}), "nested")
    assert chat(gateway, cred, {**OK, "messages": [*history, {"role": "user", "content": "ok"}]}).status_code == 200


# --- 14. strict types ---


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("stream", "yes"), ("logprobs", 1),
                                          ("max_tokens", 2.0), ("top_logprobs", "3")])
def test_wrong_json_types_are_refused(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang, field: str,
                                      value: Any) -> None:
    before = len(fake.requests)
    bad_request(chat(gateway, cred, {**OK, field: value}), field)
    assert len(fake.requests) == before


def test_unknown_field_names_are_logged_a_bounded_number_of_times(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "rollway.gateway")
    for i in range(MAX_LOGGED_UNKNOWN + 50):
        note_unknown_fields(ChatCompletionRequest.model_validate({**OK, f"invented_{i}": 1}), "test.chat")
    lines = [r for r in caplog.records if "ignoring unknown request field" in r.getMessage()]
    assert 0 < len(lines) <= MAX_LOGGED_UNKNOWN


# --- 2. weight versions and paths are checked before anything is paused ---


@pytest.mark.parametrize("body, text", [
    ({"version": 2**31, "model_path": "/w"}, "version"),
    ({"version": 2**63, "model_path": "/w"}, "version"),
    ({"version": 1.5, "model_path": "/w"}, "version"),
    ({"version": "2", "model_path": "/w"}, "version"),
    ({"version": 2, "model_path": "0"}, "absolute path"),
    ({"version": 2, "model_path": "weights/v2"}, "absolute path"),
])
def test_bad_publish_is_refused_before_any_pause(gateway: LiveGateway, fake: FakeSGLang, body: dict[str, Any],
                                                  text: str) -> None:
    before = gateway.admin.get("/v1/weights").json()
    calls = len(fake.calls)
    bad_request(gateway.admin.post("/v1/weights", content=dumps(body)), text)
    assert len(fake.calls) == calls  # no pause, no load, no continue sent to the backend
    assert gateway.admin.get("/v1/weights").json() == before


def test_largest_version_still_records_turns(tmp_path: Any, tiny_model_dir: Any, sqlite_url: str) -> None:
    """The top of the accepted range is storable: turns generated under it are recorded with it."""
    with FakeSGLang(vocab=range(100, 1000)) as f, LiveGateway(backends=[f.url], tokenizer=str(tiny_model_dir),
                                                              db=sqlite_url) as gw:
        r = gw.admin.post("/v1/weights", json={"version": 2**31 - 1, "model_path": str(tmp_path)})
        assert r.status_code == 200, r.text
        cred = gw.group(1)["sessions"][0]
        assert chat(gw, cred, OK).status_code == 200
        (turn,) = gw.session(cred["session_id"])["turns"]
        assert set(turn["versions"]) == {2**31 - 1}


# --- 4. NUL characters in URLs: the same 400 on both stores ---


@pytest.mark.parametrize("path", [
    "/sessions/sess_%00/v1/models",
    "/v1/sessions/sess_%00",
    "/v1/groups/grp_%00",
    "/v1/sessions?state=finished%00",
    "/v1/sessions?after=%00",
    "/v1/batches/b%00/renew",
    "/v1/batches/b%00/ack",
])
def test_nul_in_url_is_refused(gateway: LiveGateway, path: str) -> None:
    method = "POST" if path.endswith(("renew", "ack")) else "GET"
    bad_request(gateway.admin.request(method, path, json={} if method == "POST" else None), "NUL")


# --- 5. an internal fault answers 500 in the envelope and leaves the keep-alive connection usable ---


def _raw_exchange(port: int, requests: list[bytes]) -> list[bytes]:
    """Send each request on one connection, reading each whole answer before the next."""
    import socket

    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        f = sock.makefile("rb")
        for req in requests:
            sock.sendall(req)
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                byte = f.read(1)
                assert byte, f"connection closed after {len(answers)} answer(s)"
                head += byte
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            answers.append(head + f.read(length))
    return answers


def test_internal_fault_keeps_the_connection(gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken() -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(app_serving(gateway.app).leases, "current_weights", broken)
    auth = f"Authorization: Bearer {gateway.admin.headers['Authorization'].split()[1]}\r\n".encode()
    req = b"GET /v1/weights HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    first, second = _raw_exchange(gateway.port, [req, health])
    assert first.startswith(b"HTTP/1.1 500")
    assert orjson.loads(first.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "server_error"
    assert second.startswith(b"HTTP/1.1 200")


def test_405_says_what_is_allowed(gateway: LiveGateway) -> None:
    r = gateway.admin.delete("/v1/groups")
    assert r.status_code == 405 and "POST" in r.headers["allow"], (r.status_code, r.headers)
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = gateway.admin.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_body_that_never_arrives_times_out(tiny_model_dir: Any, sqlite_url: str) -> None:
    import socket
    import time

    with FakeSGLang(vocab=range(100, 1000)) as f, LiveGateway(backends=[f.url], tokenizer=str(tiny_model_dir),
                                                              db=sqlite_url, body_timeout_s=1.0) as gw:
        cred = gw.group(1)["sessions"][0]
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + cred["api_key"].encode() + b"\r\nContent-Length: 100\r\n\r\n")
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - t0 < 5


# --- 6. backend URLs are validated: 400, saying what is supported ---


@pytest.mark.parametrize("url, text", [
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://[::1", "Invalid IPv6"),
    ("http://" + "x" * 70 + ".com:80", "not a valid domain name"),
    ("http://a..b:1", "not a valid domain name"),
    ("ftp://host:1", "https?"),
    ("http://u:p@host:1", "no user"),
    ("http://host:1/?q=1", "no user, query"),
])
def test_bad_backend_url_is_refused(gateway: LiveGateway, url: str, text: str) -> None:
    before = [b["url"] for b in gateway.admin.get("/v1/backends").json()["data"]]
    bad_request(gateway.admin.post("/v1/backends", json={"url": url}), text)
    assert [b["url"] for b in gateway.admin.get("/v1/backends").json()["data"]] == before


def test_unreachable_backend_is_a_400_not_a_500(gateway: LiveGateway) -> None:
    r = gateway.admin.post("/v1/backends", json={"url": "https://127.0.0.1:9"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "backend_unusable", r.text


def test_out_of_range_prompt_token_ids_are_refused(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    for ids in ([-1, 5], [2**31]):
        r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": ids, "max_tokens": 2},
                       headers={"Authorization": f"Bearer {cred['api_key']}"})
        bad_request(r, "prompt")


# --- 9. the lifecycle after the end: one rule, on both stores ---


def _post(gateway: LiveGateway, sid: str, action: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return gateway.admin.post(f"/v1/sessions/{sid}/{action}", json=body or {})


def test_nothing_changes_an_abandoned_session(gateway: LiveGateway) -> None:
    sid = gateway.group(2)["sessions"][0]["session_id"]
    assert _post(gateway, sid, "abandon", {"reason": "agent crashed"}).status_code == 200
    assert _post(gateway, sid, "abandon").json()["state"] == "abandoned"  # abandoning twice: a no-op
    for action, body in [("reward", {"reward": 1.0}), ("reward", {"reward": 1.0, "finish": True}), ("finish", None)]:
        r = _post(gateway, sid, action, body)
        assert r.status_code == 409 and "abandoned" in r.json()["error"]["message"], (action, r.text)
    s = gateway.session(sid)
    assert s["state"] == "abandoned" and s["reward"] is None


def test_a_finished_session_cannot_be_abandoned(gateway: LiveGateway) -> None:
    sid = gateway.group(2)["sessions"][0]["session_id"]
    assert _post(gateway, sid, "reward", {"reward": 1.0, "finish": True}).json()["state"] == "finished"
    assert _post(gateway, sid, "finish").json()["state"] == "finished"  # finish is idempotent
    r = _post(gateway, sid, "abandon", {"reason": "late"})
    assert r.status_code == 409 and "finished" in r.json()["error"]["message"]
    # its reward may still be overwritten until the group is leased
    assert _post(gateway, sid, "reward", {"reward": 0.5}).status_code == 200
    s = gateway.session(sid)
    assert s["state"] == "finished" and s["reward"] == 0.5


def test_a_host_no_http_client_can_use_is_refused(gateway: LiveGateway) -> None:
    """Found by the long fuzz run: IDNA accepted this host, aiohttp did not (a 500 while probing it)."""
    bad_request(gateway.admin.post("/v1/backends", json={"url": "http://\U000f8a5f\ufc61\\j\U000e064a/"}),
                "not a valid domain name or IP address")
