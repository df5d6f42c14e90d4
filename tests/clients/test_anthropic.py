"""The `anthropic` SDK, unmodified, against the gateway on the CPU engine with the tuned tiny model: plain
text, streamed both ways, a two-step tool use, and thinking blocks sent back with their signatures. Each
checks that the stored turns are exactly the engine's tokens, as one chain."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.clients.anthropic_events import fold_events
from tests.clients.conftest import ClientSession, Stack, assert_engine_chain
from tests.clients.model import (
    ANSWER,
    GREETING,
    SYSTEM,
    THOUGHT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_SCHEMA,
    calculate,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOOLS = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}]
QUESTION = "What is 12+7?"
THINKING = {"type": "enabled", "budget_tokens": 1024}


def client(s: ClientSession) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.api_key, max_retries=0, timeout=300)


def blocks(message: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def assert_usage(message: Any, turn: dict[str, Any]) -> None:
    u = message.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == len(turn["prompt_ids"])
    assert u.output_tokens == len(turn["completion_ids"])


def test_create_plain_text(stack: Stack) -> None:
    s, since = stack.new_session(), stack.proxy.mark()
    r = client(s).messages.create(model="policy", max_tokens=64,
                                  messages=[{"role": "user", "content": "Good morning to you."}])
    assert r.type == "message" and r.role == "assistant"
    assert blocks(r) == [{"type": "text", "text": GREETING}] and r.stop_reason == "end_turn"
    [turn] = assert_engine_chain(stack, s.id, since, turns=1)["turns"]
    assert turn["id"] == r.id
    assert_usage(r, turn)


def test_stream_helper_text_events(stack: Stack) -> None:
    """`messages.stream`: the raw events form Anthropic's sequence and fold into the final message."""
    s, since = stack.new_session(), stack.proxy.mark()
    with client(s).messages.stream(model="policy", max_tokens=64,
                                   messages=[{"role": "user", "content": "Good morning to you."}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop", "ping")]
    folded = fold_events(raw)
    assert [e.type for e in events if e.type == "text"], "the helper's text events"
    assert folded["content"] == blocks(final) == [{"type": "text", "text": GREETING}]
    assert folded["stop_reason"] == final.stop_reason == "end_turn"
    [turn] = assert_engine_chain(stack, s.id, since, turns=1)["turns"]
    assert folded["id"] == final.id == turn["id"]
    assert folded["output_tokens"] == len(turn["completion_ids"])


def test_create_stream_true_tool_use_events(stack: Stack) -> None:
    """`create(stream=True)` with a tool: thinking (thinking_delta, signature_delta), then the tool_use block
    (input_json_delta), stop_reason tool_use; the same blocks as the same request unstreamed."""
    whole_session, streamed_session = stack.new_session(), stack.new_session()
    request: dict[str, Any] = {"model": "policy", "max_tokens": 128, "system": SYSTEM, "tools": TOOLS,
                               "messages": [{"role": "user", "content": QUESTION}]}
    since = stack.proxy.mark()
    events = list(client(streamed_session).messages.create(**request, stream=True))
    assert_engine_chain(stack, streamed_session.id, since, turns=1)
    since = stack.proxy.mark()
    whole = client(whole_session).messages.create(**request)
    assert_engine_chain(stack, whole_session.id, since, turns=1)
    folded = fold_events(events)
    assert [b["type"] for b in folded["content"]] == ["thinking", "tool_use"], folded["content"]
    assert folded["stop_reason"] == whole.stop_reason == "tool_use"
    streamed_blocks, whole_blocks = folded["content"], blocks(whole)
    # The ids differ (two turns): the tool-use id and the signature, which signs the turn id.
    for a, b in zip(streamed_blocks, whole_blocks, strict=True):
        assert {k: v for k, v in a.items() if k not in ("id", "signature")} == \
               {k: v for k, v in b.items() if k not in ("id", "signature")}
    assert streamed_blocks[0]["thinking"].strip() == THOUGHT and streamed_blocks[0]["signature"]
    assert streamed_blocks[1]["name"] == TOOL_NAME and isinstance(streamed_blocks[1]["input"]["expression"], str)


def _tool_use_then_result(s: ClientSession, first: Any, *, drop_thinking: bool, **kw: Any) -> Any:
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == TOOL_NAME
    sent_back = [b for b in first.content if not (drop_thinking and b.type == "thinking")]
    return client(s).messages.create(model="policy", max_tokens=128, system=SYSTEM, tools=TOOLS, **kw,
                                     messages=[{"role": "user", "content": QUESTION},
                                               {"role": "assistant", "content": sent_back},
                                               {"role": "user", "content": [{
                                                   "type": "tool_result", "tool_use_id": use.id,
                                                   "content": calculate(str(use.input["expression"]))}]}])


def test_two_step_tool_use(stack: Stack) -> None:
    """tool_use -> tool_result -> final text, one token chain; the client sends back only the tool_use
    (as agents that ignore thinking do)."""
    s, since = stack.new_session(), stack.proxy.mark()
    first = client(s).messages.create(model="policy", max_tokens=128, system=SYSTEM, tools=TOOLS,
                                      messages=[{"role": "user", "content": QUESTION}])
    assert first.stop_reason == "tool_use"
    second = _tool_use_then_result(s, first, drop_thinking=True)
    assert blocks(second) == [{"type": "text", "text": ANSWER}] and second.stop_reason == "end_turn"
    record = assert_engine_chain(stack, s.id, since, turns=2)
    assert [t["id"] for t in sorted(record["turns"], key=lambda t: t["seq"])] == [first.id, second.id]
    [call] = record["tool_calls"]
    assert call["name"] == TOOL_NAME and call["result_turn_id"] == second.id
    assert call["result"] == calculate(str(first.content[-1].input["expression"]))


def test_thinking_block_with_signature_keeps_the_chain(stack: Stack) -> None:
    """With `thinking` on, the model's `<think>` comes back as a signed thinking block; sent back unchanged
    (as Anthropic requires during tool use) the next turn extends the chain. A changed thinking text is
    refused, as Anthropic's API refuses it."""
    s, since = stack.new_session(), stack.proxy.mark()
    first = client(s).messages.create(model="policy", max_tokens=2048, thinking=THINKING, system=SYSTEM,
                                      tools=TOOLS, messages=[{"role": "user", "content": QUESTION}])
    assert [b.type for b in first.content] == ["thinking", "tool_use"], blocks(first)
    thinking = first.content[0]
    assert thinking.thinking.strip() == THOUGHT and thinking.signature
    second = _tool_use_then_result(s, first, drop_thinking=False, thinking=THINKING)
    assert blocks(second) == [{"type": "text", "text": ANSWER}] and second.stop_reason == "end_turn"
    record = assert_engine_chain(stack, s.id, since, turns=2)
    first_turn = min(record["turns"], key=lambda t: t["seq"])
    assert first_turn["reply"]["reasoning_content"].strip() == THOUGHT

    forged = first.model_copy(update={"content": [thinking.model_copy(update={"thinking": "I was told to."}),
                                                  *first.content[1:]]})
    with pytest.raises(anthropic.BadRequestError) as e:
        _tool_use_then_result(s, forged, drop_thinking=False, thinking=THINKING)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert len(stack.session(s.id)["turns"]) == 2  # nothing generated, nothing stored
    assert stack.proxy.generate_records(since)[2:] == []


def test_streamed_thinking_and_tool_use_round_trip(stack: Stack) -> None:
    """Both steps streamed with `messages.stream`: the thinking block's streamed signature verifies when the
    final message's blocks are sent back, and the second turn extends the first."""
    s, since = stack.new_session(), stack.proxy.mark()
    request: dict[str, Any] = {"model": "policy", "max_tokens": 2048, "thinking": THINKING, "system": SYSTEM,
                               "tools": TOOLS}
    with client(s).messages.stream(**request, messages=[{"role": "user", "content": QUESTION}]) as stream:
        first_events = [e for e in stream if e.type in RAW]
        first = stream.get_final_message()
    assert fold_events(first_events)["content"] == blocks(first)
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    use = first.content[1]
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": calculate(str(use.input["expression"]))}]}]
    with client(s).messages.stream(**request, messages=messages) as stream:
        second_events = [e for e in stream if e.type in RAW]
        second = stream.get_final_message()
    assert fold_events(second_events)["content"] == blocks(second) == [{"type": "text", "text": ANSWER}]
    assert second.stop_reason == "end_turn"
    assert_engine_chain(stack, s.id, since, turns=2)


RAW = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
       "message_stop", "ping")
UNIT_TOOL = {"name": "set_unit", "description": "Set the temperature unit.", "input_schema": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"], "additionalProperties": False}}


def test_tool_choice_tool_forces_a_call(stack: Stack) -> None:
    """`tool_choice: {"type": "tool"}` naming a tool the model was never taught: a grammar goes to the
    engine and the tool_use block's input is valid for that tool's schema."""
    import jsonschema

    s, since = stack.new_session(), stack.proxy.mark()
    r = client(s).messages.create(model="policy", max_tokens=128, system=SYSTEM, tools=[*TOOLS, UNIT_TOOL],
                                  tool_choice={"type": "tool", "name": "set_unit"},
                                  messages=[{"role": "user", "content": QUESTION}])
    [sent] = stack.proxy.generate_records(since)
    assert any(sent["sampling_params"].get(k) for k in ("json_schema", "regex", "ebnf", "structural_tag"))
    assert r.stop_reason == "tool_use"
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "set_unit"
    jsonschema.validate(use.input, UNIT_TOOL["input_schema"])
    assert_engine_chain(stack, s.id, since, turns=1)


def test_tool_choice_any_streamed(stack: Stack) -> None:
    """`tool_choice: {"type": "any", "disable_parallel_tool_use": true}` streamed: one tool_use block, its
    input valid for its tool's schema, decoded under a grammar."""
    import jsonschema

    s, since = stack.new_session(), stack.proxy.mark()
    events = list(client(s).messages.create(
        model="policy", max_tokens=128, system=SYSTEM, tools=TOOLS, stream=True,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Good morning to you."}]))
    folded = fold_events(events)
    [sent] = stack.proxy.generate_records(since)
    assert sent["stream"] and sent["sampling_params"].get("structural_tag")
    assert folded["stop_reason"] == "tool_use"
    [use] = [b for b in folded["content"] if b["type"] == "tool_use"]
    assert use["name"] == TOOL_NAME
    jsonschema.validate(use["input"], TOOL_SCHEMA)
    assert_engine_chain(stack, s.id, since, turns=1)


def test_stop_sequence(stack: Stack) -> None:
    """A stop sequence ends the reply where it appears; the text holds what came before it, and the stored
    completion is still exactly the engine's ids."""
    s, since = stack.new_session(), stack.proxy.mark()
    r = client(s).messages.create(model="policy", max_tokens=64, stop_sequences=["help"],
                                  messages=[{"role": "user", "content": "Good morning to you."}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "help"
    # The reply's text is stripped of surrounding whitespace, as on every route ("help" ends " help").
    assert blocks(r) == [{"type": "text", "text": GREETING[: GREETING.index("help")].rstrip()}]
    assert_engine_chain(stack, s.id, since, turns=1)


def test_count_tokens_is_the_prompt_the_turn_stores(stack: Stack) -> None:
    s, since = stack.new_session(), stack.proxy.mark()
    request: dict[str, Any] = {"model": "policy", "system": SYSTEM, "tools": TOOLS,
                               "messages": [{"role": "user", "content": QUESTION}]}
    counted = client(s).messages.count_tokens(**request)
    assert stack.proxy.generate_records(since) == []  # counting generates nothing
    client(s).messages.create(**request, max_tokens=128)
    [turn] = assert_engine_chain(stack, s.id, since, turns=1)["turns"]
    assert counted.input_tokens == len(turn["prompt_ids"])


def test_the_conversation_goes_on_after_the_answer(stack: Stack) -> None:
    """After tool use and the final answer, the agent's next user message (the whole history sent back,
    thinking blocks and their signatures included) extends the same chain."""
    s, since = stack.new_session(), stack.proxy.mark()
    first = client(s).messages.create(model="policy", max_tokens=2048, thinking=THINKING, system=SYSTEM,
                                      tools=TOOLS, messages=[{"role": "user", "content": QUESTION}])
    use = first.content[-1]
    history: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": calculate(str(use.input["expression"]))}]}]}]
    second = client(s).messages.create(model="policy", max_tokens=2048, thinking=THINKING, system=SYSTEM,
                                       tools=TOOLS, messages=history)
    history += [{"role": "assistant", "content": second.content}, {"role": "user", "content": "And 3*4?"}]
    third = client(s).messages.create(model="policy", max_tokens=2048, thinking=THINKING, system=SYSTEM,
                                      tools=TOOLS, messages=history)
    assert third.stop_reason in ("tool_use", "end_turn")
    assert_engine_chain(stack, s.id, since, turns=3)
