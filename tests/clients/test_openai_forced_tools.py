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
    if "constrained" in turn:  # recorded as decoded under a grammar (kept out of the loss by default)
        assert turn["constrained"] is True
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
