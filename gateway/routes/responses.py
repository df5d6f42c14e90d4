"""Stateless OpenAI Responses API (what the OpenAI Agents SDK calls by default).

Input items (message, function_call, function_call_output) become chat messages, so a Responses session
is recorded and chained exactly like a chat-completions one; output is message and function_call items.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.auth import chat_session
from gateway.errors import BadRequest
from gateway.protocol import RESPONSES_REFUSED, ResponsesRequest, note_unknown_fields, refuse_unsupported
from gateway.routes.common import json_response
from gateway.routes.replies import read_turn_body, run_to_end
from gateway.routes.responses_stream import (
    ResponseEvents,
    function_call_item,
    message_item,
    new_item_id,
    reasoning_item,
    response_object,
)
from gateway.routes.streaming import stream_turn
from gateway.services import services, serving
from gateway.turn_types import TurnRequest, tools_for_choice
from gateway.turns import TurnService


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("message content must be a string or a list of text parts", param=param)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            raise BadRequest("only text content parts are supported", param=param)
        text = p.get("text")
        if text is not None and not isinstance(text, str):  # a dict's repr or a dropped 0 would reach the prompt
            raise BadRequest(f"a text part's text must be a string, got {type(text).__name__}",
                             param=f"{param}.content.{j}.text")
        parts.append(text or "")
    return "".join(parts)


def _string(item: dict[str, Any], key: str, param: str, *, required: bool = False) -> str | None:
    """`item[key]`: a string (non-empty when `required`), or None when absent or null and not required."""
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise BadRequest(f"{key} must be a {'non-empty ' if required else ''}string, got "
                         f"{'null' if value is None else repr(value) if value == '' else type(value).__name__}",
                         param=f"{param}.{key}")
    return value


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message" if "role" in item else None)
        param = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"unsupported message role {role!r}", param=param)
            text = _text(item.get("content", ""), param)
            if role == "assistant" and msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
                msgs[-1]["content"] = (msgs[-1]["content"] or "") + text
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name = _string(item, "name", param, required=True)
            arguments = item.get("arguments")
            if isinstance(arguments, dict):  # lenient: the object the JSON text would hold
                arguments = json.dumps(arguments, ensure_ascii=False)
            elif arguments is not None and not isinstance(arguments, str):
                raise BadRequest(f"arguments must be a JSON string, got {type(arguments).__name__}",
                                 param=f"{param}.arguments")
            call_id = _string(item, "call_id", param) or _string(item, "id", param)
            call: dict[str, Any] = {"id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": arguments or "{}"}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue  # our own reasoning comes back; the exact ids are already in the chain
        else:
            raise BadRequest(f"unsupported input item type {kind!r}", param=param)
    return msgs


def text_json_schema(body: ResponsesRequest) -> str | None:
    """`text.format` json_schema / json_object: constrained decoding, as chat's `response_format`."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    return json.dumps(fmt.schema_ or {"type": "object"} if fmt.type == "json_schema" else {"type": "object"})


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.type == "function" and not t.name and isinstance((t.model_extra or {}).get("function"), dict):
            raise BadRequest('a Responses function tool is {"type": "function", "name", "parameters"}: this one has '
                             "Chat Completions' shape (its name inside \"function\")", param=f"tools.{i}")
        if t.type != "function":
            raise BadRequest(f"only function tools are supported, got {t.type!r}", param=f"tools.{i}")
        if not t.name:
            raise BadRequest("a function tool needs a name", param=f"tools.{i}.name")
        fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


async def _responses(request: Request, session_id: str | None) -> Response:
    auth = await chat_session(request, session_id)  # the key first: no body is read for a caller without one
    body, size = await read_turn_body(request, ResponsesRequest, "input")
    note_unknown_fields(body, "responses")
    refuse_unsupported(body, RESPONSES_REFUSED)
    if body.previous_response_id:
        raise BadRequest("this endpoint is stateless: send the whole conversation as input",
                         param="previous_response_id")
    # Responses' {"type": "function", "name"} is chat's {"type": "function", "function": {"name"}}; a forced
    # choice is decoded under a grammar, as on chat completions.
    tool_choice = body.tool_choice
    if isinstance(tool_choice, dict) and "function" not in tool_choice:
        tool_choice = {**tool_choice, "function": {"name": tool_choice.get("name")}}
    tools, forced = tools_for_choice(tool_choice, chat_tools(body), body.parallel_tool_calls)
    turns: TurnService = serving(request).turns
    req = TurnRequest(
        endpoint="responses", messages=input_messages(body), tools=tools,
        asked=body.model_dump(exclude={"input", "tools", "instructions"}, exclude_none=True, by_alias=True),
        max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, body_bytes=size,
        json_schema=text_json_schema(body), forced=forced,
    )
    if not req.messages:
        raise BadRequest("input is empty", param="input")
    prepared = await turns.prepare(auth, req, max_session_tokens=services(request).settings.max_session_tokens)
    if body.stream:
        return await stream_turn(request, prepared, ResponseEvents(serving(request).model_name, body, prepared))
    gen, done = await run_to_end(request, prepared)
    output: list[dict[str, Any]] = []
    if done.parsed.reasoning_content:
        output.append(reasoning_item(new_item_id("rs_"), done.parsed.reasoning_content))
    if done.parsed.content:
        output.append(message_item(new_item_id("msg_"), done.parsed.content))
    output.extend(function_call_item(tc) for tc in done.parsed.tool_calls)
    return json_response(response_object(serving(request).model_name, body, prepared, output,
                                         status="incomplete" if done.finish_reason == "length" else "completed",
                                         gen=gen))


ROUTES = {"/v1/responses": ("POST", _responses)}
