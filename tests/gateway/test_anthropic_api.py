"""The Anthropic Messages API with the real `anthropic` SDK, unmodified, against a live gateway in front of the
scripted fake SGLang: what is stored is exactly what the backend emitted, and a tool-use conversation is one
token chain across its steps, streamed or not, with thinking blocks sent back or dropped."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from gateway.services import app_serving
from tests.gateway.conftest import ids_of

TOOLS = [{"name": "calculate", "description": "math",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "37+48"}}\n</tool_call>'


def client(gateway: Any, cred: dict[str, Any], **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cred["anthropic_base_url"], api_key=cred["api_key"], max_retries=0, **kw)


def turns(gateway: Any, cred: dict[str, Any]) -> list[dict[str, Any]]:
    return gateway.session(cred["session_id"])["turns"]  # type: ignore[no-any-return]


def assert_extends(first: dict[str, Any], second: dict[str, Any]) -> None:
    """`second` continues `first`'s token chain: its prompt starts with first's exact prompt + completion."""
    assert second["parent_id"] == first["id"] and second["continuity"] == "extends", second["chain_reason"]
    chain = first["prompt_ids"] + first["completion_ids"]
    assert second["prompt_ids"][: len(chain)] == chain and len(second["prompt_ids"]) > len(chain)


def test_create_stores_exact_ids(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    emitted = ids_of(tokenizer, "85")
    fake.script([emitted])
    r = client(gateway, cred).messages.create(model="claude-anything", max_tokens=8, system="Add.",
                                              messages=[{"role": "user", "content": "37+48="}])
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "85"
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.model == app_serving(gateway.app).model_name
    [turn] = turns(gateway, cred)
    assert turn["id"] == r.id and turn["completion_ids"] == emitted
    assert turn["prompt_ids"] == fake.requests[-1]["input_ids"]
    assert turn["request"]["messages"] == [{"role": "system", "content": "Add."},
                                           {"role": "user", "content": "37+48="}]
    assert turn["request"]["asked"]["model"] == "claude-anything"
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(turn["prompt_ids"])
    assert r.usage.output_tokens == len(emitted)


def test_max_tokens_and_sampling_policy(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2, sampling={"temperature": 0.7, "top_p": 0.9})["sessions"][0]
    r = client(gateway, cred).messages.create(
        # this SDK no longer has sampling parameters; older ones (and other clients) send them
        model="m", max_tokens=5, extra_body={"temperature": 0.0, "top_p": 0.5, "top_k": 3}, metadata={"user_id": "u1"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "text", "text": "!"}]}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5
    [turn] = turns(gateway, cred)
    sp = fake.requests[-1]["sampling_params"]
    assert sp["max_new_tokens"] == 5 and sp["temperature"] == 0.7 and sp["top_p"] == 0.9  # the group's policy
    assert turn["request"]["asked"]["temperature"] == 0.0 and turn["request"]["asked"]["top_k"] == 3
    assert turn["request"]["asked"]["metadata"] == {"user_id": "u1"}
    assert turn["request"]["messages"] == [{"role": "user", "content": "count!"}]  # text blocks joined as parts


def test_same_prompt_as_the_chat_route(gateway: Any, fake: Any) -> None:
    """A conversation with a tool call and its result renders to the same ids on both APIs."""
    openai_cred, messages_cred = gateway.group(2)["sessions"]
    gateway.openai(openai_cred).chat.completions.create(model="m", max_tokens=2, tools=[
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS],
        messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "37+48?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function",
                   "function": {"name": "calculate", "arguments": '{"expression": "37+48"}'}}]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "85"}, {"role": "user", "content": "so?"}])
    chat_ids = fake.requests[-1]["input_ids"]
    client(gateway, messages_cred).messages.create(model="m", max_tokens=2, system="S", tools=TOOLS, messages=[
        {"role": "user", "content": "37+48?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculate",
                                           "input": {"expression": "37+48"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "85"},
                                     {"type": "text", "text": "so?"}]}])
    assert fake.requests[-1]["input_ids"] == chat_ids


def _tool_step(c: anthropic.Anthropic, history: list[dict[str, Any]], **kw: Any) -> Any:
    return c.messages.create(model="m", max_tokens=80, tools=TOOLS, messages=history, **kw)


def test_two_step_tool_use_is_one_chain(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    c = client(gateway, cred)
    fake.script([ids_of(tokenizer, CALL), ids_of(tokenizer, "It is 85.")])
    history: list[dict[str, Any]] = [{"role": "user", "content": "what is 37+48?"}]
    first = _tool_step(c, history)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "calculate" and use.input == {"expression": "37+48"}
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                              "content": [{"type": "text", "text": "85"}]}]}]
    second = _tool_step(c, history)
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is 85."
    t1, t2 = turns(gateway, cred)
    assert t1["id"] == first.id and t2["id"] == second.id
    assert t1["reply"]["tool_calls"][0]["id"] == use.id
    assert_extends(t1, t2)
    assert t2["prompt_ids"] == fake.requests[-1]["input_ids"]
    assert t2["request"]["messages"][-1] == {"role": "tool", "tool_call_id": use.id, "content": "85", "is_error": True}
    record = gateway.session(cred["session_id"])["tool_calls"]
    assert record[0]["id"] == use.id and record[0]["result"] == "85" and record[0]["result_turn_id"] == t2["id"]


def test_streamed_tool_use_is_one_chain(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    c = client(gateway, cred)
    fake.script([ids_of(tokenizer, "Let me compute. " + CALL), ids_of(tokenizer, "It is 85.")])
    history: list[dict[str, Any]] = [{"role": "user", "content": "what is 37+48?"}]
    with c.messages.stream(model="m", max_tokens=80, tools=TOOLS, messages=history) as stream:
        events = [e.type for e in stream]
        first = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Let me compute." and first.content[1].input == {"expression": "37+48"}
    assert first.stop_reason == "tool_use"
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id,
                                              "content": "85"}]}]
    raw = list(c.messages.create(model="m", max_tokens=80, tools=TOOLS, messages=history, stream=True))
    kinds = [e.type for e in raw]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * (len(kinds) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == "It is 85."
    assert raw[-2].delta.stop_reason == "end_turn" and raw[-2].usage.output_tokens == len(ids_of(tokenizer, "It is 85."))
    t1, t2 = turns(gateway, cred)
    assert t1["id"] == first.id and t2["id"] == raw[0].message.id
    assert t1["completion_ids"] == ids_of(tokenizer, "Let me compute. " + CALL)
    assert_extends(t1, t2)


def test_streamed_events_are_the_full_sequence(gateway: Any, fake: Any, tokenizer: Any) -> None:
    """Raw SSE as Anthropic's API sends it: event names, ping, thinking then text then tool_use blocks."""
    cred = gateway.group(2)["sessions"][0]
    fake.script([ids_of(tokenizer, "<think>tens then ones</think>Sure. " + CALL)])
    r = httpx.post(f"{cred['anthropic_base_url']}/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 80, "stream": True, "tools": TOOLS,
        "messages": [{"role": "user", "content": "37+48?"}]},
        headers={"x-api-key": cred["api_key"], "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-2:] == ["message_delta", "message_stop"] and names.count("content_block_stop") == 3
    import json

    datas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [d["delta"]["type"] for d in datas if d["type"] == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and "text_delta" in deltas
    assert deltas[-1] == "input_json_delta"
    starts = [d["content_block"]["type"] for d in datas if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [d["index"] for d in datas if d["type"] == "content_block_start"] == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_round_trips(gateway: Any, fake: Any, tokenizer: Any, stream: bool) -> None:
    cred = gateway.group(2)["sessions"][0]
    c = client(gateway, cred)
    fake.script([ids_of(tokenizer, "<think>add tens then ones</think>" + CALL), ids_of(tokenizer, "85"),
                 ids_of(tokenizer, "85")])
    history: list[dict[str, Any]] = [{"role": "user", "content": "37+48?"}]
    kw = {"model": "m", "max_tokens": 80, "tools": TOOLS, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if stream:
        with c.messages.stream(messages=history, **kw) as s:
            first = s.get_final_message()
    else:
        first = c.messages.create(messages=history, **kw)
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == "add tens then ones" and first.content[0].signature
    blocks = [b.model_dump(exclude_none=True) for b in first.content]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id,
                                           "content": "85", "is_error": False}]}
    # the block sent back unchanged: accepted, and the next turn extends the chain
    c.messages.create(messages=[*history, {"role": "assistant", "content": blocks}, result], **kw)
    t1, t2 = turns(gateway, cred)
    assert_extends(t1, t2)
    assert t2["request"]["messages"][1]["reasoning_content"] == "add tens then ones"
    # a changed thinking text is refused in Anthropic's shape, and nothing is generated or stored
    forged = [{**blocks[0], "thinking": "something else"}, blocks[1]]
    n = len(fake.requests)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(messages=[*history, {"role": "assistant", "content": forged}, result], **kw)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "signature" in e.value.body["error"]["message"] and len(fake.requests) == n
    # dropped by the client: the chain holds the reasoning's ids anyway
    c.messages.create(messages=[*history, {"role": "assistant", "content": blocks[1:]}, result], **kw)
    t3 = turns(gateway, cred)[2]
    assert_extends(t1, t3)
    assert len(turns(gateway, cred)) == 3


def test_thinking_display_omitted(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    fake.script([ids_of(tokenizer, "<think>secret steps</think>85")])
    r = client(gateway, cred).messages.create(model="m", max_tokens=40, messages=[{"role": "user", "content": "q"}],
                                              thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    assert [b.type for b in r.content] == ["thinking", "text"] and r.content[0].thinking == ""
    assert turns(gateway, cred)[0]["reply"]["reasoning_content"] == "secret steps"  # recorded whole


def test_auth_bearer_and_session_path(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    by_bearer = anthropic.Anthropic(base_url=cred["anthropic_base_url"], auth_token=cred["api_key"], max_retries=0)
    by_bearer.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "a"}])
    by_path = anthropic.Anthropic(base_url=cred["anthropic_session_base_url"], api_key="unused", max_retries=0)
    by_path.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "b"}])
    assert [t["request"]["messages"][0]["content"] for t in turns(gateway, cred)] == ["a", "b"]


def test_count_tokens_is_the_prompt_length(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    c = client(gateway, cred)
    history: list[dict[str, Any]] = [{"role": "user", "content": "what is 37+48?"}]
    n = c.messages.count_tokens(model="m", system="S", tools=TOOLS, messages=history).input_tokens
    fake.script([ids_of(tokenizer, CALL)])
    first = c.messages.create(model="m", max_tokens=80, system="S", tools=TOOLS, messages=history)
    assert n == len(fake.requests[-1]["input_ids"])
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                              "content": "85"}]}]
    n2 = c.messages.count_tokens(model="m", system="S", tools=TOOLS, messages=history).input_tokens
    c.messages.create(model="m", max_tokens=2, system="S", tools=TOOLS, messages=history)
    assert n2 == len(fake.requests[-1]["input_ids"]) and len(turns(gateway, cred)) == 2


def test_models_in_each_sdks_shape(gateway: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    name = app_serving(gateway.app).model_name
    c = client(gateway, cred)
    page = c.models.list()
    assert [m.id for m in page.data] == [name] and page.data[0].type == "model" and not page.has_more
    assert c.models.retrieve(name).display_name == name
    with pytest.raises(anthropic.NotFoundError) as e:
        c.models.retrieve("claude-other")
    assert e.value.body["error"]["type"] == "not_found_error"
    oa = gateway.openai(cred)
    assert [m.id for m in oa.models.list().data] == [name]
    assert oa.models.retrieve(name).owned_by == "rollway"


def test_stop_sequence_and_output_format(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    client(gateway, cred).messages.create(
        model="m", max_tokens=3, stop_sequences=["END"], messages=[{"role": "user", "content": "q"}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    sp = fake.requests[-1]["sampling_params"]
    assert sp["stop"] == ["END"] and sp["json_schema"] == '{"type": "object", "properties": {"n": {"type": "integer"}}}'


def test_stop_reason_of_a_matched_stop_sequence() -> None:
    from gateway.anthropic.translate import stop_reason
    from gateway.generation import Generation

    assert stop_reason("stop", Generation(finish={"type": "stop", "matched": "END"}), ["END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", Generation(finish={"type": "stop", "matched": 2}), ["END"]) == ("end_turn", None)
    assert stop_reason("tool_calls", Generation(), []) == ("tool_use", None)
    assert stop_reason("length", Generation(), []) == ("max_tokens", None)
