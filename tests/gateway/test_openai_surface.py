"""The OpenAI surface over real HTTP with the official client (sync, async, streaming, tools, logprobs):
what is stored is exactly what the backend emitted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.services import app_serving
from tests.gateway.conftest import ids_of

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "math",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def last_turn(gateway: Any, cred: dict[str, Any]) -> dict[str, Any]:
    return gateway.session(cred["session_id"])["turns"][-1]  # type: ignore[no-any-return]


def test_sync_chat_stores_exact_ids_and_logprobs(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    emitted = ids_of(tokenizer, "85")
    fake.script([emitted])
    r = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "37+48="}],
                                       max_tokens=8, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == "85"
    assert r.choices[0].finish_reason == "stop"
    assert r.model == app_serving(gateway.app).model_name
    turn = last_turn(gateway, cred)
    assert turn["completion_ids"] == emitted
    # logprobs: the OpenAI reply and the record carry the backend's numbers for the same tokens
    reply_lps = [c.logprob for c in r.choices[0].logprobs.content]
    assert len(turn["logprobs"]) == len(emitted)
    assert reply_lps == pytest.approx(turn["logprobs"][: len(reply_lps)], abs=1e-6)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    assert turn["prompt_ids"] == fake.requests[-1]["input_ids"]
    assert r.usage.prompt_tokens == len(turn["prompt_ids"]) and r.usage.completion_tokens == len(emitted)


def test_async_client_concurrent_sessions(gateway: Any, fake: Any) -> None:
    group = gateway.group(4)

    async def one(cred: dict[str, Any]) -> str:
        async with gateway.async_openai(cred) as c:
            r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
            return r.id  # type: ignore[no-any-return]

    async def all_() -> list[str]:
        return await asyncio.gather(*(one(s) for s in group["sessions"]))

    ids = asyncio.run(all_())
    for cred, turn_id in zip(group["sessions"], ids, strict=True):
        turn = last_turn(gateway, cred)
        assert turn["id"] == turn_id
        assert len(turn["completion_ids"]) == 6 and turn["finish_reason"] == "length"


def test_streamed_text_equals_non_streamed_text(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    emitted = ids_of(tokenizer, "The answer is 85, since 37 + 48 = 85.")
    fake.script([emitted])
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=40)
    fake.script([emitted])
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q2"}], max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(emitted)
    assert last_turn(gateway, cred)["completion_ids"] == emitted


def test_tool_call_reply_and_streamed_tool_call(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "37+48"}}\n</tool_call>'
    fake.script([ids_of(tokenizer, call)])
    msgs = [{"role": "user", "content": "what is 37+48?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=60)
    tc = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert tc and tc[0].function.name == "calculate" and tc[0].function.arguments == '{"expression": "37+48"}'
    fake.script([ids_of(tokenizer, call)])
    stream = client.chat.completions.create(model="m", messages=[*msgs, {"role": "user", "content": "x"}],
                                            tools=TOOLS, max_tokens=60, stream=True)
    chunks = list(stream)
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed and streamed[0].function.name == "calculate"
    assert "".join(d.function.arguments or "" for d in streamed) == '{"expression": "37+48"}'
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_malformed_tool_call_stays_text(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    bad = '<tool_call>\n{"name": "calculate", "arguments": {oops</tool_call>'
    fake.script([ids_of(tokenizer, bad)])
    r = gateway.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                     tools=TOOLS, max_tokens=60)
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert "oops" in (r.choices[0].message.content or "")


def test_reasoning_is_split(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    fake.script([ids_of(tokenizer, "<think>add tens then ones</think>85")])
    r = gateway.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                     max_tokens=60)
    msg = r.choices[0].message
    assert msg.content == "85"
    assert getattr(msg, "reasoning_content", None) == "add tens then ones"


def test_group_sampling_policy_overrides_client(gateway: Any, fake: Any) -> None:
    cred = gateway.group(2, sampling={"temperature": 0.7, "top_p": 0.9})["sessions"][0]
    gateway.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                 max_tokens=3, temperature=0, top_p=0.1, seed=7)
    sp = fake.requests[-1]["sampling_params"]
    assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and "sampling_seed" not in sp
    turn = last_turn(gateway, cred)
    assert turn["request"]["asked"]["temperature"] == 0 and turn["temperature"] == 0.7


def test_stop_ids_come_from_the_model(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    gateway.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=3)
    stop_ids = set(fake.requests[-1]["sampling_params"]["stop_token_ids"])
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_ids


def test_completions_and_models(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    client = gateway.openai(cred)
    emitted = ids_of(tokenizer, " 85", end=False)
    fake.script([emitted])
    r = client.completions.create(model="m", prompt="37+48=", max_tokens=len(emitted), logprobs=1)
    assert r.choices[0].text == " 85"
    assert fake.requests[-1]["input_ids"] == tokenizer("37+48=", add_special_tokens=False)["input_ids"]
    assert [m.id for m in client.models.list().data] == [app_serving(gateway.app).model_name]


def test_path_form_needs_no_key(gateway: Any, fake: Any) -> None:
    import openai

    cred = gateway.group(2)["sessions"][1]
    client = openai.OpenAI(base_url=cred["session_base_url"], api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=2)
    assert last_turn(gateway, cred)["id"] == r.id


def test_unknown_fields_are_accepted(gateway: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    r = gateway.openai(cred).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q", "weird": 1}], max_tokens=2,
        extra_body={"some_vendor_field": {"x": 1}, "store": True}, user="u", metadata={"k": "v"},
        parallel_tool_calls=False,
    )
    assert r.choices[0].message is not None


def test_a_long_chain_sends_the_prompt_it_records(gateway: Any, fake: Any, tokenizer: Any) -> None:
    """Turns extending their parent send the prompt's JSON kept from the parent's (`PromptIds`): what the
    backend got is the recorded prompt, turn after turn."""
    cred = gateway.group(1)["sessions"][0]
    client = gateway.openai(cred)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "count"}]
    for i in range(5):
        messages.append({"role": "user", "content": f"step {i}"})
        fake.script([ids_of(tokenizer, f"ok {i}")])
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        turn = last_turn(gateway, cred)
        assert turn["prompt_ids"] == fake.requests[-1]["input_ids"]
        if i:
            assert turn["continuity"] == "extends"
