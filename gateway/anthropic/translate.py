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

Every field, block and header and what becomes of it: docs/conformance-anthropic.md.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.anthropic.protocol import (
    REFUSED_FIELDS,
    AnthropicTool,
    AnthropicToolChoice,
    CountTokensRequest,
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
from gateway.turns import TurnRequest, tools_for_choice

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


def _assistant(content: str | list[dict[str, Any]], i: int, key: bytes, out: list[dict[str, Any]]) -> None:
    """An assistant message: text, thinking (signature checked) as reasoning_content, tool uses as tool_calls."""
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


def chat_messages(body: CountTokensRequest, key: bytes) -> list[dict[str, Any]]:
    """The request's system prompt and messages as OpenAI-form chat messages."""
    out: list[dict[str, Any]] = []
    system = body.system if isinstance(body.system, str) or body.system is None else _texts(
        body.system, "system", "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if m.role == "user":
            _user(m.content, i, out)
        else:
            _assistant(m.content, i, key, out)
    if body.messages[-1].role == "assistant":
        raise BadRequest("the last message is the assistant's: prefill (continuing a partial assistant reply) is "
                         "not supported; end with a user message", param=f"messages.{len(body.messages) - 1}")
    return out


def chat_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        note_unknown_fields(t, "messages.tools")
        if t.type not in (None, "custom"):
            raise BadRequest(f"tools.{i}.type: {t.type!r} is a server tool, run on Anthropic's side; only client "
                             "tools (name, description, input_schema) are supported", param=f"tools.{i}.type")
        if t.input_schema is None:
            raise BadRequest(f"tools.{i}.input_schema: Field required", param=f"tools.{i}.input_schema")
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


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


def turn_request(body: CountTokensRequest, size: int, *, key: bytes, template_source: str) -> TurnRequest:
    """The turn a Messages (or count_tokens) request asks for."""
    for name, why in REFUSED_FIELDS.items():
        if (body.model_extra or {}).get(name) is not None:
            raise BadRequest(f"{name} is not supported: {why}", param=name)
    tools, forced = tools_for(body.tool_choice, chat_tools(body.tools))
    json_schema = None
    if body.output_config is not None and body.output_config.format is not None:
        json_schema = json.dumps(body.output_config.format.schema_)
    req = TurnRequest(
        endpoint="messages", messages=chat_messages(body, key), tools=tools,
        asked=body.model_dump(exclude={"messages", "tools", "system"}, exclude_none=True, by_alias=True),
        json_schema=json_schema, forced=forced, body_bytes=size,
        template_kwargs=thinking_kwargs(body.thinking, template_source),
    )
    if isinstance(body, MessagesRequest):
        req.max_tokens = body.max_tokens
        req.stop = list(body.stop_sequences or [])
        req.temperature = body.temperature
        req.top_p = body.top_p
    return req


# --- turn -> message ------------------------------------------------------------------------------------


def tool_input(arguments: str) -> Any:
    """A parsed call's arguments (always JSON text) as the tool_use block's `input`."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):  # the parsers only produce JSON; kept whole rather than lost if one did not
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


def stop_reason(finish_reason: str, gen: Generation, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished turn."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
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


def thinking_omitted(body: MessagesRequest) -> bool:
    return body.thinking is not None and body.thinking.display == "omitted"
