"""Real streaming of chat completions: backend chunks become OpenAI chunks as they arrive.

The first backend chunk is awaited before the response starts, so "no backend" is still a proper 503.
Whatever happens after that (client gone, backend failure), the turn is stored: a client that
disconnects loses nothing from the record (finish reason `abort`, `client_disconnected`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.errors import GatewayError
from gateway.generation import Generation, generate
from gateway.routes.replies import logprobs_content, usage
from gateway.templating import ChatTemplate, IncrementalDetokenizer
from gateway.turns import PreparedTurn, TurnService

log = logging.getLogger("rollway.gateway")


_detached: set[asyncio.Task[None]] = set()


async def _store_partial(agen: Any, turns: TurnService, prepared: PreparedTurn, gen: Generation) -> None:
    await agen.aclose()
    await turns.finish(prepared, gen, client_disconnected=True)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_turn(
    request: Request, prepared: PreparedTurn, *, model: str, include_usage: bool, want_logprobs: bool
) -> StreamingResponse:
    state = request.app.state
    turns: TurnService = state.turns
    gen = Generation()
    agen = generate(
        state.pool, session_id=prepared.auth.id, group_id=prepared.auth.group_id, prompt_ids=prepared.prompt_ids,
        sampling=prepared.sampling, max_new_tokens=prepared.max_new_tokens, top_logprobs=prepared.req.top_logprobs,
        stream=True, max_resubmits=state.settings.max_resubmits, out=gen,
    )
    try:
        first: int | None = await agen.__anext__()
    except StopAsyncIteration:
        first = None

    base = {"id": prepared.turn_id, "object": "chat.completion.chunk", "created": int(prepared.started),
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    async def body() -> AsyncIterator[bytes]:
        parser = turns.reply_parser(prepared)
        detok = IncrementalDetokenizer(turns.template)
        emitted: dict[str, str] = {"content": "", "reasoning_content": ""}
        seen = 0
        stored = False
        try:
            yield chunk({"role": "assistant", "content": ""})

            async def pieces() -> AsyncIterator[int]:
                if first is not None:
                    yield first
                async for n in agen:
                    yield n

            async for _ in pieces():
                delta = detok.feed(gen.ids[seen:])
                lp = None
                if want_logprobs:
                    lp = {"content": logprobs_content(turns, gen.ids[seen:], gen.logprobs[seen:],
                                                      gen.top_logprobs[seen:])}
                seen = len(gen.ids)
                out = parser.feed(delta) if delta else []
                for kind, piece in out:
                    emitted[kind] += piece
                    yield chunk({kind: piece}, logprobs=lp)
                    lp = None
                if lp is not None and lp["content"]:
                    yield chunk({}, logprobs=lp)
            done = await turns.finish(prepared, gen)
            stored = True
            for kind, piece in parser.feed(detok.flush()):
                emitted[kind] += piece
                yield chunk({kind: piece})
            final = parser.finish()
            for kind, value in (("reasoning_content", final.reasoning_content), ("content", final.content)):
                rest = (value or "")[len(emitted[kind]):]
                if rest:
                    yield chunk({kind: rest})
            if final.tool_calls:
                calls = ChatTemplate.assistant_message(final)["tool_calls"]
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
            yield chunk({}, finish=done.finish_reason)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(len(prepared.prompt_ids), len(gen.ids),
                                                                   gen.cached_tokens)})
            yield b"data: [DONE]\n\n"
        except GatewayError as e:
            yield sse(e.body())
            yield b"data: [DONE]\n\n"
        finally:
            if not stored:
                # Client went away (or the backend failed) mid-stream: keep what was generated. This
                # scope may be cancelled (anyio re-raises at every await), so the store runs detached.
                task = asyncio.ensure_future(_store_partial(agen, turns, prepared, gen))
                _detached.add(task)
                task.add_done_callback(_detached.discard)
            else:
                await agen.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
