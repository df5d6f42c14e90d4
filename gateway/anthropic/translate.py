"""The Anthropic Messages API as a translation onto the turn service (`gateway.turns`), not a second copy.

A Messages request becomes the same OpenAI-form chat messages the chat-completions route builds (system,
user, assistant with `reasoning_content` and `tool_calls`, tool results as `tool` messages), so its turns are
prepared, generated, recorded and chained exactly like a chat completion's: an Anthropic session is one
token chain across its tool-use steps. The reply (`ParsedReply`) becomes content blocks again.

Thinking blocks carry a `signature` the gateway can verify when the block comes back: an HMAC, keyed from the
admin key (so every gateway of a deployment verifies every other's) and bound to the session, over the turn id
and the thinking text. A thinking block whose text was changed, or that another session was given, is refused
(400), as Anthropic's API refuses it; one that verifies goes back to the template as `reasoning_content`.
Continuity ignores reasoning (the parent's own ids hold it), so the next turn extends the same chain whether
the client sends the block back or drops it.

The beta API's additions that Claude Code sends: a `{"role": "system"}` entry inside `messages` is a system
chat message where it stands (`clear_at` may hide it; its tool_addition / tool_removal blocks change the tools,
as `defer_loading` keeps a tool out until added); `context_management` edits are applied to the translated
messages (`context_edits`), and one that clears something makes the turn a new chain
(`TurnRequest.new_chain_reason`), since the model no longer sees what its parent's ids hold.

Every field, block and header and what becomes of it: docs/conformance-anthropic.md.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.anthropic.protocol import (
    REFUSED_FIELDS,
    AnthropicTool,
    AnthropicToolChoice,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ThinkingConfig,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.errors import BadRequest
from gateway.generation import Generation
from gateway.protocol import note_unknown_fields
from gateway.settings import Settings
from gateway.tool_grammar import ForcedTools
from gateway.tool_parsers import ParsedReply
from gateway.turn_types import PreparedTurn, TurnRequest, tools_for_choice

log = logging.getLogger("rollway.gateway")
B = TypeVar("B", bound=BaseModel)

BLOCKS_PER_MESSAGE = 4
"""A request may carry at most this many content blocks per allowed message (`max_messages`) in all: blocks
cost what messages cost to validate, and an assistant turn is often three (thinking, text, tool use)."""

_NOT_TEXT = {
    "image": "images", "document": "documents", "search_result": "search results", "container_upload": "files",
}
"""Input blocks that need more than a text model: refused with a message saying so."""


# --- thinking-block signatures --------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def signing_key(admin_key: str) -> bytes:
    """The key of thinking-block signatures, derived from the admin key (shared by a deployment's gateways)."""
    return hmac.new(admin_key.encode(), b"rollway thinking-block signature v1", hashlib.sha256).digest()


def session_signing_key(key: bytes, session_id: str) -> bytes:
    """The key of one session's signatures: a thinking block issued in one session is refused in any other
    (its text would otherwise go into another session's prompt as the model's own reasoning)."""
    return hmac.new(key, b"session\0" + session_id.encode(), hashlib.sha256).digest()


def sign_thinking(key: bytes, turn_id: str, thinking: str) -> str:
    """`<turn id>.<HMAC of the turn id and the text>`: opaque to clients, checkable here."""
    mac = hmac.new(key, turn_id.encode() + b"\0" + thinking.encode(), hashlib.sha256).digest()
    return f"{turn_id}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def verify_thinking(key: bytes, signature: str, thinking: str) -> bool:
    turn_id, dot, _ = signature.rpartition(".")
    return bool(dot) and hmac.compare_digest(sign_thinking(key, turn_id, thinking).encode(), signature.encode())


# --- request -> turn --------------------------------------------------------------------------------------


def check_blocks(data: dict[str, Any], settings: Settings) -> None:
    """Refuse a body with more content blocks than BLOCKS_PER_MESSAGE x max_messages, counted on the decoded
    JSON before validation (as `replies.check_counts` counts messages)."""
    limit = BLOCKS_PER_MESSAGE * settings.max_messages
    n = len(data["system"]) if isinstance(data.get("system"), list) else 0
    messages = data.get("messages")
    for m in messages if isinstance(messages, list) else ():  # any other type: validation's 400 follows
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            n += len(content)
            n += sum(len(b["content"]) for b in content if isinstance(b, dict) and isinstance(b.get("content"), list))
    if n > limit:
        raise BadRequest(
            f"the request holds {n} content blocks; a request may carry at most {limit} ({BLOCKS_PER_MESSAGE} x "
            f"max_messages; raise it with ROLLWAY_MAX_MESSAGES)", param="messages", code="array_above_max_length")


def _block(model: type[B], raw: dict[str, Any], param: str) -> B:
    try:
        block = model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join([param, *(str(p) for p in err.get("loc", ()))])
        raise BadRequest(f"{where}: {err['msg']}", param=where) from None
    note_unknown_fields(block, f"messages.{raw.get('type')}")
    return block


def _kind(raw: Any, param: str) -> str:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise BadRequest(f"{param}: a content block must be an object with a string 'type'", param=param)
    return str(raw["type"])


def _unsupported(kind: str, role: str, param: str) -> BadRequest:
    if kind in _NOT_TEXT:
        why = f"{_NOT_TEXT[kind]} are not supported: the gateway serves a text-only model"
    elif kind == "redacted_thinking":
        why = ("redacted_thinking blocks are not supported: this gateway never issues them, so one cannot come "
               "from an earlier reply of this session")
    elif kind in ("text", "tool_use", "tool_result", "thinking"):
        why = f"a {kind} block does not belong in a {role} message"
    else:
        why = (f"content block type {kind!r} is not supported (text, tool_use, tool_result and thinking are; "
               "server tools run on Anthropic's side)")
    return BadRequest(f"{param}: {why}", param=param)


def _texts(blocks: list[dict[str, Any]], param: str, role: str) -> str:
    """The text of a list of text blocks (system, tool result): concatenated, as the chat route joins parts."""
    out = []
    for j, raw in enumerate(blocks):
        kind = _kind(raw, f"{param}.{j}")
        if kind != "text":
            raise _unsupported(kind, role, f"{param}.{j}")
        out.append(_block(TextBlock, raw, f"{param}.{j}").text)
    return "".join(out)


def _user(content: str | list[dict[str, Any]], i: int, out: list[dict[str, Any]]) -> None:
    """A user message: its text, and each tool result as a `tool` message, in the order they came."""
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    text: list[str] | None = None
    for j, raw in enumerate(content):
        param = f"messages.{i}.content.{j}"
        kind = _kind(raw, param)
        if kind == "text":
            text = [*(text or []), _block(TextBlock, raw, param).text]
        elif kind == "tool_result":
            if text is not None:
                out.append({"role": "user", "content": "".join(text)})
                text = None
            res = _block(ToolResultBlock, raw, param)
            body = res.content if isinstance(res.content, str) or res.content is None else _texts(
                res.content, f"{param}.content", "tool result")
            msg: dict[str, Any] = {"role": "tool", "tool_call_id": res.tool_use_id, "content": body or ""}
            if res.is_error:
                msg["is_error"] = True  # recorded; chat templates have no error flag: the model reads the text
            out.append(msg)
        else:
            raise _unsupported(kind, "user", param)
    if text is not None or not content:
        out.append({"role": "user", "content": "".join(text or [])})


def _assistant(
    content: str | list[dict[str, Any]], i: int, key: bytes, out: list[dict[str, Any]], drop_bad_thinking: bool = False,
) -> None:
    """An assistant message: text, thinking (signature checked) as reasoning_content, tool uses as tool_calls.
    `drop_bad_thinking` (thinking.block_binding "drop_block"): a block whose signature fails is left out."""
    if isinstance(content, str):
        out.append({"role": "assistant", "content": content})
        return
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        param = f"messages.{i}.content.{j}"
        kind = _kind(raw, param)
        if kind == "text":
            texts.append(_block(TextBlock, raw, param).text)
        elif kind == "thinking":
            think = _block(ThinkingBlock, raw, param)
            if not verify_thinking(key, think.signature, think.thinking):
                if drop_bad_thinking:
                    continue
                raise BadRequest(f"{param}.signature: not a signature this gateway issued for this thinking text "
                                 "(send thinking blocks back unchanged, or leave them out)", param=f"{param}.signature")
            reasoning.append(think.thinking)
        elif kind == "tool_use":
            use = _block(ToolUseBlock, raw, param)
            calls.append({"id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}})
        else:
            raise _unsupported(kind, "assistant", param)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    out.append(msg)


@dataclass
class ToolChange:
    """A `tool_addition` or `tool_removal` block of a system message, in the order the messages hold them."""

    add: bool
    name: str
    definition: AnthropicTool | None
    param: str


def _system_message(m: MessageParam, i: int, shown: bool, out: list[dict[str, Any]], changes: list[ToolChange]) -> None:
    """A `{"role": "system"}` entry of `messages`: its text becomes a system message in place (the template renders
    it where it stands, as Anthropic's API does) unless `clear_at: "next_user_message"` and a later user message
    hide it; its tool_addition / tool_removal blocks change the offered tools (`chat_tools`)."""
    blocks: list[Any] = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
    texts: list[str] = []
    for j, raw in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        kind = _kind(raw, param)
        if kind == "text":
            texts.append(_block(TextBlock, raw, param).text)
        elif kind in ("tool_addition", "tool_removal"):
            changes.append(_tool_change(raw, kind == "tool_addition", param))
        else:
            raise BadRequest(f"{param}: a {kind} block does not belong in a system message (text, tool_addition and "
                             "tool_removal do)", param=param)
    if (not blocks or m.content == "") and m.output_config is None:  # "" is as empty as []
        raise BadRequest(f"messages.{i}: a system message needs content or output_config", param=f"messages.{i}")
    if shown and texts and "".join(texts):
        out.append({"role": "system", "content": "".join(texts)})


def _tool_change(raw: dict[str, Any], add: bool, param: str) -> ToolChange:
    tool = raw.get("tool")
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind == "tool_reference" and isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool["name"]:
        return ToolChange(add, tool["name"], None, param)
    if add and kind == "tool_definition" and isinstance(tool, dict) and isinstance(tool.get("definition"), dict):
        try:
            definition = AnthropicTool.model_validate(tool["definition"])
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join([param, "tool.definition", *(str(p) for p in err.get("loc", ()))])
            raise BadRequest(f"{where}: {err['msg']}", param=where) from None
        return ToolChange(add, definition.name, definition, param)
    if kind in ("mcp_tool_reference", "mcp_toolset_reference"):
        raise BadRequest(f"{param}.tool: MCP tools are run by Anthropic's API; connect them in the agent and offer "
                         "their tools as tools", param=f"{param}.tool")
    allowed = "tool_reference or tool_definition" if add else "tool_reference"
    raise BadRequest(f"{param}.tool: must be a {allowed} object", param=f"{param}.tool")


def chat_messages(
    body: CountTokensRequest, key: bytes, changes: list[ToolChange] | None = None
) -> list[dict[str, Any]]:
    """The request's system prompt and messages as OpenAI-form chat messages; `changes` collects the tool
    additions and removals of system messages."""
    out: list[dict[str, Any]] = []
    changes = [] if changes is None else changes
    system = body.system if isinstance(body.system, str) or body.system is None else _texts(
        body.system, "system", "system")
    if system:
        out.append({"role": "system", "content": system})
    drop = body.thinking is not None and (body.thinking.block_binding or {}).get("prefix_mismatch_behavior") == "drop_block"
    last_user = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=-1)
    for i, m in enumerate(body.messages):
        if m.role != "system" and (m.clear_at is not None or m.output_config is not None):
            name = "clear_at" if m.clear_at is not None else "output_config"
            raise BadRequest(f"messages.{i}.{name}: only permitted on role: system messages", param=f"messages.{i}.{name}")
        if m.role == "user":
            _user(m.content, i, out)
        elif m.role == "assistant":
            _assistant(m.content, i, key, out, drop)
        else:
            _system_message(m, i, m.clear_at != "next_user_message" or i > last_user, out, changes)
    if body.messages[-1].role == "assistant":
        raise BadRequest("the last message is the assistant's: prefill (continuing a partial assistant reply) is "
                         "not supported; end with a user message", param=f"messages.{len(body.messages) - 1}")
    return out


def _function(t: AnthropicTool, param: str) -> dict[str, Any]:
    note_unknown_fields(t, "messages.tools")
    if t.type not in (None, "custom"):
        raise BadRequest(f"{param}.type: {t.type!r} is a server tool, run on Anthropic's side; only client "
                         "tools (name, description, input_schema) are supported", param=f"{param}.type")
    if t.input_schema is None:
        raise BadRequest(f"{param}.input_schema: Field required", param=f"{param}.input_schema")
    fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def chat_tools(tools: list[AnthropicTool] | None, changes: Sequence[ToolChange] = ()) -> list[dict[str, Any]] | None:
    """The tools the model is shown: those of `tools` without `defer_loading`, then each system message's
    tool_addition (a declared tool by name, or a definition) and tool_removal in order. A chat template renders
    the tools once, ahead of the conversation, so a change applies to the whole prompt of the turn that carries
    it (a turn whose tools differ from its parent's starts a new chain, reason `different_tools`)."""
    declared: dict[str, dict[str, Any]] = {}
    shown: list[str] = []
    for i, t in enumerate(tools or ()):
        declared[t.name] = _function(t, f"tools.{i}")
        if not t.defer_loading and t.name not in shown:
            shown.append(t.name)
    for c in changes:
        if c.definition is not None:
            declared[c.name] = _function(c.definition, f"{c.param}.tool.definition")
        elif c.name not in declared:
            raise BadRequest(f"{c.param}.tool.name: no tool {c.name!r} in tools or added earlier in messages",
                             param=f"{c.param}.tool.name")
        if c.add and c.name not in shown:
            shown.append(c.name)
        elif not c.add and c.name in shown:
            shown.remove(c.name)
    return [declared[n] for n in shown] or None


def openai_tool_choice(choice: AnthropicToolChoice | None) -> Any:
    """Anthropic's tool_choice as the chat route's: any -> "required", tool -> a named function."""
    if choice is None:
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest("tool_choice.name: Field required when type is 'tool'", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type  # auto, none


def tools_for(
    choice: AnthropicToolChoice | None, tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]] | None, ForcedTools | None]:
    """(the tools the turn is rendered with, the forced choice): the chat route's `tools_for_choice`, with
    `disable_parallel_tool_use` as its `parallel_tool_calls: false`; the same grammar, or the same 400."""
    no_parallel = choice.disable_parallel_tool_use if choice is not None else None
    parallel = None if no_parallel is None else not no_parallel
    return tools_for_choice(openai_tool_choice(choice), tools, parallel)


def thinking_kwargs(thinking: ThinkingConfig | None, template_source: str) -> dict[str, Any]:
    """`thinking` as the template's `enable_thinking` variable where the template has one (Qwen3); elsewhere
    the model's template decides whether it reasons, and the config is only recorded."""
    if thinking is None or "enable_thinking" not in template_source:
        return {}
    return {"enable_thinking": thinking.type != "disabled"}


# --- context_management ------------------------------------------------------------------------------


CONTEXT_EDIT_REASON = "context_management"
"""The chain reason of a turn whose prompt a context edit changed: it is rendered whole, as a new chain."""
CLEARED_TOOL_RESULT = "[tool result cleared to save context]"
"""What `clear_tool_uses_20250919` leaves in place of a cleared tool result (and of a cleared input's JSON)."""


@dataclass
class Counter:
    """Token counts for the edits that need them, from the gateway's own template and tokenizer."""

    text: Callable[[str], int]
    prompt: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], int]


@dataclass
class ContextEdits:
    applied: list[dict[str, Any]] = field(default_factory=list)
    """Anthropic's `context_management.applied_edits` of the answer."""
    changed: bool = False
    """An edit removed something the model would have seen: the turn starts a new chain."""


def _edit_value(edit: dict[str, Any], name: str, kinds: tuple[str, ...], default: Any, param: str) -> Any:
    """An edit's `keep` / `trigger` / `clear_at_least` as (type, value); absent or null: `default`."""
    v = edit.get(name)
    if v is None:
        return default
    if v == "all" and "all" in kinds:
        return ("all", 0)
    if isinstance(v, dict) and v.get("type") in kinds:
        if v["type"] == "all":
            return ("all", 0)
        n = v.get("value")
        if type(n) is int and n >= 0:
            return (str(v["type"]), n)
    want = " or ".join(f'{{"type": "{k}", "value": N}}' if k != "all" else '"all"' for k in kinds)
    raise BadRequest(f"{param}.{name}: must be {want} (N >= 0)", param=f"{param}.{name}")


def _clear_thinking(edit: dict[str, Any], msgs: list[dict[str, Any]], count: Counter | None, param: str) -> dict[str, Any]:
    keep = _edit_value(edit, "keep", ("thinking_turns", "all"), ("thinking_turns", 1), param)  # Anthropic's default: 1
    turns = [m for m in msgs if m["role"] == "assistant"]
    cleared = turns if keep[0] != "all" and keep[1] == 0 else turns[: -keep[1]] if keep[0] != "all" else []
    n = tokens = 0
    for m in cleared:
        if m.get("reasoning_content"):
            n += 1
            tokens += count.text(m["reasoning_content"]) if count is not None else 0
            del m["reasoning_content"]
    return {"type": "clear_thinking_20251015", "cleared_thinking_turns": n, "cleared_input_tokens": tokens}


def _clear_tool_uses(edit: dict[str, Any], msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     count: Counter | None, param: str) -> dict[str, Any]:
    trigger = _edit_value(edit, "trigger", ("input_tokens", "tool_uses"), ("input_tokens", 100_000), param)
    keep = _edit_value(edit, "keep", ("tool_uses",), ("tool_uses", 3), param)  # Anthropic's defaults
    at_least = _edit_value(edit, "clear_at_least", ("input_tokens",), None, param)
    exclude = edit.get("exclude_tools") or []
    inputs = edit.get("clear_tool_inputs", False)
    if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        raise BadRequest(f"{param}.exclude_tools: must be a list of tool names", param=f"{param}.exclude_tools")
    if not (isinstance(inputs, bool) or (isinstance(inputs, list) and all(isinstance(x, str) for x in inputs))):
        raise BadRequest(f"{param}.clear_tool_inputs: must be a boolean or a list of tool names",
                         param=f"{param}.clear_tool_inputs")
    none = {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 0, "cleared_input_tokens": 0}
    calls = [(m, c) for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    if trigger[0] == "tool_uses":
        if len(calls) < trigger[1]:
            return none
    elif count is None or count.prompt(msgs, tools) < trigger[1]:
        return none
    results = {m["tool_call_id"]: m for m in msgs if m["role"] == "tool"}
    older = calls[: max(len(calls) - keep[1], 0)]
    plan: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (c, results[c["id"]]) for _, c in older if c["function"]["name"] not in exclude and c["id"] in results
        and results[c["id"]]["content"] != CLEARED_TOOL_RESULT]
    freed = 0
    if count is not None:
        for c, res in plan:
            freed += count.text(res["content"])
            if inputs is True or (isinstance(inputs, list) and c["function"]["name"] in inputs):
                freed += count.text(c["function"]["arguments"])
    if not plan or (at_least is not None and freed < at_least[1]):
        return none
    for c, res in plan:
        res["content"] = CLEARED_TOOL_RESULT
        if inputs is True or (isinstance(inputs, list) and c["function"]["name"] in inputs):
            c["function"]["arguments"] = "{}"
    return {"type": "clear_tool_uses_20250919", "cleared_tool_uses": len(plan), "cleared_input_tokens": freed}


def context_edits(body: CountTokensRequest, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  count: Counter | None) -> ContextEdits:
    """Apply `context_management.edits` to the chat messages, in order, as Anthropic's API applies them to the
    prompt: `clear_thinking_20251015` drops the reasoning of all but the last `keep` assistant turns ("all":
    nothing, a no-op); `clear_tool_uses_20250919`, once `trigger` is reached, puts CLEARED_TOOL_RESULT in place of
    all but the last `keep` tool results (and `{}` for the inputs `clear_tool_inputs` names). `compact_20260112`
    (a summary written by the model, server-side) is refused."""
    out = ContextEdits()
    if body.context_management is None:
        return out
    for k, edit in enumerate(body.context_management.edits):
        param = f"context_management.edits.{k}"
        kind = edit.get("type")
        if kind == "clear_thinking_20251015":
            done = _clear_thinking(edit, msgs, count, param)
            changed = done["cleared_thinking_turns"] > 0
        elif kind == "clear_tool_uses_20250919":
            done = _clear_tool_uses(edit, msgs, tools, count, param)
            changed = done["cleared_tool_uses"] > 0
        elif kind == "compact_20260112":
            raise BadRequest(f"{param}.type: compaction (a summary of the history written server-side) is not "
                             "supported: summarize or trim the history in the agent", param=f"{param}.type")
        else:
            raise BadRequest(f"{param}.type: unknown context edit {kind!r} (clear_thinking_20251015 and "
                             "clear_tool_uses_20250919 are supported)", param=f"{param}.type")
        out.applied.append(done)
        out.changed |= changed
    return out


def turn_request(
    body: CountTokensRequest, size: int, *, key: bytes, template_source: str, count: Counter | None = None,
) -> tuple[TurnRequest, ContextEdits]:
    """The turn a Messages (or count_tokens) request asks for, and what its context edits did."""
    for name, why in REFUSED_FIELDS.items():
        if (body.model_extra or {}).get(name) is not None:
            raise BadRequest(f"{name} is not supported: {why}", param=name)
    changes: list[ToolChange] = []
    messages = chat_messages(body, key, changes)
    tools, forced = tools_for(body.tool_choice, chat_tools(body.tools, changes))
    edits = context_edits(body, messages, tools, count)
    json_schema = None
    if body.output_config is not None and body.output_config.format is not None:
        json_schema = json.dumps(body.output_config.format.schema_)
    req = TurnRequest(
        endpoint="messages", messages=messages, tools=tools,
        asked=body.model_dump(exclude={"messages", "tools", "system"}, exclude_none=True, by_alias=True),
        json_schema=json_schema, forced=forced, body_bytes=size,
        template_kwargs=thinking_kwargs(body.thinking, template_source),
        new_chain_reason=CONTEXT_EDIT_REASON if edits.changed else None, fit_to_context=True,
    )
    if isinstance(body, MessagesRequest):
        req.max_tokens = body.max_tokens
        req.stop = list(body.stop_sequences or [])
        req.temperature = body.temperature
        req.top_p = body.top_p
    return req, edits


# --- turn -> message ------------------------------------------------------------------------------------


def tool_input(arguments: str) -> Any:
    """A parsed call's arguments (always JSON text) as the tool_use block's `input`."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # the parsers only produce JSON; kept whole rather than lost if one did not
        return {"arguments": arguments}


def content_blocks(parsed: ParsedReply, turn_id: str, key: bytes, *, omit_thinking: bool = False) -> list[dict[str, Any]]:
    """The reply as content blocks: thinking (signed), text, then one tool_use per call."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning_content:
        text = "" if omit_thinking else parsed.reasoning_content
        blocks.append({"type": "thinking", "thinking": text, "signature": sign_thinking(key, turn_id, text)})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    return blocks


def stop_reason(finish_reason: str, gen: Generation, stops: list[str], window: bool = False) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished turn. `window`: max_tokens was cut to what the
    context left (`TurnRequest.fit_to_context`), so a reply of that length ran into the context window."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return ("model_context_window_exceeded" if window else "max_tokens"), None
    matched = (gen.finish or {}).get("matched")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens the prefix cache did not serve, which are
    `cache_read_input_tokens`; their sum is the prompt's length."""
    cached = min(max(cached, 0), prompt)
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def context_cut(prepared: PreparedTurn) -> bool:
    """max_tokens was cut to what the context left after the prompt (`TurnRequest.fit_to_context`)."""
    asked = prepared.req.max_tokens
    return asked is not None and prepared.max_new_tokens < asked


def thinking_omitted(body: MessagesRequest) -> bool:
    return body.thinking is not None and body.thinking.display == "omitted"
