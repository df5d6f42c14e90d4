"""SGLang 0.5.23's refusals as its own code makes them (issue 27 items 3 and 4; docs/sglang-contract.md).

Item 3: a grammar xgrammar does not compile ends a *streamed* call with HTTP 200 and one chunk whose finish reason
is an abort carrying `status_code: 400` (`Req.set_finish_with_abort`, `TokenizerManager._handle_abort_finish_reason`).
That is the request's fault: every streaming route relays it as the client's 400, with no resubmission.
Item 4: the json_schema constraints SGLang refuses (`json_schema_validation.validate_xgrammar_json_schema`) are
refused by the gateway up front, naming the keyword; a forced tool call's parameter schema (inside a structural
tag, which SGLang does not check) is not.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rollway_common.json_schema_check import unsupported_reason
from tests.fakes.sglang import FakeSGLang
from tests.gateway.conftest import ids_of
from tests.harness import LiveGateway

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
COMPILE_ERROR = "Failed to compile structural_tag grammar: xgrammar: fake compile error"


def cred_of(gateway: LiveGateway) -> dict[str, Any]:
    return gateway.group(2)["sessions"][0]  # type: ignore[no-any-return]


def _sse_events(text: str) -> list[Any]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]


# -- item 3: streamed abort with a status --------------------------------------------------------------------


def test_the_fake_streams_a_compile_failure_as_sglang_does(fake: FakeSGLang) -> None:
    body = {"input_ids": [1, 2], "stream": True, "rid": "r1",
            "sampling_params": {"json_schema": json.dumps({"type": "integer", "multipleOf": 3})}}
    r = httpx.post(f"{fake.url}/generate", json=body, timeout=10)
    assert r.status_code == 200
    (chunk,) = _sse_events(r.text)
    finish = chunk["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 400 and finish["err_type"] == "BadRequestError"
    assert finish["message"].startswith("Failed to compile json grammar: JSON Schema at # is not supported by xgrammar")
    assert chunk["output_ids"] == [] and chunk["meta_info"]["completion_tokens"] == 0
    # The tokenizer manager's ValueError (two grammars) is an error event; a non-streamed call gets the 400.
    two = {**body, "sampling_params": {"json_schema": "{}", "regex": "a"}}
    (event,) = _sse_events(httpx.post(f"{fake.url}/generate", json=two, timeout=10).text)
    assert event["error"]["code"] == 400
    r = httpx.post(f"{fake.url}/generate", json={**body, "stream": False}, timeout=10)
    assert r.status_code == 400 and "multipleOf" in r.json()["error"]["message"]


def test_streamed_chat_relays_a_status_abort_as_400(gateway: LiveGateway, fake: FakeSGLang) -> None:
    oa = gateway.openai(cred_of(gateway))
    before = len(fake.requests)
    fake.abort_next(COMPILE_ERROR)
    with pytest.raises(openai.BadRequestError) as err:
        list(oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                        stream=True))
    assert "fake compile error" in err.value.body["message"]
    assert len(fake.requests) == before + 1  # not resubmitted as an interruption


def test_streamed_completions_relays_a_status_abort_as_400(gateway: LiveGateway, fake: FakeSGLang) -> None:
    oa = gateway.openai(cred_of(gateway))
    before = len(fake.requests)
    fake.abort_next("Failed to compile regex grammar: fake")
    with pytest.raises(openai.BadRequestError):
        list(oa.completions.create(model="m", prompt="1 + 1 =", max_tokens=4, stream=True))
    assert len(fake.requests) == before + 1


def test_streamed_responses_relays_a_status_abort_as_400(gateway: LiveGateway, fake: FakeSGLang) -> None:
    oa = gateway.openai(cred_of(gateway))
    before = len(fake.requests)
    fake.abort_next(COMPILE_ERROR)
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError):
        list(oa.responses.create(model="m", input="q", text=fmt, max_output_tokens=20, stream=True))
    assert len(fake.requests) == before + 1


def test_streamed_messages_relays_a_status_abort_as_400(gateway: LiveGateway, fake: FakeSGLang) -> None:
    cred = cred_of(gateway)
    client = anthropic.Anthropic(base_url=cred["anthropic_base_url"], api_key=cred["api_key"], max_retries=0)
    before = len(fake.requests)
    fake.abort_next(COMPILE_ERROR)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as err:
        with client.messages.stream(model="m", max_tokens=20, messages=MESSAGES, tools=[tool],  # type: ignore[arg-type]
                                    tool_choice={"type": "any"}) as stream:
            list(stream)
    assert "fake compile error" in str(err.value)
    assert len(fake.requests) == before + 1


def test_non_streamed_chat_relays_the_400(gateway: LiveGateway, fake: FakeSGLang) -> None:
    oa = gateway.openai(cred_of(gateway))
    fake.abort_next(COMPILE_ERROR)
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required")


# -- item 4: json_schema constraints SGLang refuses ----------------------------------------------------------

REFUSED = [
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}, "multipleOf"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if, then"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "color"}}}, "string format 'color'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 4}, "constraints pattern, minLength/maxLength"),
    ({"$defs": {"x": {"not": {"type": "null"}}}, "$ref": "#/$defs/x"}, "#/$defs/x"),
]


@pytest.mark.parametrize(("schema", "named"), REFUSED)
def test_unsupported_schema_refused_up_front(gateway: LiveGateway, fake: FakeSGLang, schema: Any, named: str) -> None:
    oa = gateway.openai(cred_of(gateway))
    before = len(fake.requests)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert named in err.value.body["message"] and err.value.body["param"] == "response_format"
    assert len(fake.requests) == before  # refused before any backend was called


def test_unsupported_schema_refused_on_responses_and_messages(gateway: LiveGateway, fake: FakeSGLang) -> None:
    cred = cred_of(gateway)
    before = len(fake.requests)
    schema = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}
    with pytest.raises(openai.BadRequestError) as err:
        gateway.openai(cred).responses.create(
            model="m", input="q", text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert "multipleOf" in err.value.body["message"] and err.value.body["param"] == "text.format"
    client = anthropic.Anthropic(base_url=cred["anthropic_base_url"], api_key=cred["api_key"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        client.messages.create(model="m", max_tokens=4, messages=MESSAGES,  # type: ignore[arg-type]
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert "multipleOf" in str(aerr.value)
    assert len(fake.requests) == before


def test_forced_tool_schemas_are_not_checked(gateway: LiveGateway, fake: FakeSGLang, tokenizer: Any) -> None:
    """SGLang compiles a structural tag's schemas without `validate_xgrammar_json_schema`: not refused."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}, "required": ["n"]}}}
    oa = gateway.openai(cred_of(gateway))
    call = '<tool_call>\n{"name": "pick", "arguments": {"n": 4}}\n</tool_call>'
    fake.script([ids_of(tokenizer, call)])
    r = oa.chat.completions.create(model="m", messages=MESSAGES, tools=[tool], tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "pick"
    assert "multipleOf" in fake.requests[-1]["sampling_params"]["structural_tag"]


def test_supported_schemas_pass() -> None:
    for schema in ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}},
                   {"type": "string", "minLength": 1, "maxLength": 3}, {"type": "integer", "minimum": 0},
                   {"type": "object", "properties": {"f": {"format": "date", "type": "integer", "pattern": "x"}}}):
        assert unsupported_reason(schema) is None, schema


# -- seeds (item 6) and aborts by rid ------------------------------------------------------------------------


def test_a_policy_seed_is_sent_as_sampling_seed(gateway: LiveGateway, fake: FakeSGLang) -> None:
    """SGLang 0.5.23 honours `sampling_seed` only with --enable-deterministic-inference (docs/sglang-contract.md)."""
    cred = gateway.group(2, sampling={"seed": 11})["sessions"][0]
    gateway.openai(cred).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert fake.requests[-1]["sampling_params"]["sampling_seed"] == 11
    cred = gateway.group(2, sampling={"allow_client_override": True})["sessions"][0]
    gateway.openai(cred).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, seed=5, stream=True)
    assert fake.requests[-1]["sampling_params"]["sampling_seed"] == 5


def test_the_fake_aborts_only_a_rid_it_holds(fake: FakeSGLang) -> None:
    """SGLang 0.5.23's `TokenizerManager.abort_request` (one tokenizer worker) drops an abort whose rid no request
    has exactly; a held rid aborts every rid it prefixes (the scheduler's `startswith`)."""
    import threading

    fake.token_delay = 0.05
    try:
        answers: dict[str, Any] = {}

        def run(rid: str) -> None:
            answers[rid] = httpx.post(f"{fake.url}/generate", json={
                "input_ids": [1, 2], "rid": rid, "sampling_params": {"max_new_tokens": 60}}, timeout=30).json()

        threads = [threading.Thread(target=run, args=(rid,)) for rid in ("abc_0", "abc")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while fake.running < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        httpx.post(f"{fake.url}/abort_request", json={"rid": "ab"}, timeout=10)  # held by none: dropped
        time.sleep(0.2)
        assert fake.running == 2
        httpx.post(f"{fake.url}/abort_request", json={"rid": "abc"}, timeout=10)  # held: abc and abc_0 end
        for t in threads:
            t.join(30)
        assert {r["meta_info"]["finish_reason"]["type"] for r in answers.values()} == {"abort"}
    finally:
        fake.token_delay = 0.0
