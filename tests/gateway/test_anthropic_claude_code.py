"""What Claude Code (the CLI the Claude Agent SDK bundles) sends, against a live gateway in front of the scripted
fake SGLang: `POST /v1/messages?beta=true` with a system entry inside `messages`, `context_management` edits,
`thinking.display` modes the gateway has no special meaning for, deferred tools and mid-conversation tool
changes, and a `max_tokens` far over a small model's context. The request bodies are Claude Code 2.1.332's as
captured (docs/conformance-anthropic.md "Claude Code and the Claude Agent SDK"), cut to what each test needs."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from gateway.anthropic.translate import CLEARED_TOOL_RESULT, context_cut, stop_reason
from gateway.generation import Generation
from tests.gateway.conftest import ids_of
from tests.gateway.test_anthropic_api import assert_extends, turns

CALC = {"name": "mcp__calc__calculate", "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}
PLACEHOLDER = {"name": "DeferredToolPlaceholder", "description": "Reserved placeholder; never call this tool.",
               "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
CALL = '<tool_call>\n{"name": "mcp__calc__calculate", "arguments": {"expression": "12+7"}}\n</tool_call>'
HEADERS = {"anthropic-version": "2023-06-01", "x-app": "cli", "anthropic-beta": (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,per-turn-control-2026-07-01,"
    "mid-conversation-tool-changes-2026-07-01,effort-2025-11-24,thinking-display-updates-2026-08-18")}


def claude_code_body(messages: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    """Claude Code's request, as the Agent SDK's CLI sends it (system prompt and tools cut short)."""
    body = {
        "model": "claude-opus-5-5", "messages": messages,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=sdk-py;"},
                   {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use the calculate tool.", "cache_control": {"type": "ephemeral"}}],
        "tools": [PLACEHOLDER, CALC], "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "max_tokens": 128000, "thinking": {"type": "adaptive", "display": "updates"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"}, "stream": False,
    }
    return {**body, **over}


ENVIRONMENT = {"role": "system", "content": [{"type": "text", "text": "# Environment\n - Platform: linux",
                                               "cache_control": {"type": "ephemeral"}}],
               "output_config": {"effort": "medium"}}


def post(cred: dict[str, Any], body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cred['anthropic_base_url']}/v1/messages?beta=true", json=body, timeout=60,
                      headers={**HEADERS, "x-api-key": cred["api_key"]})


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_tool_task_is_one_chain(gateway: Any, fake: Any, tokenizer: Any, stream: bool) -> None:
    """Claude Code's two calls of a tool task: both 200, one chain, the system entry rendered where it stands,
    the deferred placeholder tool not shown, max_tokens cut to what the context leaves."""
    cred = gateway.group(2)["sessions"][0]
    fake.script([ids_of(tokenizer, "<think>add</think>" + CALL), ids_of(tokenizer, "19")])
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is 12+7?"}, ENVIRONMENT]
    r = post(cred, claude_code_body(history, stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        events = sse(r)
        use = next(e["content_block"] for e in events if e["type"] == "content_block_start"
                   and e["content_block"]["type"] == "tool_use")
        delta = next(e for e in events if e["type"] == "message_delta")
        assert delta["delta"]["stop_reason"] == "tool_use"
        assert delta["context_management"] == {"applied_edits": [
            {"type": "clear_thinking_20251015", "cleared_thinking_turns": 0, "cleared_input_tokens": 0}]}
    else:
        answer = r.json()
        assert answer["stop_reason"] == "tool_use" and answer["content"][0]["thinking"] == "add"  # "updates": whole
        use = answer["content"][-1]
        assert answer["context_management"]["applied_edits"][0]["cleared_thinking_turns"] == 0
    [t1] = turns(gateway, cred)
    sent = t1["request"]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "system"]
    assert sent["messages"][2]["content"] == "# Environment\n - Platform: linux"
    assert [t["function"]["name"] for t in sent["tools"]] == ["mcp__calc__calculate"]
    assert sent["asked"]["thinking"]["display"] == "updates" and sent["asked"]["max_tokens"] == 128000
    max_new = fake.requests[-1]["sampling_params"]["max_new_tokens"]
    assert max_new == 4096 - len(t1["prompt_ids"])  # 128000 asked: cut to the context, not refused
    history += [{"role": "assistant", "content": [{"type": "tool_use", "id": use["id"], "name": use["name"],
                                                   "input": {"expression": "12+7"}}]},
                {"role": "user", "content": [{"tool_use_id": use["id"], "type": "tool_result",
                                              "content": [{"type": "text", "text": "19"}],
                                              "cache_control": {"type": "ephemeral"}}]}]
    history[1] = {**ENVIRONMENT, "content": ENVIRONMENT["content"][0]["text"]}  # the CLI sends it back as a string
    r = post(cred, claude_code_body(history, stream=stream))
    assert r.status_code == 200, r.text
    t1, t2 = turns(gateway, cred)
    assert_extends(t1, t2)
    for t, req in zip((t1, t2), fake.requests[-2:], strict=True):
        assert t["prompt_ids"] == req["input_ids"]


def test_context_edits_clear_thinking(gateway: Any, fake: Any, tokenizer: Any) -> None:
    """keep "all" is a no-op (the turn extends its parent); keep 2 (of three assistant turns) drops the oldest reasoning from
    the prompt, which is rendered whole as a new chain, reason context_management."""
    cred = gateway.group(2)["sessions"][0]
    fake.script([ids_of(tokenizer, "<think>first</think>" + CALL), ids_of(tokenizer, "<think>second</think>" + CALL)])
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is 12+7?"}]
    for _ in range(2):
        r = post(cred, claude_code_body(history, tools=[CALC]))
        assert r.status_code == 200, r.text
        use = r.json()["content"][-1]
        history += [{"role": "assistant", "content": r.json()["content"]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "19"}]}]
    t1, t2 = turns(gateway, cred)
    assert_extends(t1, t2)
    fake.script([ids_of(tokenizer, "19")])
    keep_all = post(cred, claude_code_body(history, tools=[CALC]))
    assert keep_all.status_code == 200 and keep_all.json()["context_management"]["applied_edits"][0][
        "cleared_thinking_turns"] == 0
    assert_extends(t2, turns(gateway, cred)[2])
    fake.script([ids_of(tokenizer, "19")])
    history += [{"role": "assistant", "content": "19"}, {"role": "user", "content": "And 12+8?"}]
    edit = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}
    r = post(cred, claude_code_body(history, tools=[CALC], context_management={"edits": [edit]}))
    assert r.status_code == 200, r.text
    [applied] = r.json()["context_management"]["applied_edits"]
    assert applied["cleared_thinking_turns"] == 1 and applied["cleared_input_tokens"] == len(
        tokenizer("first", add_special_tokens=False)["input_ids"])
    t4 = turns(gateway, cred)[3]
    assert t4["parent_id"] is None and t4["continuity"] == "new-chain" and t4["chain_reason"] == "context_management"
    assistants = [m for m in t4["request"]["messages"] if m["role"] == "assistant"]
    assert "reasoning_content" not in assistants[0] and assistants[1]["reasoning_content"] == "second"
    assert t4["prompt_ids"] == fake.requests[-1]["input_ids"]


def test_context_edits_clear_tool_uses(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "mcp__calc__calculate",
                                                  "input": {"expression": "1+1"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a long result"}]},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "mcp__calc__calculate",
                                                  "input": {"expression": "2+2"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "4"}]}]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
            "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True}
    fake.script([ids_of(tokenizer, "done")])
    r = post(cred, claude_code_body(history, tools=[CALC], context_management={"edits": [edit]}))
    assert r.status_code == 200, r.text
    [applied] = r.json()["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 1
    msgs = turns(gateway, cred)[0]["request"]["messages"]
    assert [m["content"] for m in msgs if m["role"] == "tool"] == [CLEARED_TOOL_RESULT, "4"]
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert msgs[4]["tool_calls"][0]["function"]["arguments"] == '{"expression": "2+2"}'
    n = len(fake.requests)
    # not triggered (3 tool uses needed), and a clear_at_least the edit cannot reach: nothing cleared
    for other in ({**edit, "trigger": {"type": "tool_uses", "value": 3}},
                  {**edit, "clear_at_least": {"type": "input_tokens", "value": 10_000}},
                  {**edit, "trigger": {"type": "input_tokens", "value": 100_000}}):
        fake.script([ids_of(tokenizer, "done")])
        r = post(cred, claude_code_body(history, tools=[CALC], context_management={"edits": [other]}))
        assert r.status_code == 200 and r.json()["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 0
    assert len(fake.requests) == n + 3


@pytest.mark.parametrize(("over", "param"), [
    ({"context_management": {"edits": [{"type": "compact_20260112"}]}}, "context_management.edits.0.type"),
    ({"context_management": {"edits": [{"type": "clear_everything"}]}}, "context_management.edits.0.type"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}},
     "context_management.edits.0.keep"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "x"}]}},
     "context_management.edits.0.exclude_tools"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": 3}]}},
     "context_management.edits.0.clear_tool_inputs"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses",
                                                                                        "value": -1}}]}},
     "context_management.edits.0.trigger"),
    ({"context_management": {"edits": ["clear"]}}, "context_management.edits.0"),
    ({"messages": [{"role": "user", "content": "q", "clear_at": "never"}]}, "messages.0.clear_at"),
    ({"messages": [{"role": "user", "content": "q", "output_config": {"effort": "low"}}]}, "messages.0.output_config"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": [{"type": "image"}]}]},
     "messages.1.content.0"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "nope"}}]}]},
     "messages.1.content.0.tool.name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "mcp_tool_reference", "name": "x", "server_name": "s"}}]}]},
     "messages.1.content.0.tool"),
])
def test_what_cannot_be_done_is_a_400_naming_the_field(gateway: Any, fake: Any, over: dict[str, Any], param: str) -> None:
    cred = gateway.group(2)["sessions"][0]
    n = len(fake.requests)
    body = {**claude_code_body([{"role": "user", "content": "q"}]), **over}
    r = httpx.post(f"{cred['anthropic_base_url']}/v1/messages?beta=true", json=body, timeout=30,
                   headers={**HEADERS, "x-api-key": cred["api_key"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"].startswith(param)
    assert len(fake.requests) == n


def test_null_edit_fields_take_the_defaults(gateway: Any, fake: Any, tokenizer: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    fake.script([ids_of(tokenizer, "ok")])
    r = post(cred, claude_code_body([{"role": "user", "content": "q"}], context_management={"edits": [
        {"type": "clear_thinking_20251015", "keep": None},
        {"type": "clear_tool_uses_20250919", "trigger": None, "keep": None, "clear_at_least": None}]}))
    assert r.status_code == 200, r.text
    assert [e["type"] for e in r.json()["context_management"]["applied_edits"]] == [
        "clear_thinking_20251015", "clear_tool_uses_20250919"]


def test_system_messages_clear_at_and_tool_changes(gateway: Any, fake: Any, tokenizer: Any) -> None:
    """The beta SDK's own types: a system message shown for the next user turn only, a deferred tool added by a
    tool_addition block and another removed, a thinking block whose signature fails dropped on request."""
    cred = gateway.group(2)["sessions"][0]
    c = anthropic.Anthropic(base_url=cred["anthropic_base_url"], api_key=cred["api_key"], max_retries=0)
    other = {**CALC, "name": "other"}
    fake.script([ids_of(tokenizer, "ok")])
    r = c.beta.messages.create(
        model="m", max_tokens=8, tools=[CALC, {**PLACEHOLDER, "name": "later"}, other],
        thinking={"type": "adaptive", "display": "updates",
                  "block_binding": {"prefix_mismatch_behavior": "drop_block"}},
        messages=[{"role": "user", "content": "a"},
                  {"role": "system", "content": "only for a", "clear_at": "next_user_message"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "msg_x.AAAA"},
                                                    {"type": "text", "text": "hi"}]},
                  {"role": "system", "content": [
                      {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "later"}},
                      {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "other"}},
                      {"type": "text", "text": "now"}], "clear_at": "next_user_message",
                   "output_config": {"effort": "low"}},
                  {"role": "user", "content": "b"}],
        betas=["mid-conversation-tool-changes-2026-07-01", "per-turn-control-2026-07-01"])
    assert r.content[0].text == "ok"
    [t] = turns(gateway, cred)
    assert [(m["role"], m.get("content")) for m in t["request"]["messages"]] == [
        ("user", "a"), ("assistant", "hi"), ("user", "b")]  # both system messages were for earlier user turns
    assert [x["function"]["name"] for x in t["request"]["tools"]] == ["mcp__calc__calculate", "later"]


def test_max_tokens_over_the_context_stops_at_the_window(gateway: Any, fake: Any, tokenizer: Any) -> None:
    """max_tokens beyond what the context leaves is cut to it; a reply that runs to the cut stops with
    `model_context_window_exceeded` (Anthropic's stop reason for it), one under it as it would anyway."""
    cred = gateway.group(2)["sessions"][0]
    c = anthropic.Anthropic(base_url=cred["anthropic_base_url"], api_key=cred["api_key"], max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": "count"}]
    room = 4096 - c.messages.count_tokens(model="m", messages=messages).input_tokens
    word = ids_of(tokenizer, " a", end=False)[-1]
    fake.script([[word] * room])
    r = c.messages.create(model="m", max_tokens=128000, messages=messages)
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == room
    assert turns(gateway, cred)[0]["completion_ids"] == [word] * room
    fake.script([[word] * 3])
    assert c.messages.create(model="m", max_tokens=3, messages=messages).stop_reason == "max_tokens"


def test_stop_reason_of_a_cut_budget() -> None:
    gen = Generation.__new__(Generation)
    gen.finish = None

    class Prepared:
        class req:
            max_tokens = 100
        max_new_tokens = 40

    assert context_cut(Prepared()) is True  # type: ignore[arg-type]
    assert context_cut(Prepared.__new__(Prepared)) is True  # type: ignore[arg-type]
    assert stop_reason("length", gen, [], True) == ("model_context_window_exceeded", None)
    assert stop_reason("length", gen, [], False) == ("max_tokens", None)
