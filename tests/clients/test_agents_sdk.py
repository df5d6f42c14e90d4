"""The OpenAI Agents SDK, unmodified: `Runner.run_streamed` with a function tool against the gateway on the
CPU engine with the tuned tiny model, events consumed through `stream_events()`. The model thinks, calls the
tool, the SDK runs it and sends the result back, and the model answers; both turns are the engine's tokens,
one chain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.clients import model
from tests.clients.conftest import ClientSession, Stack, assert_engine_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = "What is 12+7?"


async def _run_streamed(s: ClientSession, calls: list[str], agent_input: Any = QUESTION,
                        **settings: Any) -> tuple[Any, list[Any]]:
    from openai import AsyncOpenAI

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI

    @function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        calls.append(expression)
        return model.calculate(expression)

    client = AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0, timeout=300)
    try:
        agent = Agent(name="calculator", instructions=model.SYSTEM, tools=[calculate],
                      model=OpenAIResponsesModel(model="policy", openai_client=client),
                      model_settings=ModelSettings(max_tokens=128, **settings))
        result = Runner.run_streamed(agent, input=agent_input, max_turns=4)
        events = [e async for e in result.stream_events()]
    finally:
        await client.close()
    return result, events


def _responses(raw: list[Any]) -> list[list[Any]]:
    """The raw Responses events split per response (each from response.created to response.completed)."""
    out: list[list[Any]] = []
    for e in raw:
        if e.type == "response.created":
            out.append([])
        assert out, f"{e.type} before response.created"
        out[-1].append(e)
    return out


def test_run_streamed_with_a_function_tool(stack: Stack) -> None:
    s, since = stack.new_session(), stack.proxy.mark()
    calls: list[str] = []
    result, events = asyncio.run(asyncio.wait_for(_run_streamed(s, calls), timeout=600))

    assert len(calls) == 1 and isinstance(calls[0], str), calls
    assert result.final_output == model.ANSWER
    items = [e.name for e in events if e.type == "run_item_stream_event"]
    assert items == ["reasoning_item_created", "tool_called", "tool_output", "message_output_created"], items

    raw = [e.data for e in events if e.type == "raw_response_event"]
    first, second = _responses(raw)
    for events_of_one in (first, second):
        kinds = [e.type for e in events_of_one]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") >= 1
        assert [e.sequence_number for e in events_of_one] == sorted({e.sequence_number for e in events_of_one})
    kinds = [e.type for e in first]
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    done = next(e for e in first if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in first if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments
    assert [i.type for i in first[-1].response.output] == ["reasoning", "function_call"]
    assert first[-1].response.output[0].summary[0].text.strip() == model.THOUGHT
    text = "".join(e.delta for e in second if e.type == "response.output_text.delta")
    assert text == model.ANSWER
    assert [i.type for i in second[-1].response.output] == ["message"]

    record = assert_engine_chain(stack, s.id, since, turns=2)
    turns = sorted(record["turns"], key=lambda t: t["seq"])
    for response_events, turn in zip((first, second), turns, strict=True):
        completed = response_events[-1].response
        assert completed.id == turn["id"]
        assert completed.usage.output_tokens == len(turn["completion_ids"])
        assert completed.usage.input_tokens == len(turn["prompt_ids"])
    [call] = record["tool_calls"]
    assert call["name"] == "calculate" and call["result"] == model.calculate(calls[0])


def test_run_streamed_with_tool_choice_required(stack: Stack) -> None:
    """`ModelSettings(tool_choice="required")`: the first response is decoded under a grammar (a call, no
    reasoning: the grammar starts at the call), the SDK then resets the choice and the model answers. What it
    answers is not checked: it was trained on calls after a thought only, and after a forced call without one its
    words differ between machines (CPU kernels) and SFT lengths."""
    s, since = stack.new_session(), stack.proxy.mark()
    calls: list[str] = []
    result, events = asyncio.run(asyncio.wait_for(_run_streamed(s, calls, tool_choice="required"), timeout=600))
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output
    items = [e.name for e in events if e.type == "run_item_stream_event"]
    assert items == ["tool_called", "tool_output", "message_output_created"], items
    forced, free = stack.proxy.generate_records(since)
    assert forced["sampling_params"].get("structural_tag"), forced["sampling_params"]
    assert not free["sampling_params"].get("structural_tag"), free["sampling_params"]
    assert_engine_chain(stack, s.id, since, turns=2)


def test_a_second_run_on_the_first_runs_items_extends_the_chain(stack: Stack) -> None:
    """A chat app's next message: `result.to_input_list()` (reasoning, call, output and answer items as the
    SDK keeps them) plus a new user message, streamed again; all the turns are one chain."""
    s, since = stack.new_session(), stack.proxy.mark()
    calls: list[str] = []
    first, _ = asyncio.run(asyncio.wait_for(_run_streamed(s, calls), timeout=600))
    again = [*first.to_input_list(), {"role": "user", "content": "What is 3*4?"}]
    second, _ = asyncio.run(asyncio.wait_for(_run_streamed(s, calls, agent_input=again), timeout=600))
    assert first.final_output == model.ANSWER and isinstance(second.final_output, str)
    # Whatever the model does with a second question (it was never taught one), every turn extends the chain:
    # two of the first run, one per call of the second and its final answer.
    assert_engine_chain(stack, s.id, since, turns=2 + (len(calls) - 1) + 1)
