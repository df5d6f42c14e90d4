"""The OpenAI SDK, unmodified: chat completions with `tool_choice="required"` and with a named function,
against the gateway on the CPU engine (its grammar engine) with the tuned tiny model. The reply is the tool
call asked for, its arguments valid for the tool's schema; the engine was asked to decode under a grammar;
the stored turn is the engine's tokens."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from tests.clients import model
from tests.clients.conftest import ClientSession, Stack, assert_engine_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
# A tool the model was never taught to call: only a grammar makes it call this one.
UNIT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"unit": {"type": "string",
                               "enum": ["celsius", "fahrenheit"]}}, "required": ["unit"], "additionalProperties": False}
SET_UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Set the temperature unit.",
                                             "parameters": UNIT_SCHEMA}}


def client(s: ClientSession) -> OpenAI:
    return OpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0, timeout=300)


def _forced_call(stack: Stack, tools: list[dict[str, Any]], tool_choice: Any, content: str) -> tuple[Any, dict[str, Any]]:
    s, since = stack.new_session(), stack.proxy.mark()
    r = client(s).chat.completions.create(
        model="policy", max_tokens=128, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
        messages=[{"role": "system", "content": model.SYSTEM}, {"role": "user", "content": content}])
    [sent] = stack.proxy.generate_records(since)
    assert any(sent["sampling_params"].get(k) for k in GRAMMAR_KEYS), sent["sampling_params"]
    [turn] = assert_engine_chain(stack, s.id, since, turns=1)["turns"]
    assert turn["id"] == r.id
    assert turn["constrained"] is True  # recorded as decoded under a grammar (kept out of the loss by default)
    return r.choices[0], turn


def test_tool_choice_required(stack: Stack) -> None:
    choice, turn = _forced_call(stack, [model.openai_tool()], "required", "Good morning to you.")
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == model.TOOL_NAME
    jsonschema.validate(json.loads(call.function.arguments), model.TOOL_SCHEMA)
    assert turn["reply"]["tool_calls"][0]["function"]["arguments"] == call.function.arguments


def test_tool_choice_named_function(stack: Stack) -> None:
    """Named, the call is set_unit, a tool the model was never taught (left alone it never calls it: the
    control below)."""
    choice, _ = _forced_call(stack, [model.openai_tool(), SET_UNIT],
                             {"type": "function", "function": {"name": "set_unit"}}, "What is 12+7?")
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "set_unit"
    jsonschema.validate(json.loads(call.function.arguments), UNIT_SCHEMA)


def test_auto_never_calls_set_unit(stack: Stack) -> None:
    """The control for the named test: with tool_choice auto the same request gets no grammar and no set_unit
    call (the tuned model, trained with calculate alone, makes no well-formed call with two tools offered)."""
    s, since = stack.new_session(), stack.proxy.mark()
    r = client(s).chat.completions.create(
        model="policy", max_tokens=128, tools=[model.openai_tool(), SET_UNIT],
        messages=[{"role": "system", "content": model.SYSTEM}, {"role": "user", "content": "What is 12+7?"}])
    [sent] = stack.proxy.generate_records(since)
    assert not any(sent["sampling_params"].get(k) for k in GRAMMAR_KEYS), sent["sampling_params"]
    assert "set_unit" not in [c.function.name for c in r.choices[0].message.tool_calls or []]
    assert_engine_chain(stack, s.id, since, turns=1)


def test_tool_choice_required_streamed(stack: Stack) -> None:
    """The same forced call streamed: the tool call arrives in the chunks, valid for the schema."""
    s, since = stack.new_session(), stack.proxy.mark()
    chunks = list(client(s).chat.completions.create(
        model="policy", max_tokens=128, tools=[model.openai_tool(), SET_UNIT], stream=True,
        tool_choice={"type": "function", "function": {"name": "set_unit"}},
        messages=[{"role": "system", "content": model.SYSTEM}, {"role": "user", "content": "What is 12+7?"}]))
    [sent] = stack.proxy.generate_records(since)
    assert sent["stream"] and sent["sampling_params"].get("structural_tag")
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert [tc.function.name for tc in calls if tc.function.name] == ["set_unit"]
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    jsonschema.validate(json.loads(arguments), UNIT_SCHEMA)
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    [turn] = assert_engine_chain(stack, s.id, since, turns=1)["turns"]
    assert turn["id"] == chunks[0].id


def test_constrained_turn_is_out_of_the_loss(stack: Stack) -> None:
    """RL correctness: tokens sampled under a grammar are not samples of the policy, so the leased sample
    of a session whose first turn was forced has loss mask 0 on that turn's completion and 1 on the free
    answer after the tool's result."""
    from rollway_common.wire import decode_array

    s, since = stack.new_session(), stack.proxy.mark()
    messages: list[dict[str, Any]] = [{"role": "system", "content": model.SYSTEM},
                                      {"role": "user", "content": "What is 12+7?"}]
    first = client(s).chat.completions.create(model="policy", max_tokens=128, tools=[model.openai_tool()],
                                              tool_choice="required", messages=messages)
    calls = first.choices[0].message.tool_calls  # "required" allows several: the grammar decides, not training
    assert calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": call.id,
                    "content": model.calculate(json.loads(call.function.arguments)["expression"])} for call in calls)]
    second = client(s).chat.completions.create(model="policy", max_tokens=128, tools=[model.openai_tool()],
                                               messages=messages)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    forced, free = sorted(assert_engine_chain(stack, s.id, since, turns=2)["turns"], key=lambda t: t["seq"])

    with stack.admin() as http:
        r = http.post(f"/v1/sessions/{s.id}/reward", json={"reward": 1.0, "finish": True})
        assert r.status_code == 200, r.text
        lease = http.post("/v1/batches", json={"max_groups": 64, "wait_seconds": 10})
        assert lease.status_code == 200, lease.text
        batch = lease.json()
        try:
            [group] = [g for g in batch["groups"] if g["group_id"] == s.group_id]
            [sample] = group["samples"]
            ids, mask = decode_array(sample["token_ids"]), decode_array(sample["loss_mask"])
        finally:
            if batch["batch_id"]:
                http.post(f"/v1/batches/{batch['batch_id']}/ack", json={})
    assert ids == free["prompt_ids"] + free["completion_ids"]
    start, end = len(forced["prompt_ids"]), len(forced["prompt_ids"]) + len(forced["completion_ids"])
    assert ids[start:end] == forced["completion_ids"] and set(mask[start:end]) == {0}
    assert set(mask[len(free["prompt_ids"]):]) == {1}
    assert sum(mask) == len(free["completion_ids"])
