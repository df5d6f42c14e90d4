"""Anthropic's Messages API: `/v1/messages`, `/v1/messages/count_tokens`, and `/v1/models` (+ `/{id}`) in the
shape the Anthropic SDK expects; each also under /sessions/{session_id}/v1/...

Served by `routes.dispatch` like the OpenAI routes, on the same turn service: a Messages call is prepared,
generated, recorded and chained as a chat completion is (`gateway.anthropic.translate` translates both ways), and its
turn id is the message id (`msg_…`). Errors leave in Anthropic's shape (`gateway.anthropic.errors`).
`/v1/models` is served here for both SDKs: with an `anthropic-version` header in Anthropic's shape, without
one by the OpenAI route's handler, unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.anthropic.stream import MessageEvents
from gateway.anthropic.translate import (
    Counter,
    check_blocks,
    content_blocks,
    context_cut,
    session_signing_key,
    signing_key,
    stop_reason,
    thinking_kwargs,
    thinking_omitted,
    turn_request,
    usage,
)
from gateway.auth import chat_session, model_reader
from gateway.errors import NotFound
from gateway.protocol import note_unknown_fields
from gateway.routes.common import M, json_response, parse_body, read_raw_body
from gateway.routes.openai_api import ROUTES as OPENAI_ROUTES
from gateway.routes.replies import check_counts, run_to_end
from gateway.routes.streaming import stream_turn
from gateway.services import services, serving
from gateway.store.store import unique_id
from gateway.turns import TurnService

log = logging.getLogger("rollway.gateway")
_seen_betas: set[str] = set()


def _note_headers(request: Request) -> None:
    """`anthropic-beta` asks for features by name; none changes what the gateway does: logged once each."""
    for beta in (request.headers.get("anthropic-beta") or "").split(","):
        beta = beta.strip()[:64]
        if beta and beta not in _seen_betas and len(_seen_betas) < 100:
            _seen_betas.add(beta)
            log.info("ignoring anthropic-beta %s (docs/conformance-anthropic.md)", beta)


async def _read(request: Request, model: type[M]) -> tuple[M, int]:
    """The body, with messages, tools and content blocks counted before validation (`check_counts`)."""
    raw = await read_raw_body(request)
    settings = services(request).settings

    def precheck(data: dict[str, Any]) -> None:
        check_counts(data, settings, "messages")
        check_blocks(data, settings)

    body = parse_body(raw, model, precheck)
    note_unknown_fields(body, "messages")
    return body, len(raw)


def _key(request: Request, session_id: str) -> bytes:
    return session_signing_key(signing_key(services(request).admin_key), session_id)


def _counter(turns: TurnService, body: CountTokensRequest) -> Counter | None:
    """Token counts for context edits (only a request that carries edits pays for them)."""
    if body.context_management is None or not body.context_management.edits:
        return None
    template = turns.template
    kwargs = thinking_kwargs(body.thinking, template.tokenizer.chat_template or "")
    return Counter(text=lambda t: len(template.encode(t)),
                   prompt=lambda msgs, tools: len(template.render_prompt(msgs, tools, {**turns.template_kwargs, **kwargs})[0]))


async def _messages(request: Request, session_id: str | None) -> Response:
    auth = await chat_session(request, session_id, anthropic=True)  # the key first, before the body is read
    _note_headers(request)
    body, size = await _read(request, MessagesRequest)
    turns: TurnService = serving(request).turns
    key = _key(request, auth.id)
    req, edits = turn_request(body, size, key=key, template_source=turns.template.tokenizer.chat_template or "",
                              count=_counter(turns, body))
    prepared = await turns.prepare(auth, req, max_session_tokens=services(request).settings.max_session_tokens)
    prepared.turn_id = unique_id("msg_")  # Anthropic's id form; the turn is stored under it
    model: str = serving(request).model_name
    omit = thinking_omitted(body)
    managed = {"applied_edits": edits.applied} if body.context_management is not None else None
    if body.stream:
        return await stream_turn(request, prepared, MessageEvents(prepared, model=model, key=key, omit_thinking=omit,
                                                                  context_management=managed))
    gen, done = await run_to_end(request, prepared)
    reason, sequence = stop_reason(done.finish_reason, gen, req.stop, window=context_cut(prepared))
    answer: dict[str, Any] = {
        "id": done.turn_id, "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(done.parsed, done.turn_id, key, omit_thinking=omit),
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage(len(prepared.prompt_ids), len(gen.ids), gen.cached_tokens),
    }
    if managed is not None:
        answer["context_management"] = managed
    return json_response(answer)


async def _count_tokens(request: Request, session_id: str | None) -> Response:
    """The exact prompt length the same request would have on /v1/messages now: the session's chain
    (continuity) and the gateway's own template and tokenizer. Nothing is generated or stored."""
    auth = await chat_session(request, session_id, anthropic=True)
    body, size = await _read(request, CountTokensRequest)
    turns: TurnService = serving(request).turns
    req, edits = turn_request(body, size, key=_key(request, auth.id),
                              template_source=turns.template.tokenizer.chat_template or "", count=_counter(turns, body))
    prepared = await turns.prepare(auth, req)
    answer: dict[str, Any] = {"input_tokens": len(prepared.prompt_ids)}
    if body.context_management is not None:
        answer["context_management"] = {"original_input_tokens": len(prepared.prompt_ids) + sum(
            e["cleared_input_tokens"] for e in edits.applied)}
    return json_response(answer)


def model_info(request: Request) -> dict[str, Any]:
    name: str = serving(request).model_name
    ctx: int = serving(request).context_length
    return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z",
            "lifecycle": "active", "max_input_tokens": ctx, "max_tokens": ctx}


async def _models(request: Request, session_id: str | None) -> Response:
    if "anthropic-version" not in request.headers:
        return await OPENAI_ROUTES["/v1/models"][1](request, session_id)
    await model_reader(request, session_id, anthropic=True)
    q = request.query_params
    info = model_info(request)
    # One model: nothing comes before or after it.
    data = [] if q.get("after_id") or q.get("before_id") else [info]
    return json_response({"data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": False})


async def retrieve_model(request: Request, session_id: str | None, model_id: str) -> Response:
    """GET /v1/models/{id}: the served model in the caller's SDK's shape; any other id is a 404."""
    anthropic = "anthropic-version" in request.headers
    await model_reader(request, session_id, anthropic=anthropic)
    name: str = serving(request).model_name
    if model_id != name:
        raise NotFound(f"no model {model_id!r}: this gateway serves {name!r} (any model name is accepted on "
                       "the chat and messages routes, and recorded)")
    if anthropic:
        return json_response(model_info(request))
    return json_response({"id": name, "object": "model", "created": 0, "owned_by": "rollway"})


# Served by `gateway.routes.dispatch.SessionRoutes` at these paths and under /sessions/{session_id}; merged
# after the OpenAI routes, so "/v1/models" is this module's (which hands OpenAI clients to the OpenAI handler).
ROUTES = {
    "/v1/messages": ("POST", _messages),
    "/v1/messages/count_tokens": ("POST", _count_tokens),
    "/v1/models": ("GET", _models),
}
