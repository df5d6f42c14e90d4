"""Hostile input, round two (issue 29): each reproducer of the probe, on SQLite and PostgreSQL, now gets a 400
in the OpenAI envelope (or, for a broken backend, fails over), and nothing of it is generated or stored."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from gateway.protocol import MAX_ABS_REWARD
from rollway_common.wire import decode_array
from tests.fakes.sglang import FakeSGLang
from tests.gateway.test_hostile_input import OK, bad_request, chat, dumps, reward
from tests.harness import LiveGateway


@pytest.fixture
def cred(gateway: LiveGateway) -> dict[str, Any]:
    return gateway.group(2)["sessions"][0]  # type: ignore[no-any-return]


def post(gateway: LiveGateway, cred: dict[str, Any], path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", content=body if isinstance(body, bytes) else dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {cred['api_key']}", "Content-Type": "application/json"})


# --- 1. rewards beyond float32 ---


@pytest.mark.parametrize("raw", [
    b'{"reward": 1e308, "finish": true}',
    b'{"reward": -1e308}',
    b'{"reward": 1000000.5}',
    b'{"reward": 1e155}',
    b'{"turn_rewards": [{"turn_id": "t", "reward": 1e308}], "finish": true}',
])
def test_a_reward_outside_the_range_is_refused(gateway: LiveGateway, cred: dict[str, Any], raw: bytes) -> None:
    bad_request(reward(gateway, cred, raw), "reward")
    s = gateway.session(cred["session_id"])
    assert s["reward"] is None and s["state"] != "finished"


def test_group_rewards_beyond_float32_are_refused_and_leases_stay_finite(gateway: LiveGateway) -> None:
    """The probe's reproducer: two sessions of a group rewarded 1e308 with `finish: true` gave `inf` returns in
    the lease. Now a 400, nothing stored; at the edge of the range (1e6) the lease's returns are finite."""
    group = gateway.group(2)
    for s in group["sessions"]:
        assert chat(gateway, s, OK).status_code == 200
    body = {"rewards": [{"session_id": s["session_id"], "reward": 1e308} for s in group["sessions"]], "finish": True}
    bad_request(gateway.admin.post(f"/v1/groups/{group['group_id']}/rewards", content=dumps(body)), "reward")
    assert all(gateway.session(s["session_id"])["reward"] is None for s in group["sessions"])
    body["rewards"] = [{"session_id": s["session_id"], "reward": r}
                       for s, r in zip(group["sessions"], (MAX_ABS_REWARD, -MAX_ABS_REWARD), strict=True)]
    assert gateway.admin.post(f"/v1/groups/{group['group_id']}/rewards", json=body).status_code == 200
    r = gateway.admin.post("/v1/batches", json={"max_groups": 64, "lease_seconds": 30})
    assert r.status_code == 200, r.text
    mine = [g for g in r.json()["groups"] if g["group_id"] == group["group_id"]]
    assert mine, "the rewarded group was not leased"
    returns = [x for s in mine[0]["samples"] for x in decode_array(s["returns"])]
    assert returns and all(math.isfinite(x) for x in returns)
    assert {abs(x) for x in returns if x} == {MAX_ABS_REWARD}


# --- 4. deep JSON inside tool-call argument strings ---

DEEP_ARGUMENTS = ["[" * 5000 + "]" * 5000, '{"a": ' * 990 + "1" + "}" * 990]


@pytest.mark.parametrize("arguments", DEEP_ARGUMENTS, ids=["list-5000", "object-990"])
def test_deep_tool_call_arguments_are_refused(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang,
                                              arguments: str) -> None:
    before = len(fake.requests)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    bad_request(chat(gateway, cred, {**OK, "messages": messages}), "nested")
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    bad_request(post(gateway, cred, "/v1/responses", {"model": "m", "input": items, "max_output_tokens": 2}),
                "nested")
    assert len(fake.requests) == before
    assert gateway.session(cred["session_id"])["turns"] == []


def test_brackets_inside_argument_strings_do_not_count(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    """Only nesting counts: a flat argument string full of brackets (inside a JSON string) is ordinary."""
    arguments = json.dumps({"code": "[" * 700 + "{" * 700})
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = chat(gateway, cred, {**OK, "messages": messages})
    assert r.status_code == 200, r.text


# --- 5. a backend that answers 200 with a body that is not JSON ---


class HtmlBackend(FakeSGLang):
    """A server that answers /generate 200 with an HTML page (a proxy's error page, a broken build)."""

    async def _generate(self, request: Request) -> Response:
        await request.body()
        self.requests.append({})
        return Response(b"<html><body>502 Bad Gateway</body></html>", 200, media_type="text/html")


def test_a_backend_answering_non_json_fails_over(tiny_model_dir: Any, db_url: str) -> None:
    with HtmlBackend(vocab=range(100, 1000)) as broken, FakeSGLang(vocab=range(100, 1000)) as good, \
            LiveGateway(backends=[broken.url, good.url], tokenizer=str(tiny_model_dir), db=db_url,
                        health_interval_s=60) as gw:
        creds = [gw.group(1)["sessions"][0] for _ in range(16)]
        answers = [chat(gw, c, {**OK, "stream": i % 2 == 1}) for i, c in enumerate(creds)]
        assert [a.status_code for a in answers] == [200] * 16, [a.text[:200] for a in answers if a.status_code != 200]
        assert broken.requests, "the broken backend was never tried"
        status = {b["url"]: b for b in gw.admin.get("/v1/backends").json()["data"]}
        assert status[broken.url]["healthy"] is False and "not JSON" in status[broken.url]["last_error"]
        assert all(len(gw.session(c["session_id"])["turns"]) == 1 for c in creds)


# --- 6. Anthropic Messages with `messages` of the wrong type ---


@pytest.mark.parametrize("value", [5, True, 1.5, "hi", None])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_of_the_wrong_type_are_a_400(gateway: LiveGateway, cred: dict[str, Any], path: str,
                                              value: Any) -> None:
    r = post(gateway, cred, path, {"model": "m", "max_tokens": 4, "messages": value})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


# --- 7. what the columns hold ---


def test_an_abandon_reason_longer_than_its_column_is_a_400(gateway: LiveGateway, cred: dict[str, Any],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    sid = cred["session_id"]
    r = post(gateway, cred, f"/v1/sessions/{sid}/abandon", {"reason": "r" * 129})
    bad_request(r, "reason")
    assert gateway.session(sid)["state"] == "active"
    assert sid not in caplog.text
    r = post(gateway, cred, f"/v1/sessions/{sid}/abandon", {"reason": "r" * 128})
    assert r.status_code == 200 and r.json()["state"] == "abandoned"


def test_loss_tokens_beyond_int4_are_a_400(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    sample = {"session_id": cred["session_id"], "group_id": "g", "advantage": 0.5, "loss_tokens": 2**31}
    body = {"step": 1, "version": 1, "samples": [sample]}
    bad_request(gateway.admin.post("/v1/training/steps", json=body), "loss_tokens")
    sample["loss_tokens"] = 2**31 - 1
    r = gateway.admin.post("/v1/training/steps", json=body)
    assert r.status_code == 200, r.text


def test_sql_errors_do_not_carry_their_parameters(db_url: str) -> None:
    """An SQL error's message reaches the log whole: it must not hold session ids or keys."""
    import sqlalchemy
    from sqlalchemy import text

    from gateway.store.db import create_engine

    async def run() -> str:
        engine = create_engine(db_url)
        try:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT * FROM no_such_table WHERE id = :sid"), {"sid": "sess_secret_42"})
        except sqlalchemy.exc.SQLAlchemyError as e:
            return str(e)
        finally:
            await engine.dispose()
        return ""

    message = asyncio.run(run())
    assert "no_such_table" in message and "sess_secret_42" not in message


# --- 8. chat_template_kwargs that collide with render()'s own argument ---


@pytest.mark.parametrize("kwargs", [{"self": 1}, {"self": "x", "enable_thinking": False}])
def test_chat_template_kwargs_self_is_a_400(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang,
                                            kwargs: dict[str, Any]) -> None:
    before = len(fake.requests)
    bad_request(chat(gateway, cred, {**OK, "chat_template_kwargs": kwargs}), "self")
    assert len(fake.requests) == before


def test_settings_refuse_chat_template_kwargs_self() -> None:
    from gateway.settings import Settings

    with pytest.raises(ValueError, match="self"):
        Settings(chat_template_kwargs={"self": 1})


# --- 11. a thinking block's signature is bound to its session ---


def test_a_thinking_signature_from_another_session_is_refused(gateway: LiveGateway, fake: FakeSGLang,
                                                              tokenizer: Any) -> None:
    from tests.gateway.conftest import ids_of

    a, b = gateway.group(2)["sessions"]
    fake.script([ids_of(tokenizer, "<think>secret plan</think>ok")])
    first = post(gateway, a, "/v1/messages", {"model": "m", "max_tokens": 40, "messages": [
        {"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert first.status_code == 200, first.text
    blocks = first.json()["content"]
    assert blocks[0]["type"] == "thinking" and blocks[0]["signature"]
    replay = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": blocks},
        {"role": "user", "content": "go on"}]}
    n = len(fake.requests)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = post(gateway, b, path, replay)  # session B replays session A's block
        assert r.status_code == 400 and "signature" in r.json()["error"]["message"], r.text
    assert len(fake.requests) == n and gateway.session(b["session_id"])["turns"] == []
    assert post(gateway, a, "/v1/messages", replay).status_code == 200  # its own session takes it


def test_raw_bodies_reach_the_depth_check(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    """The argument check also holds for a body written by hand (not through json.dumps)."""
    arguments = "[" * 5000 + "]" * 5000
    raw = orjson.dumps({**OK, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "user", "content": "hi"}]})
    bad_request(chat(gateway, cred, raw), "nested")
