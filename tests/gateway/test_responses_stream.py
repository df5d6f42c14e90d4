"""Streamed Responses (`stream: true` on /v1/responses) over real HTTP against a scripted fake backend: the
event sequence, checked against the `openai` package's own event types; the OpenAI SDK's
`responses.create(stream=True)` and `responses.stream`; the Agents SDK's `Runner.run_streamed` with a
function tool; failures and disconnects; and the turn stored as the backend emitted it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from tests.gateway.conftest import ids_of

TOOL = {"type": "function", "name": "calculate", "description": "evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "37+48"}}\n</tool_call>'
REPLY = "<think>37 plus 48 is 85.</think>I will check it with the tool." + CALL


def sse_events(gateway: Any, cred: dict[str, Any], body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event of one streamed call."""
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", f"{gateway.url}/v1/responses", json={"model": "m", "stream": True, **body},
                      headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                assert line != "data: [DONE]"
                events.append((name or "", json.loads(line[len("data: "):])))
                name = None
    return events


def test_event_sequence_is_what_the_openai_types_accept(gateway: Any, fake: Any, tokenizer: Any) -> None:
    from openai.types.responses import ResponseStreamEvent

    cred = gateway.group(2)["sessions"][0]
    emitted = ids_of(tokenizer, REPLY)
    fake.script([emitted])
    events = sse_events(gateway, cred, {"input": "what is 37+48?", "tools": [TOOL], "max_output_tokens": 200})
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)  # every event is one of the SDK's types, all required fields set
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    kinds = [d["type"] for _, d in events]
    # collapse the deltas: the shape of the sequence
    shape = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and i and kinds[i - 1] == k)]
    assert shape == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and events[0][1]["response"]["id"] == final["id"]
    reasoning, message, call = final["output"]
    assert reasoning["summary"][0]["text"] == "37 plus 48 is 85."
    assert message["content"][0]["text"] == "I will check it with the tool."
    assert call["name"] == "calculate" and json.loads(call["arguments"]) == {"expression": "37+48"}
    deltas = "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta")
    assert deltas == message["content"][0]["text"]
    # each item's done event carries what the final response lists, at the same index
    done_items = [(d["output_index"], d["item"]) for _, d in events if d["type"] == "response.output_item.done"]
    assert done_items == list(enumerate(final["output"]))
    turn = gateway.session(cred["session_id"])["turns"][-1]
    assert turn["id"] == final["id"] and turn["completion_ids"] == emitted
    assert turn["reply"]["tool_calls"][0]["id"] == call["call_id"]  # the stored call is the streamed one
    assert final["usage"]["output_tokens"] == len(emitted)
    assert final["usage"]["input_tokens"] == len(turn["prompt_ids"])


def test_streamed_equals_whole(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    emitted = ids_of(tokenizer, REPLY)
    fake.script([emitted, emitted])
    whole = client.responses.create(model="m", input="q1", tools=[TOOL], max_output_tokens=200)
    events = list(client.responses.create(model="m", input="q2", tools=[TOOL], max_output_tokens=200, stream=True))
    final = events[-1]
    assert final.type == "response.completed"

    def shape(r: Any) -> list[Any]:
        return [(o.type, getattr(o, "name", None), getattr(o, "arguments", None),
                 [c.text for c in getattr(o, "content", None) or []], [s.text for s in getattr(o, "summary", [])])
                for o in r.output]

    assert shape(final.response) == shape(whole)
    assert final.response.usage.output_tokens == whole.usage.output_tokens == len(emitted)


def test_sdk_stream_helper_text(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    emitted = ids_of(tokenizer, "The answer is 85, since 37 + 48 = 85.")
    fake.script([emitted])
    deltas = []
    with client.responses.stream(model="m", input="37+48?", max_output_tokens=40) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.output_text == "The answer is 85, since 37 + 48 = 85." == "".join(deltas)
    assert len(deltas) > 1  # streamed as generated, not in one piece
    turn = gateway.session(cred["session_id"])["turns"][-1]
    assert turn["id"] == final.id and turn["completion_ids"] == emitted and turn["finish_reason"] == "stop"


def test_max_output_tokens_is_response_incomplete(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    events = sse_events(gateway, cred, {"input": "go on", "max_output_tokens": 5})
    name, last = events[-1]
    assert name == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 5


def test_failure_after_start_is_response_failed_and_recorded(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    fake.fail_stream(3, "fake: the model broke")
    events = sse_events(gateway, cred, {"input": "break", "max_output_tokens": 20})
    name, last = events[-1]
    assert name == "response.failed" and last["response"]["status"] == "failed"
    assert "the model broke" in last["response"]["error"]["message"]
    from openai.types.responses import ResponseStreamEvent

    TypeAdapter(ResponseStreamEvent).validate_python(last)
    deadline = time.monotonic() + 10
    turns: list[Any] = []
    while not turns and time.monotonic() < deadline:
        turns = gateway.session(cred["session_id"])["turns"]
        time.sleep(0.05)
    assert turns and turns[-1]["finish_reason"] == "abort"


def test_stream_refusals_are_400_before_streaming(gateway: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    r = httpx.post(f"{gateway.url}/v1/responses", headers={"Authorization": f"Bearer {cred['api_key']}"},
                   json={"model": "m", "input": "x", "stream": True, "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_agents_sdk_run_streamed_with_a_tool(gateway: Any, fake: Any, tokenizer: Any) -> None:
    """`Runner.run_streamed`: the model calls the tool, the SDK runs it, the model answers; the two turns are
    one token chain in the store, each exactly what the backend emitted."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    cred = gateway.group(2)["sessions"][0]
    calls: list[str] = []

    @agents.function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        return "85"

    first = ids_of(tokenizer, "<think>I need the tool.</think>" + CALL)
    second = ids_of(tokenizer, "The answer is 85.")
    fake.script([first, second])

    async def run() -> tuple[Any, list[Any]]:
        client = AsyncOpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0)
        model = agents.OpenAIResponsesModel(model="m", openai_client=client)
        agent = agents.Agent(name="calc", instructions="Use the tool.", model=model, tools=[calculate])
        result = agents.Runner.run_streamed(agent, "What is 37+48?",
                                            run_config=agents.RunConfig(tracing_disabled=True))
        seen = [e async for e in result.stream_events()]
        await client.close()
        return result, seen

    result, seen = asyncio.run(run())
    assert calls == ["37+48"]
    assert result.final_output == "The answer is 85."
    items = [e.item.type for e in seen if e.type == "run_item_stream_event"]
    assert items == ["reasoning_item", "tool_call_item", "tool_call_output_item", "message_output_item"]
    raw = [e.data.type for e in seen if e.type == "raw_response_event"]
    assert raw.count("response.completed") == 2 and "response.output_text.delta" in raw
    turns = gateway.session(cred["session_id"])["turns"]
    assert [t["completion_ids"] for t in turns] == [first, second]
    assert turns[1]["parent_id"] == turns[0]["id"] and turns[1]["continuity"] == "extends"
    assert result.raw_responses[0].response_id == turns[0]["id"]


# --- streamed /v1/completions: the same streaming core, the legacy chunk form ---------------------------


def test_completions_stream_equals_whole(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    emitted = ids_of(tokenizer, "The answer is 85, since 37 + 48 = 85.")
    fake.script([emitted, emitted])
    whole = client.completions.create(model="m", prompt="Q: 37+48?\nA:", max_tokens=40)
    chunks = list(client.completions.create(model="m", prompt="Q: 37+48?\nA:", max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}, logprobs=0, stop=["zzz"]))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(emitted)
    turn = gateway.session(cred["session_id"])["turns"][-1]
    assert turn["id"] == chunks[0].id and turn["completion_ids"] == emitted
    streamed_lps = [lp for c in text_chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]
    assert streamed_lps == pytest.approx(turn["logprobs"], abs=1e-6)


def test_completions_stream_token_prompt_to_length(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    chunks = list(client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=7, stream=True))
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert len(gateway.session(cred["session_id"])["turns"][-1]["completion_ids"]) == 7


@pytest.mark.parametrize(("pieces", "stops", "out"), [
    (["whichlif", "e", "Word", "more"], ["eWor"], "whichlif"),  # the stop token runs past the string
    (["ab", "cXY", "Zd"], ["XYZ", "Q"], "abc"),
    (["no stop ", "here"], ["zzz"], "no stop here"),
    (["a", "b"], [], "ab"),
])
def test_stop_string_holdback(pieces: list[str], stops: list[str], out: str) -> None:
    from gateway.routes.streaming import _StopHoldback

    hold = _StopHoldback(stops)
    got = "".join(hold.feed(p) for p in pieces[:-1]) + hold.rest(pieces[-1])
    assert got == out


def test_responses_client_gone_mid_stream_is_recorded(gateway: Any, fake: Any) -> None:
    """The Responses stream shares the chat stream's disconnect handling: the partial turn is stored."""
    fake.token_delay = 0.005  # else the 3000 tokens can all be out before the client goes (seen in CI: a whole turn)
    try:
        cred = gateway.group(2)["sessions"][0]
        body = {"model": "m", "input": "a long one", "max_output_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/responses", json=body,
                          headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(20)]
        assert any(line.startswith("event: response.output_text.delta") for line in got)
        deadline = time.monotonic() + 10
        turns: list[Any] = []
        while not turns and time.monotonic() < deadline:
            turns = gateway.session(cred["session_id"])["turns"]
            time.sleep(0.05)
        (turn,) = turns
        assert turn["client_disconnected"] is True and turn["finish_reason"] == "abort"
        assert 0 < len(turn["completion_ids"]) < 3000
    finally:
        fake.token_delay = 0.0  # the fake is the module's
