"""A non-streaming call whose client leaves while the backend generates.

Without this the backend kept generating to `max_tokens` for nobody and the turn said nothing of it. Here a
watcher waits on the ASGI receive channel beside the generation (once the body is read, the next message
is `http.disconnect`, sent when the client closes the connection); when it comes, the attempt in flight is
aborted with `/abort_request` and its rid. The backend answers the abort with the partial output (HTTP 200,
finish `abort`), `Generation.client_gone` stops `generate` from resubmitting it, and the partial turn is
stored as the streaming path stores one: finish reason `abort`, `client_disconnected`.

`run_to_end` is what every non-streaming route calls (chat, completions, responses, and any route that
prepares a turn with `TurnService.prepare`); the watcher costs a timer per call, and a task only for a
generation that runs longer than `WATCH_AFTER_S`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from gateway.generation import Generation, generate
from gateway.pool import BackendPool
from gateway.services import services, serving
from gateway.sglang import BackendError
from gateway.turn_types import FinishedTurn, PreparedTurn
from gateway.turns import TurnService

log = logging.getLogger("rollway.gateway")

WATCH_AFTER_S = 0.2
"""The generation's age when the watcher starts: a client that leaves is noticed at most this late."""
ABORT_RETRY_S = 0.25
"""An abort that reached the backend before the request did finds nothing to abort: it is sent again this
often until the generation has ended."""
ABORT_TRIES = 40

_aborts: set[asyncio.Task[None]] = set()


async def run_to_end(request: Request, prepared: PreparedTurn) -> tuple[Generation, FinishedTurn]:
    """Non-streaming generation, then the durable store of the turn; a client gone meanwhile aborts the
    backend request and leaves the partial turn recorded (`client_disconnected`)."""
    on = serving(request)
    settings = services(request).settings
    gen = Generation()
    watch = _Watch(request, gen, on.pool)
    turns: TurnService = on.turns
    try:
        async for _ in generate(
            on.pool, session_id=prepared.auth.id, group_id=prepared.auth.group_id,
            prompt_ids=prepared.prompt_ids, sampling=prepared.sampling, max_new_tokens=prepared.max_new_tokens,
            top_logprobs=prepared.req.top_logprobs, stream=False, max_resubmits=settings.max_resubmits,
            out=gen,
        ):
            pass
    except BaseException:
        turns.dropped(prepared)
        raise
    finally:
        watch.stop()
    finished = await turns.finish(prepared, gen, client_disconnected=gen.client_gone)
    if gen.client_gone:
        log.info("client left turn %s after %d tokens: backend request aborted, partial turn stored",
                 prepared.turn_id, len(gen.ids))
    return gen, finished


class _Watch:
    """Waits on the request's receive channel once the generation has run `WATCH_AFTER_S`: most replies end
    before that, and a timer is far cheaper on the hot path than the task a wait needs. A client that left
    earlier is seen at once then (the channel already holds its `http.disconnect`)."""

    __slots__ = ("done", "gen", "pool", "receive", "task", "timer")

    def __init__(self, request: Request, gen: Generation, pool: BackendPool) -> None:
        self.receive = request.receive
        self.gen = gen
        self.pool = pool
        self.done = asyncio.Event()
        self.task: asyncio.Future[Any] | None = None
        self.timer = services(request).loop.call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self.task = asyncio.ensure_future(self.receive())
        self.task.add_done_callback(lambda w: _on_message(w, self.gen, self.pool, self.done))

    def stop(self) -> None:
        self.done.set()
        self.timer.cancel()
        if self.task is not None:
            self.task.cancel()


def _on_message(watch: asyncio.Future[Any], gen: Generation, pool: BackendPool, done: asyncio.Event) -> None:
    if watch.cancelled() or watch.exception() is not None or done.is_set():
        return
    if watch.result().get("type") != "http.disconnect":
        return  # nothing else arrives once the body is read; ignore it rather than guess
    gen.client_gone = True
    task = asyncio.ensure_future(abort_generation(pool, gen, done))
    _aborts.add(task)
    task.add_done_callback(_aborts.discard)


async def abort_generation(pool: BackendPool, gen: Generation, done: asyncio.Event) -> None:
    """`/abort_request` for the attempt in flight on every healthy backend (the rid is unique, so the others
    ignore it; the pool may have failed the reply over), again until the generation has ended."""
    for _ in range(ABORT_TRIES):
        rid = gen.rid
        if rid:
            results = await asyncio.gather(*(b.client.abort(rid) for b in pool.backends() if b.healthy),
                                           return_exceptions=True)
            for r in results:
                if isinstance(r, BackendError):
                    log.warning("abort of %s failed: %s", rid, r)
                elif isinstance(r, BaseException):
                    raise r
        try:
            await asyncio.wait_for(done.wait(), ABORT_RETRY_S)
            return
        except TimeoutError:
            continue
