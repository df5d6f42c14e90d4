"""One reply from the backend pool, whole or streamed, kept whole across backend aborts.

A weight publish pauses the backends in abort mode: an in-flight request comes back with its partial
tokens and an abort finish reason. We resubmit prompt + partial with the budget reduced, to the same
backend (its prefix cache is warm; while paused it holds new requests until continue), and stamp each
token with the weight version that produced it (design "Weight versions"; sglang-contract "How RL systems
drive an update"). The agent sees one reply.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest, ServiceUnavailable
from gateway.pool import Backend, BackendPool, NoBackendAvailable
from gateway.sglang import BackendRejected, BackendUnavailable


def parse_version(v: str | None) -> int:
    """Backends report str(version); "default" (never updated) is version 0."""
    if v is None:
        return 0
    try:
        return int(v)
    except ValueError:
        return 0


@dataclass(slots=True)
class Generation:
    """What came back so far; filled in place while pieces arrive."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    resubmits: int = 0
    backend_id: str | None = None

    @property
    def finish_type(self) -> str:
        return str((self.finish or {}).get("type") or "abort")

    def add(self, ids: list[int], logprobs: list[float] | None, tops: Any, version: int) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend([version] * len(ids))
        if tops is not None:
            self.top_logprobs.extend(tops)


def _raise_rejected(e: BackendRejected) -> None:
    raise BadRequest(f"the inference backend refused the request: {e.message}") from e


async def generate(
    pool: BackendPool,
    *,
    session_id: str,
    group_id: str | None,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    max_new_tokens: int,
    top_logprobs: int,
    stream: bool,
    max_resubmits: int,
    out: Generation,
) -> AsyncIterator[int]:
    """Yields the number of new tokens each time `out` grew; `out.finish` is set when done.

    Raises ServiceUnavailable when no backend answers or the reply was interrupted too often.
    """
    backend: Backend | None = None
    base_rid = uuid.uuid4().hex
    for attempt in range(max_resubmits + 1):
        budget = max_new_tokens - len(out.ids)
        if budget <= 0:
            out.finish = {"type": "length", "length": max_new_tokens}
            return
        payload: dict[str, Any] = {
            "input_ids": prompt_ids + out.ids,
            "sampling_params": {**sampling, "max_new_tokens": budget},
            "return_logprob": True,
            "rid": f"{base_rid}-{attempt}",
        }
        if top_logprobs:
            payload["top_logprobs_num"] = top_logprobs
        if stream:
            backend, gen = await _open_stream(pool, backend, session_id, group_id, payload)
            try:
                async for chunk in gen:
                    out.prompt_tokens = chunk.prompt_tokens or out.prompt_tokens
                    out.cached_tokens = chunk.cached_tokens or out.cached_tokens
                    if chunk.output_ids:
                        out.add(chunk.output_ids, chunk.logprobs, chunk.top_logprobs, parse_version(chunk.weight_version))
                        yield len(chunk.output_ids)
                    if chunk.finish_reason is not None:
                        out.finish = chunk.finish_reason
            except BackendRejected as e:
                _raise_rejected(e)
            except BackendUnavailable as e:
                pool.mark_failed(backend)
                raise ServiceUnavailable(f"inference backend failed mid-stream: {e}", retry_after=2) from e
            finally:
                await gen.aclose()
        else:
            try:
                if backend is None:
                    backend, res = await pool.run_with_failover(
                        session_id, group_id, lambda b: _generate_on(b, payload)
                    )
                else:  # resubmission goes to the same backend; fall back to the pool if it died
                    try:
                        res = await backend.client.generate(payload)
                    except BackendUnavailable:
                        pool.mark_failed(backend)
                        backend, res = await pool.run_with_failover(
                            session_id, group_id, lambda b: _generate_on(b, payload)
                        )
            except BackendRejected as e:
                _raise_rejected(e)
            except NoBackendAvailable as e:
                raise ServiceUnavailable(str(e) or "no inference backend is available", retry_after=5) from e
            out.prompt_tokens = res.prompt_tokens or out.prompt_tokens
            out.cached_tokens = res.cached_tokens or out.cached_tokens
            out.add(res.output_ids, res.logprobs, res.top_logprobs, parse_version(res.weight_version))
            out.finish = res.finish_reason
            if res.output_ids:
                yield len(res.output_ids)
        out.backend_id = backend.id if backend is not None else None
        if out.finish_type != "abort":
            return
        out.resubmits = attempt + 1
    raise ServiceUnavailable(
        f"generation was interrupted {max_resubmits + 1} times (weight updates?); giving up", retry_after=5
    )


async def _generate_on(backend: Backend, payload: dict[str, Any]) -> tuple[Backend, Any]:
    return backend, await backend.client.generate(payload)


async def _open_stream(
    pool: BackendPool, backend: Backend | None, session_id: str, group_id: str | None, payload: dict[str, Any]
) -> tuple[Backend, Any]:
    """A stream whose first chunk is not yet read; failover happens on connect errors only."""
    tried: set[str] = set()
    while True:
        if backend is None or not backend.healthy or backend.id in tried:
            try:
                backend = pool.pick(session_id, group_id, exclude=tried)
            except NoBackendAvailable as e:
                raise ServiceUnavailable(str(e) or "no inference backend is available", retry_after=5) from e
        tried.add(backend.id)
        gen = backend.client.generate_stream(payload)
        try:
            first = await gen.__anext__()
        except BackendUnavailable:
            await gen.aclose()
            pool.mark_failed(backend)
            continue
        except BackendRejected as e:
            await gen.aclose()
            _raise_rejected(e)
        except StopAsyncIteration:
            first = None
        return backend, _prepend(first, gen)


async def _prepend(first: Any, gen: Any) -> AsyncIterator[Any]:
    try:
        if first is not None:
            yield first
            async for chunk in gen:
                yield chunk
    finally:
        await gen.aclose()
