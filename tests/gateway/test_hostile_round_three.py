"""Hostile input, round three: what a third adversarial probe found, on SQLite and PostgreSQL. Each request that
got a 500, put a Python repr or a misread value into the training prompt, or changed what it stored without a
word now gets a 400 (or the documented behaviour), in the OpenAI envelope."""

from __future__ import annotations

import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.continuity import canonical_message
from gateway.hf_messages import hf_message
from gateway.tool_decoders import INVALID, call_from_args, loads
from rollway_common.wire import decode_array
from tests.fakes.sglang import FakeSGLang
from tests.gateway.conftest import ids_of
from tests.gateway.test_hostile_input import OK, bad_request, chat, dumps
from tests.harness import ADMIN_KEY, LiveGateway

HUGE = "9" * 5000
"""An integer past Python's int_max_str_digits (4300): json.loads raises a ValueError that is no JSONDecodeError."""
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


@pytest.fixture
def cred(gateway: LiveGateway) -> dict[str, Any]:
    return gateway.group(2)["sessions"][0]  # type: ignore[no-any-return]


def post(gateway: LiveGateway, cred: dict[str, Any], path: str, body: Any,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", content=body if isinstance(body, bytes) else dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {cred['api_key']}", "Content-Type": "application/json",
                               **(headers or {})})


# --- 1. an integer past int_max_str_digits in tool-call arguments ---


def test_huge_integers_in_arguments_are_not_json_to_the_parsers() -> None:
    args = '{"a": ' + HUGE + "}"
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}
    assert canonical_message(call).tool_calls == (("f", "raw:" + args),)  # compared as the string it is
    assert hf_message(call)["tool_calls"][0]["function"]["arguments"] == args  # rendered as it came
    assert loads(args) is INVALID  # a model's reply holding one is no call, not a crash after generation
    assert call_from_args("f", args) is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_huge_integers_in_sent_arguments_are_no_500(tiny_model_dir: Path, db_url: str, path: str) -> None:
    """On a model whose context holds them (on the tiny one's 4,096 tokens the same request is a 400 for its
    length, which hid the 500 behind it for a shorter number)."""
    with FakeSGLang(vocab=range(100, 1000), context_length=32_768) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as gateway:
        _send_huge_arguments(gateway, gateway.group(1)["sessions"][0], path)


def _send_huge_arguments(gateway: LiveGateway, cred: dict[str, Any], path: str) -> None:
    args = '{"a": ' + HUGE + "}"
    if path == "/v1/chat/completions":
        body: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}]}
    else:
        body = {"model": "m", "max_output_tokens": 2, "input": [
            {"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": args},
            {"type": "function_call_output", "call_id": "c1", "output": "1"}]}
    for _ in range(2):  # the second extends the first's session: the parent search reads the arguments too
        r = post(gateway, cred, path, body)
        assert r.status_code == 200, r.text


# --- 2. Responses input items of the wrong type ---


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "user", "content": [{"type": "input_text", "text": {"k": "v"}}]}, "input.1.content.0.text"),
    ({"role": "user", "content": [{"type": "input_text", "text": 0}]}, "input.1.content.0.text"),
    ({"role": "user", "content": [{"type": "input_text", "text": False}]}, "input.1.content.0.text"),
    ({"type": "function_call", "call_id": "c", "name": {"a": [1]}, "arguments": "{}"}, "input.1.name"),
    ({"type": "function_call", "call_id": "c", "name": 7, "arguments": "{}"}, "input.1.name"),
    ({"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}, "input.1.name"),
    ({"type": "function_call", "call_id": {"a": 1}, "name": "f", "arguments": "{}"}, "input.1.call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": ["a"]}, "input.1.arguments"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}, "input.1.arguments"),
    ({"type": "function_call_output", "call_id": {"a": 1}, "output": "1"}, "input.1.call_id"),
    ({"type": "function_call_output", "call_id": 3, "output": "1"}, "input.1.call_id"),
])
def test_responses_items_of_the_wrong_type_are_a_400(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang,
                                                     item: dict[str, Any], param: str) -> None:
    before = len(fake.requests)
    r = post(gateway, cred, "/v1/responses", {"model": "m", "max_output_tokens": 2,
                                              "input": [{"role": "user", "content": "x"}, item]})
    bad_request(r)
    assert r.json()["error"]["param"] == param
    assert len(fake.requests) == before and gateway.session(cred["session_id"])["turns"] == []


def test_responses_arguments_as_an_object_are_its_json(gateway: LiveGateway, cred: dict[str, Any],
                                                       fake: FakeSGLang, tokenizer: Any) -> None:
    r = post(gateway, cred, "/v1/responses", {"model": "m", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"q": "é"}},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.requests[-1]["input_ids"])
    assert '"q": "é"' in prompt and "{'q'" not in prompt


def test_a_chat_shaped_tool_on_responses_says_so(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    r = post(gateway, cred, "/v1/responses", {"model": "m", "input": "x", "tools": [TOOL]})
    bad_request(r, "Chat Completions' shape")
    assert r.json()["error"]["param"] == "tools.0"


# --- 3. a served name with a slash ---


def test_a_model_name_with_a_slash_is_retrieved(fake: FakeSGLang, tiny_model_dir: Path, db_url: str) -> None:
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url,
                     served_model_name="org/model") as gw:
        cred = gw.group(1)["sessions"][0]
        oa = gw.openai(cred)
        assert [m.id for m in oa.models.list().data] == ["org/model"]
        assert oa.models.retrieve("org/model").id == "org/model"
        r = httpx.get(f"{gw.url}/sessions/{cred['session_id']}/v1/models/org/model", timeout=10)
        assert r.status_code == 200 and r.json()["id"] == "org/model", r.text


# --- 4. /v1/completions' max_tokens null ---


def test_completions_max_tokens_null_is_the_default(gateway: LiveGateway, cred: dict[str, Any],
                                                    fake: FakeSGLang) -> None:
    for body in ({"model": "m", "prompt": "hi", "max_tokens": None}, {"model": "m", "prompt": "hi"}):
        r = post(gateway, cred, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert fake.requests[-1]["sampling_params"]["max_new_tokens"] == 16


@pytest.mark.parametrize(("prompt", "text"), [
    ([1, -2], "token ids are 0"), ([1, 2.5], "a list of token ids"), ({"a": 1}, "a list of token ids"),
])
def test_a_bad_completions_prompt_names_the_prompt(gateway: LiveGateway, cred: dict[str, Any], prompt: Any,
                                                   text: str) -> None:
    r = post(gateway, cred, "/v1/completions", {"model": "m", "prompt": prompt})
    bad_request(r, text)
    assert r.json()["error"]["param"] == "prompt" and "prompt.str" not in r.json()["error"]["message"]


def test_a_completions_prompt_past_the_context_names_the_prompt(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    r = post(gateway, cred, "/v1/completions", {"model": "m", "prompt": "word " * 40_000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "prompt"


# --- 5. response_format and tools that mean nothing ---


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "response_format.json_schema.schema"),
])
def test_a_json_schema_response_format_without_a_schema_object_is_a_400(
    gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang, fmt: dict[str, Any], param: str
) -> None:
    before = len(fake.requests)
    r = chat(gateway, cred, {**OK, "response_format": fmt})
    bad_request(r)
    assert r.json()["error"]["param"] == param and len(fake.requests) == before


def test_an_empty_schema_still_allows_any_object(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang) -> None:
    r = chat(gateway, cred, {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert r.status_code == 200, r.text
    assert json.loads(fake.requests[-1]["sampling_params"]["json_schema"]) == {"type": "object"}


def test_a_tool_without_a_name_is_a_400(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    tool = {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}
    r = chat(gateway, cred, {**OK, "tools": [tool], "tool_choice": "required"})
    bad_request(r, "tools.0.function.name")


# --- 6. stop strings and a forced call ---


def test_stop_strings_do_not_cut_a_forced_call(gateway: LiveGateway, cred: dict[str, Any], fake: FakeSGLang,
                                               tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>'
    fake.script([ids_of(tokenizer, call)])
    r = chat(gateway, cred, {**OK, "max_tokens": 64, "tools": [TOOL], "tool_choice": "required",
                                "stop": ["</tool_call>"]})
    assert r.status_code == 200, r.text
    assert "stop" not in fake.requests[-1]["sampling_params"]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "f"
    turn = gateway.session(cred["session_id"])["turns"][-1]
    assert turn["request"]["asked"]["stop"] == ["</tool_call>"]  # recorded, as asked
    fake.script([ids_of(tokenizer, "plain")])
    assert chat(gateway, cred, {**OK, "stop": ["</tool_call>"]}).status_code == 200
    assert fake.requests[-1]["sampling_params"]["stop"] == ["</tool_call>"]  # applied when nothing is forced


# --- 7. the session list's query ---


@pytest.mark.parametrize("query", ["since=nan", "since=inf", "since=1e400", "state=zzz", "state=Active",
                                   "include_turns=maybe"])
def test_a_session_query_that_matches_nothing_by_mistake_is_a_400(gateway: LiveGateway, query: str) -> None:
    bad_request(gateway.admin.get(f"/v1/sessions?{query}"))


def test_the_session_query_still_takes_its_values(gateway: LiveGateway) -> None:
    for query in ("since=0", "state=active", "state=finished", "include_turns=true", "include_turns=0", "state="):
        r = gateway.admin.get(f"/v1/sessions?{query}")
        assert r.status_code == 200, (query, r.text)


# --- 8. smaller ones ---


def test_an_empty_anthropic_system_message_is_a_400(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}, {"role": "system", "content": ""}]}
    r = httpx.post(f"{gateway.url}/v1/messages", content=dumps(body), timeout=30,
                   headers={"x-api-key": cred["api_key"], "anthropic-version": "2023-06-01",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "system message" in r.json()["error"]["message"]


def test_a_compressed_body_is_a_415_that_says_why(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    r = post(gateway, cred, "/v1/chat/completions", gzip.compress(dumps(OK)), {"Content-Encoding": "gzip"})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_content_encoding" and "gzip" in err["message"]
    assert post(gateway, cred, "/v1/chat/completions", OK, {"Content-Encoding": "identity"}).status_code == 200


def test_a_turn_rewarded_twice_in_one_request_is_a_400(gateway: LiveGateway, cred: dict[str, Any]) -> None:
    turn_id = chat(gateway, cred, OK).json()["id"]
    r = post(gateway, cred, f"/v1/sessions/{cred['session_id']}/reward",
             {"turn_rewards": [{"turn_id": turn_id, "reward": 1}, {"turn_id": turn_id, "reward": 0}]})
    bad_request(r, "named twice")
    assert all(t["reward"] is None for t in gateway.session(cred["session_id"])["turns"])


# --- 9. a group's integers outside 64 bits ---


@pytest.mark.parametrize("task", ["18446744073709551616", "9223372036854775808", "-9223372036854775809",
                                  '{"ids": [1, 123456789012345678901234]}',
                                  pytest.param("9" * 300, id="300-digits")])
def test_a_task_integer_outside_64_bits_is_a_400(gateway: LiveGateway, task: str) -> None:
    before = gateway.admin.get("/v1/sessions").json()["data"]
    r = httpx.post(f"{gateway.url}/v1/groups", content=b'{"n_samples": 1, "task": ' + task.encode() + b"}",
                   headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}, timeout=30)
    bad_request(r, "outside 64 bits")
    assert gateway.admin.get("/v1/sessions").json()["data"] == before


def test_64_bit_integers_and_numbers_in_strings_are_kept_exactly(gateway: LiveGateway) -> None:
    for task in (9223372036854775807, -9223372036854775808, {"id": "18446744073709551616", "n": 2**63 - 1},
                 [2**63 - 1, "9" * 40]):
        group = gateway.group(1, task=task)
        stored = gateway.admin.get(f"/v1/groups/{group['group_id']}").json()["task"]
        assert stored == task and type(stored) is type(task), (stored, task)



# --- 10. a session ended while one of its calls generates ---


def _lease_turns(gw: LiveGateway) -> int:
    """Turns carried by the samples of one lease (format 2: each sample's `turn_ends`, a turn each)."""
    r = gw.admin.post("/v1/batches", json={"max_groups": 64, "lease_seconds": 30, "lease_format": 2})
    assert r.status_code == 200, r.text
    return sum(len(decode_array(s["turn_ends"])) for g in r.json()["groups"] for s in g["samples"])


@pytest.mark.parametrize("how", ["reward_finish", "finish", "group_rewards"])
def test_ending_a_session_waits_for_its_call_in_flight(tiny_model_dir: Path, db_url: str, how: str) -> None:
    """The probe's reproducer: a call still generating when its session was finished was stored after the group
    was leased (never trained). Now the end waits for it: the lease carries both turns."""
    with FakeSGLang(vocab=range(100, 1000), token_delay=0.01) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as gw:
        group = gw.group(1)
        cred = group["sessions"][0]
        sid = cred["session_id"]
        assert chat(gw, cred, OK).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(chat, gw, cred, {**OK, "max_tokens": 120})  # ~1.2 s of generation
            while not fake.running:
                time.sleep(0.01)
            if how == "reward_finish":
                r = post(gw, cred, f"/v1/sessions/{sid}/reward", {"reward": 1.0, "finish": True})
            elif how == "finish":
                assert post(gw, cred, f"/v1/sessions/{sid}/reward", {"reward": 1.0}).status_code == 200
                r = post(gw, cred, f"/v1/sessions/{sid}/finish", b"{}")
            else:
                r = gw.admin.post(f"/v1/groups/{group['group_id']}/rewards",
                                  json={"rewards": [{"session_id": sid, "reward": 1.0}], "finish": True})
            assert r.status_code == 200, r.text
            assert long.done()  # the end was answered after the call's turn was stored
            assert long.result().status_code == 200
        assert len(gw.session(sid)["turns"]) == 2
        assert _lease_turns(gw) == 2

