"""Real streaming of a turn: backend chunks become the client's events as they arrive.

One core (`stream_turn`) for every streamed route: it runs the generation, decodes and parses the reply as it
grows, stores the turn, and keeps the record whatever happens. A `StreamFormat` turns what the core sees into
one API's wire events: chat completion chunks (`ChatChunks` here), completions chunks, Responses events
(`gateway.routes.responses_stream`); a new API (Anthropic's Messages) adds a format, not a copy of the turn.

The first backend chunk is awaited before the response starts, so "no backend" is still a proper 503.
Whatever happens after that (client gone, backend failure), the turn is stored: a client that disconnects
loses nothing from the record (finish reason `abort`, `client_disconnected`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.errors import GatewayError
from gateway.generation import Generation, generate
from gateway.routes.replies import logprobs_content, usage
from gateway.services import services, serving
from gateway.templating import ChatTemplate, IncrementalDetokenizer
from gateway.tool_parsers import ParsedReply
from gateway.turn_types import FinishedTurn, PreparedTurn
from gateway.turns import TurnService

log = logging.getLogger("rollway.gateway")


_detached: set[asyncio.Task[None]] = set()

Span = tuple[int, int]
"""[start, end) of the generated ids a piece of text came from (`Generation.ids`)."""


class StreamFormat(Protocol):
    """One API's wire form of a streamed turn. Each method returns the bytes to send (maybe none).

    `start` gets the Generation the reply grows in (for logprobs of a span). `text` gets each piece of parsed reply text, `kind` "content" or "reasoning_content", with the span of
    ids it came from on the first piece of a chunk (else None); `tokens` a span that produced no text (its
    logprobs may still be wanted). `end` comes after the turn is stored: `final` is the streaming parser's
    whole reply, `done.parsed` the stored one (its tool-call ids are the record's). `error` is a failure
    after the response started."""

    def start(self, gen: Generation) -> list[bytes]: ...

    def text(self, kind: str, piece: str, span: Span | None) -> list[bytes]: ...

    def tokens(self, span: Span) -> list[bytes]: ...

    def end(self, done: FinishedTurn, final: ParsedReply, gen: Generation) -> list[bytes]: ...

    def error(self, exc: GatewayError) -> list[bytes]: ...


async def _store_partial(agen: Any, turns: TurnService, prepared: PreparedTurn, gen: Generation) -> None:
    await agen.aclose()
    await turns.finish(prepared, gen, client_disconnected=True)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _StopHoldback:
    """Keeps a stop string out of the stream: the backend stops on the token that completes the string (which
    may run past it), and the reply as stored ends before the string. Text is held back while it could be
    the start of one (the longest string's length - 1 characters); once one shows up, nothing from its start
    on is let through."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.keep = max(map(len, self.stops), default=1) - 1
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        if self.stopped:
            return ""
        self.held += text
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.held, self.stopped = self.held[: min(found)], "", True
            return out
        n = len(self.held) - self.keep
        if n <= 0:
            return ""
        out, self.held = self.held[:n], self.held[n:]
        return out

    def rest(self, text: str) -> str:
        """What to let through at the end: `text` (the detokenizer's last piece) after what is held."""
        return self.feed(text) + ("" if self.stopped else self.held)


async def stream_turn(
    request: Request, prepared: PreparedTurn, fmt: StreamFormat, *, raw: bool = False
) -> StreamingResponse:
    """Stream `prepared` to the client in `fmt`'s events. `raw`: the reply is plain text (completions): no
    reasoning or tool-call parsing."""
    on = serving(request)
    settings = services(request).settings
    turns: TurnService = on.turns
    gen = Generation()
    agen = generate(
        on.pool, session_id=prepared.auth.id, group_id=prepared.auth.group_id, prompt_ids=prepared.prompt_ids,
        sampling=prepared.sampling, max_new_tokens=prepared.max_new_tokens, top_logprobs=prepared.req.top_logprobs,
        stream=True, max_resubmits=settings.max_resubmits, out=gen,
    )
    try:
        first: int | None = await agen.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        turns.dropped(prepared)
        raise

    async def body() -> AsyncIterator[bytes]:
        parser = None if raw else turns.reply_parser(prepared)
        detok = IncrementalDetokenizer(turns.template)
        hold = _StopHoldback(prepared.req.stop)
        emitted: dict[str, str] = {"content": "", "reasoning_content": ""}
        seen = fed = 0
        stored = False

        def parse(text: str) -> list[tuple[str, str]]:
            nonlocal fed
            fed += len(text)
            if parser is None:
                return [("content", text)] if text else []
            return [(str(k), p) for k, p in parser.feed(text)] if text else []

        try:
            for b in fmt.start(gen):
                yield b

            async def pieces() -> AsyncIterator[int]:
                if first is not None:
                    yield first
                async for n in agen:
                    yield n

            async for _ in pieces():
                delta = hold.feed(detok.feed(gen.ids[seen:]))
                span: Span | None = (seen, len(gen.ids))
                seen = len(gen.ids)
                for kind, piece in parse(delta):
                    emitted[kind] += piece
                    for b in fmt.text(kind, piece, span):
                        yield b
                    span = None
                if span is not None:
                    for b in fmt.tokens(span):
                        yield b
            done = await turns.finish(prepared, gen)
            stored = True
            tail = hold.rest(detok.flush())
            if isinstance((gen.finish or {}).get("matched"), str):  # the stored reply ends before the stop string
                tail = tail[: max(0, len(done.text) - fed)]
            for kind, piece in parse(tail):
                emitted[kind] += piece
                for b in fmt.text(kind, piece, None):
                    yield b
            final = parser.finish() if parser is not None else ParsedReply(done.text, None, [])
            for kind, value in (("reasoning_content", final.reasoning_content), ("content", final.content)):
                rest = (value or "")[len(emitted[kind]):]
                if rest:
                    for b in fmt.text(kind, rest, None):
                        yield b
            for b in fmt.end(done, final, gen):
                yield b
        except GatewayError as e:
            for b in fmt.error(e):
                yield b
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


class ChatChunks:
    """`chat.completion.chunk` events: a role delta, content / reasoning_content deltas, the tool calls as one
    delta when the reply is complete, the finish reason, optionally usage, then `[DONE]`."""

    def __init__(self, turns: TurnService, prepared: PreparedTurn, *, model: str, include_usage: bool,
                 want_logprobs: bool) -> None:
        self.turns = turns
        self.prepared = prepared
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.gen: Generation | None = None
        self.base = {"id": prepared.turn_id, "object": "chat.completion.chunk", "created": int(prepared.started),
                     "model": model}

    def chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse({**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}]})

    def _lp(self, span: Span | None) -> Any:
        if not self.want_logprobs or span is None or self.gen is None:
            return None
        g, (a, b) = self.gen, span
        return {"content": logprobs_content(self.turns, g.ids[a:b], g.logprobs[a:b], g.top_logprobs[a:b])}

    def start(self, gen: Generation) -> list[bytes]:
        self.gen = gen
        return [self.chunk({"role": "assistant", "content": ""})]

    def text(self, kind: str, piece: str, span: Span | None) -> list[bytes]:
        return [self.chunk({kind: piece}, logprobs=self._lp(span))]

    def tokens(self, span: Span) -> list[bytes]:
        lp = self._lp(span)
        return [self.chunk({}, logprobs=lp)] if lp is not None and lp["content"] else []

    def end(self, done: FinishedTurn, final: ParsedReply, gen: Generation) -> list[bytes]:
        out = []
        if final.tool_calls:
            calls = ChatTemplate.assistant_message(final)["tool_calls"]
            out.append(self.chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
        out.append(self.chunk({}, finish=done.finish_reason))
        if self.include_usage:
            out.append(sse({**self.base, "choices": [],
                            "usage": usage(len(self.prepared.prompt_ids), len(gen.ids), gen.cached_tokens)}))
        out.append(b"data: [DONE]\n\n")
        return out

    def error(self, exc: GatewayError) -> list[bytes]:
        return [sse(exc.body()), b"data: [DONE]\n\n"]


class CompletionChunks:
    """`text_completion` chunks of /v1/completions: text deltas (with `logprobs` in the legacy form when
    asked), the finish reason, optionally usage, then `[DONE]`."""

    def __init__(self, turns: TurnService, prepared: PreparedTurn, *, model: str, include_usage: bool,
                 logprobs: int | None) -> None:
        self.turns = turns
        self.prepared = prepared
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.gen: Generation | None = None
        self.base = {"id": prepared.turn_id, "object": "text_completion", "created": int(prepared.started),
                     "model": model}

    def chunk(self, text: str, span: Span | None, finish: str | None = None) -> bytes:
        lp: dict[str, Any] | None = None
        if self.logprobs is not None:
            lp = {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": None}
            if span is not None and self.gen is not None:
                a, b = span
                lp["tokens"] = [self.turns.token_text(t)[0] for t in self.gen.ids[a:b]]
                lp["token_logprobs"] = self.gen.logprobs[a:b]
        return sse({**self.base, "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]})

    def start(self, gen: Generation) -> list[bytes]:
        self.gen = gen
        return []

    def text(self, kind: str, piece: str, span: Span | None) -> list[bytes]:
        return [self.chunk(piece, span)]

    def tokens(self, span: Span) -> list[bytes]:
        return [self.chunk("", span)] if self.logprobs is not None else []

    def end(self, done: FinishedTurn, final: ParsedReply, gen: Generation) -> list[bytes]:
        finish = "length" if done.finish_reason == "length" else "stop"
        out = [self.chunk("", None, finish)]
        if self.include_usage:
            out.append(sse({**self.base, "choices": [],
                            "usage": usage(len(self.prepared.prompt_ids), len(gen.ids), gen.cached_tokens)}))
        out.append(b"data: [DONE]\n\n")
        return out

    def error(self, exc: GatewayError) -> list[bytes]:
        return [sse(exc.body()), b"data: [DONE]\n\n"]
