"""A multi-turn tool-calling session is stored as one token chain with no drift, for a ChatML/Hermes
template and a Llama-3.1-style template (llama3_json), through chat completions and through Responses."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.services import app_serving
from tests.fakes.sglang import FakeSGLang
from tests.gateway.template_calls import render_ids
from tests.harness import LiveGateway

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3.1-style tokenizer built here (no download), saved like an HF model folder."""
    from engine.tiny_model import build_tokenizer
    from tests.gateway.chat_templates import LLAMA31_SPECIAL_TOKENS, LLAMA31_TEMPLATE

    out = tmp_path_factory.mktemp("llama-tok")
    tok = build_tokenizer(seed=1, extra_special_tokens=LLAMA31_SPECIAL_TOKENS, chat_template=LLAMA31_TEMPLATE)
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.save_pretrained(out)
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "model_type": "llama"}))
    return out


CASES = {
    # template dir fixture, tool parser, the model's tool-call text, its end-of-turn after a tool call / text
    "chatml-hermes": ("tiny_model_dir", "hermes",
                      '<tool_call>\n{"name": "calculate", "arguments": {"expression": "37+48"}}\n</tool_call>',
                      "<|im_end|>", "<|im_end|>"),
    "llama31-json": ("llama_dir", "llama3_json",
                     '<|python_tag|>{"name": "calculate", "parameters": {"expression": "37+48"}}',
                     "<|eom_id|>", "<|eot_id|>"),
}


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[dict[str, Any]]:
    dir_fixture, parser, call_text, call_end, text_end = CASES[request.param]
    model_dir = request.getfixturevalue(dir_fixture)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with FakeSGLang(vocab=range(100, 1000)) as fake, LiveGateway(
        backends=[fake.url], tokenizer=str(model_dir), db=sqlite_url, tool_parser=parser
    ) as gw:
        yield {"gw": gw, "fake": fake, "tok": tok, "call": call_text, "call_end": call_end, "text_end": text_end}


def emit(s: dict[str, Any], text: str, end: str) -> list[int]:
    tok = s["tok"]
    return [*list(tok(text, add_special_tokens=False)["input_ids"]), tok.convert_tokens_to_ids(end)]


def check_chain(s: dict[str, Any], session_id: str, emitted: list[list[int]], final_messages: list[dict[str, Any]]) -> None:
    rec = s["gw"].session(session_id)
    turns = rec["turns"]
    assert [t["continuity"] for t in turns] == ["new-chain"] + ["extends"] * (len(turns) - 1)
    for prev, cur in itertools.pairwise(turns):
        assert cur["parent_id"] == prev["id"]
        chain = prev["prompt_ids"] + prev["completion_ids"]
        assert cur["prompt_ids"][: len(chain)] == chain  # the earlier tokens are kept exactly
        assert cur["prompt_delta_len"] == len(cur["prompt_ids"]) - len(chain)  # stored as a delta
    # The model-generated spans are exactly the backend's ids...
    assert [t["completion_ids"] for t in turns] == emitted
    # ...and since the model emitted the template's own rendering, the chain equals a fresh render of the
    # whole conversation: no token was dropped or changed at any bridge.
    template = app_serving(s["gw"].app).template
    last = turns[-1]
    assert last["prompt_ids"] == render_ids(template, final_messages[:-1], TOOLS)
    full = last["prompt_ids"] + last["completion_ids"]
    fresh = template.encode(template.render_text(final_messages, TOOLS, add_generation_prompt=False))
    assert full == fresh[: len(full)]


def test_tool_session_is_one_chain_chat(setup: dict[str, Any]) -> None:
    s = setup
    gw, fake = s["gw"], s["fake"]
    cred = gw.group(2)["sessions"][0]
    client = gw.openai(cred)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the tool."},
                                      {"role": "user", "content": "What is 37+48?"}]
    e1 = emit(s, s["call"], s["call_end"])
    fake.script([e1])
    r1 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=80)
    call = r1.choices[0].message.tool_calls[0]
    assert call.function.name == "calculate" and json.loads(call.function.arguments) == {"expression": "37+48"}
    # The agent echoes the assistant message the way clients do: null fields dropped, keys reordered,
    # arguments re-serialised.
    assistant = {"tool_calls": [{"type": "function", "id": call.id, "function": {
        "arguments": json.dumps(json.loads(call.function.arguments), indent=None, separators=(",", ":")),
        "name": "calculate"}}], "role": "assistant"}
    messages += [assistant, {"role": "tool", "tool_call_id": call.id, "content": "85"}]
    e2 = emit(s, "85", s["text_end"])
    fake.script([e2])
    r2 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=80)
    assert r2.choices[0].message.content == "85"
    messages += [{"role": "assistant", "content": "85"}, {"role": "user", "content": "And 1+1?"}]
    e3 = emit(s, "2", s["text_end"])
    fake.script([e3])
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=80)
    check_chain(s, cred["session_id"], [e1, e2, e3], [*messages, {"role": "assistant", "content": "2"}])
    rec = gw.session(cred["session_id"])
    assert rec["tool_calls"][0]["name"] == "calculate" and rec["tool_calls"][0]["result"] == "85"
    assert rec["tool_calls"][0]["failed"] is False and rec["tool_calls"][0]["seconds"] is not None


def test_tool_session_is_one_chain_responses(setup: dict[str, Any]) -> None:
    s = setup
    gw, fake = s["gw"], s["fake"]
    cred = gw.group(2)["sessions"][0]
    client = gw.openai(cred)
    rtools = [{"type": "function", "name": "calculate", "description": "evaluate arithmetic",
               "parameters": TOOLS[0]["function"]["parameters"]}]
    items: list[Any] = [{"role": "user", "content": "What is 37+48?"}]
    e1 = emit(s, s["call"], s["call_end"])
    fake.script([e1])
    r1 = client.responses.create(model="m", instructions="Use the tool.", input=items, tools=rtools,
                                 max_output_tokens=80)
    fc = next(o for o in r1.output if o.type == "function_call")
    assert fc.name == "calculate"
    items += [{"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
              {"type": "function_call_output", "call_id": fc.call_id, "output": "85"}]
    e2 = emit(s, "85", s["text_end"])
    fake.script([e2])
    r2 = client.responses.create(model="m", instructions="Use the tool.", input=items, tools=rtools,
                                 max_output_tokens=80)
    assert r2.output_text == "85"
    final = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 37+48?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": fc.call_id, "type": "function",
              "function": {"name": "calculate", "arguments": fc.arguments}}]},
             {"role": "tool", "tool_call_id": fc.call_id, "content": "85"},
             {"role": "assistant", "content": "85"}]
    check_chain(s, cred["session_id"], [e1, e2], final)


def test_edited_history_starts_a_new_chain(setup: dict[str, Any]) -> None:
    s = setup
    gw, fake = s["gw"], s["fake"]
    cred = gw.group(2)["sessions"][0]
    client = gw.openai(cred)
    fake.script([emit(s, "1", s["text_end"])])
    m = [{"role": "user", "content": "a"}]
    client.chat.completions.create(model="m", messages=m, max_tokens=5)
    edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "something else"},
              {"role": "user", "content": "b"}]
    client.chat.completions.create(model="m", messages=edited, max_tokens=5)
    turns = gw.session(cred["session_id"])["turns"]
    assert turns[1]["continuity"] == "new-chain" and turns[1]["chain_reason"] == "edited_message"


def test_reflection_without_tools_starts_a_new_chain(setup: dict[str, Any]) -> None:
    """AutoGen AgentChat's `reflect_on_tool_use`: after the tool's result the reflection call sends the same
    conversation with no tools (and so no tool_choice). The prompt the model sees loses the tool definitions, so
    the call cannot extend the tool call's chain: a new chain, reason `different_tools`, rendered whole without
    tools, its completion the engine's ids."""
    s = setup
    gw, fake = s["gw"], s["fake"]
    cred = gw.group(2)["sessions"][0]
    client = gw.openai(cred)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the tool."},
                                      {"role": "user", "content": "What is 37+48?"}]
    e1 = emit(s, s["call"], s["call_end"])
    fake.script([e1])
    call = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=80)
    tc = call.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": tc.id, "type": "function", "function": {"name": "calculate",
                                                                    "arguments": tc.function.arguments}}]},
                 {"role": "tool", "tool_call_id": tc.id, "content": "85"}]
    e2 = emit(s, "85", s["text_end"])
    fake.script([e2])
    reflection = client.chat.completions.create(model="m", messages=messages, max_tokens=80)
    assert reflection.choices[0].message.content == "85"
    turns = gw.session(cred["session_id"])["turns"]
    assert [(t["parent_id"], t["chain_reason"]) for t in turns] == [(None, "first_turn"), (None, "different_tools")]
    template = app_serving(gw.app).template
    assert turns[1]["prompt_ids"] == render_ids(template, messages, None)
    assert turns[1]["completion_ids"] == e2
