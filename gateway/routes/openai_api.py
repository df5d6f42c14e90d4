"""OpenAI chat completions, completions and models; each also under /sessions/{session_id}/v1/..."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.auth import chat_session, model_reader
from gateway.errors import BadRequest
from gateway.protocol import (
    CHAT_REFUSED,
    COMPLETIONS_REFUSED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    note_unknown_fields,
    refuse_unsupported,
)
from gateway.routes.body_prefix import BodyPrefixes
from gateway.routes.common import json_response
from gateway.routes.message_reuse import MessageReuse
from gateway.routes.replies import logprobs_content, read_turn_body, run_to_end, usage
from gateway.routes.streaming import ChatChunks, CompletionChunks, stream_turn
from gateway.services import services, serving
from gateway.templating import RESERVED_TEMPLATE_KWARGS, ChatTemplate
from gateway.tool_grammar import response_format_schema
from gateway.turn_types import TurnRequest, tools_for_choice
from gateway.turns import TurnService

_TEXT_PARTS = ("text", "input_text", "output_text")
COMPLETION_MAX_TOKENS = 16
"""/v1/completions' max_tokens when it is left out or null, as on OpenAI's API."""
REUSE = MessageReuse()
"""Chat messages validated and converted before, by their JSON: an agent's every call replays its history."""
PREFIXES = BodyPrefixes()
"""Each session's latest chat body: the next one, replaying it, is decoded from its new bytes."""


def content_text(content: Any, param: str) -> str | None:
    """A string, or the concatenated text of content parts; non-text parts are refused."""
    if content is None or isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.type not in _TEXT_PARTS:
            raise BadRequest(f"content part type {part.type!r} is not supported (text only)", param=param)
        out.append(part.text or "")
    return "".join(out)


def message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    role = "system" if m.role == "developer" else ("tool" if m.role == "function" else m.role)
    d: dict[str, Any] = {"role": role, "content": content_text(m.content, f"messages.{i}.content")}
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": tc.id or f"call_{i}_{j}",
                "type": "function",
                "function": {
                    "name": tc.function.name,
                    "arguments": tc.function.arguments
                    if isinstance(tc.function.arguments, str)
                    else json.dumps(tc.function.arguments, ensure_ascii=False),
                },
            }
            for j, tc in enumerate(m.tool_calls)
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    if m.reasoning_content:
        d["reasoning_content"] = m.reasoning_content
    return d


def chat_turn_request(body: ChatCompletionRequest, body_bytes: int = 0) -> TurnRequest:
    if body.n not in (None, 1):
        raise BadRequest("n > 1 is not supported: each sample is its own session (POST /v1/groups)", param="n")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    tools, forced = tools_for_choice(tool_choice, tools, body.parallel_tool_calls)
    json_schema = response_format_schema(body.response_format)
    top = body.top_logprobs or 0
    asked = body.model_dump(exclude={"messages", "tools", "chat_template_kwargs"}, exclude_none=True)
    kwargs = body.chat_template_kwargs or {}
    if taken := sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys()):
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(taken)}: the gateway sets them",
                         param="chat_template_kwargs")
    return TurnRequest(
        endpoint="chat",
        messages=[REUSE.converted(m, i, message_dict) for i, m in enumerate(body.messages)],
        tools=tools,
        asked=asked,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        top_logprobs=top if body.logprobs else 0,
        json_schema=json_schema,
        forced=forced,
        body_bytes=body_bytes,
        template_kwargs=kwargs,
    )


async def _chat(request: Request, session_id: str | None) -> Response:
    # The key first: a caller without one is answered before any of its body is read or parsed.
    auth = await chat_session(request, session_id)
    body, size = await read_turn_body(request, ChatCompletionRequest, "messages", REUSE, PREFIXES, auth.id)
    note_unknown_fields(body, "chat.completions")
    refuse_unsupported(body, CHAT_REFUSED)
    turns: TurnService = serving(request).turns
    req = chat_turn_request(body, size)
    prepared = await turns.prepare(auth, req, max_session_tokens=services(request).settings.max_session_tokens)
    model = serving(request).model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_turn(request, prepared, ChatChunks(turns, prepared, model=model, include_usage=include_usage,
                                                               want_logprobs=bool(body.logprobs)))
    gen, done = await run_to_end(request, prepared)
    message = ChatTemplate.assistant_message(done.parsed)
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": done.finish_reason}
    if body.logprobs:
        choice["logprobs"] = {"content": logprobs_content(turns, gen.ids, gen.logprobs, gen.top_logprobs)}
    return json_response({
        "id": done.turn_id, "object": "chat.completion", "created": int(prepared.started), "model": model,
        "choices": [choice], "usage": usage(len(prepared.prompt_ids), len(gen.ids), gen.cached_tokens),
    })


async def _completions(request: Request, session_id: str | None) -> Response:
    auth = await chat_session(request, session_id)  # the key first, as in _chat
    body, size = await read_turn_body(request, CompletionRequest, None)
    note_unknown_fields(body, "completions")
    refuse_unsupported(body, COMPLETIONS_REFUSED)
    if body.n not in (None, 1):
        raise BadRequest("n > 1 is not supported: each sample is its own session (POST /v1/groups)", param="n")
    turns: TurnService = serving(request).turns
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise BadRequest("a batch of prompts is not supported; send one prompt per request", param="prompt")
        prompt = prompt[0]
    req = TurnRequest(
        endpoint="completions", messages=[], tools=None,
        # null is OpenAI's default (16), as when it is left out, not the rest of the context
        asked=body.model_dump(exclude={"prompt"}, exclude_none=True),
        max_tokens=body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, top_logprobs=body.logprobs or 0,
        raw_prompt=prompt if isinstance(prompt, str) else None,
        raw_prompt_ids=None if isinstance(prompt, str) else [int(x) for x in prompt],
        body_bytes=size,
    )
    prepared = await turns.prepare(auth, req, max_session_tokens=services(request).settings.max_session_tokens)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_turn(request, prepared, CompletionChunks(
            turns, prepared, model=serving(request).model_name, include_usage=include_usage, logprobs=body.logprobs,
        ), raw=True)
    gen, done = await run_to_end(request, prepared)
    choice: dict[str, Any] = {"index": 0, "text": done.text, "logprobs": None,
                              "finish_reason": "length" if done.finish_reason == "length" else "stop"}
    if body.logprobs is not None:
        toks = [turns.tokenizer.decode([t], skip_special_tokens=False) for t in gen.ids]
        choice["logprobs"] = {"tokens": toks, "token_logprobs": gen.logprobs, "text_offset": [],
                              "top_logprobs": None}
    return json_response({
        "id": done.turn_id, "object": "text_completion", "created": int(time.time()),
        "model": serving(request).model_name, "choices": [choice],
        "usage": usage(len(prepared.prompt_ids), len(gen.ids), gen.cached_tokens),
    })


async def _models(request: Request, session_id: str | None) -> Response:
    await model_reader(request, session_id)
    name = serving(request).model_name
    return json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "rollway"}
    ]})


# Served by `gateway.routes.dispatch.SessionRoutes` at these paths and under /sessions/{session_id}.
ROUTES = {
    "/v1/chat/completions": ("POST", _chat),
    "/v1/completions": ("POST", _completions),
    "/v1/models": ("GET", _models),
}
