"""One reply from the backend pool, whole or streamed, kept whole across backend aborts.

A weight publish pauses the backends in abort mode: an in-flight request comes back with its partial
tokens and an abort finish reason. We resubmit prompt + partial with the budget reduced, to the same
backend (its prefix cache is warm; while paused it holds new requests until continue), and stamp each
token with the weight version that produced it (docs/architecture.md, "Weight versions"). A backend that
dies mid-stream is handled the same way: the pool marks it failed, and prompt + partial go to a healthy
one. Either way the agent sees one reply, and `Generation.backends` records which backend produced which
tokens.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from array import array
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from gateway.adapters import missing, out_of_sync, route_adapter
from gateway.errors import BadRequest, ServiceUnavailable
from gateway.pool import Backend, BackendPool, NoBackendAvailable
from gateway.sessions_cache import PromptIds, ids_json, join_json
from gateway.sglang import BackendRejected, BackendUnavailable
from gateway.store.store import unique_id

log = logging.getLogger("rollway.gateway")


def parse_version(v: str | None) -> int:
    """Backends report str(version); "default" (never updated) is version 0."""
    if v is None:
        return 0
    try:
        return int(v)
    except ValueError:
        return 0


def input_ids(prompt: Sequence[int], more: list[int]) -> Any:
    """The payload's `input_ids`: the prompt, then the tokens generated so far (a resubmission). A prompt that
    extends its parent (`PromptIds`: a long session's history) goes as its JSON, kept from turn to turn
    (orjson.Fragment: the same bytes as serialising the ids, without doing so); another int32 array as a NumPy
    view of it, which the SGLang client serialises without making a Python int of each id (OPT_SERIALIZE_NUMPY)."""
    if isinstance(prompt, PromptIds):
        return orjson.Fragment(join_json(prompt.json, ids_json(more), bracket=True))
    if isinstance(prompt, array):
        ids = np.frombuffer(prompt, dtype=np.int32)
        return np.concatenate([ids, np.asarray(more, dtype=np.int32)]) if more else ids
    return [*prompt, *more]


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
    backends: list[tuple[int, str]] = field(default_factory=list)
    """(index of the first token, backend id) each time another backend took over the reply."""
    rid: str = ""
    """The rid of the attempt in flight (`<base>-<attempt>`): the handle for `/abort_request`."""
    client_gone: bool = False
    """Set when the caller left (gateway.disconnect): an abort then ends the reply instead of being resubmitted."""

    def served_by(self, backend_id: str) -> None:
        self.backend_id = backend_id
        if not self.backends or self.backends[-1][1] != backend_id:
            self.backends.append((len(self.ids), backend_id))

    @property
    def finish_type(self) -> str:
        return str((self.finish or {}).get("type") or "abort")

    def add(self, ids: list[int], logprobs: list[float] | None, tops: Any, version: int) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend([version] * len(ids))
        if tops is not None:
            self.top_logprobs.extend(tops)


async def generate(
    pool: BackendPool,
    *,
    session_id: str,
    group_id: str | None,
    prompt_ids: Sequence[int],
    sampling: dict[str, Any],
    max_new_tokens: int,
    top_logprobs: int,
    stream: bool,
    max_resubmits: int,
    out: Generation,
) -> AsyncGenerator[int, None]:
    """Yields the number of new tokens each time `out` grew; `out.finish` is set when done.

    Raises ServiceUnavailable when no backend answers or the reply was interrupted too often.
    """
    base_rid = unique_id("")
    constrained = any(sampling.get(k) is not None for k in GRAMMAR_KEYS)
    for attempt in range(max_resubmits + 1):
        if constrained and out.ids:
            _restart(out, stream)
        if out.client_gone:
            out.finish = {"type": "abort", "message": "client disconnected"}
            return
        budget = max_new_tokens - len(out.ids)
        if budget <= 0:
            out.finish = {"type": "length", "length": max_new_tokens}
            return
        payload: dict[str, Any] = {
            "input_ids": input_ids(prompt_ids, out.ids),
            "sampling_params": {**sampling, "max_new_tokens": budget},
            "return_logprob": True,
            "rid": f"{base_rid}-{attempt}",
        }
        if top_logprobs:
            payload["top_logprobs_num"] = top_logprobs
        out.rid = payload["rid"]
        adapter = route_adapter(pool, session_id, payload)  # a LoRA publish: lora_path, and the version it is
        # The pool keeps a session on its backend, so a resubmission lands where the prefix is cached.
        try:
            if stream:
                gen = pool.stream_with_failover(session_id, group_id, payload,
                                                lambda b: out.served_by(b.id))
                try:
                    async for chunk in gen:
                        out.prompt_tokens = chunk.prompt_tokens or out.prompt_tokens
                        out.cached_tokens = chunk.cached_tokens or out.cached_tokens
                        if chunk.output_ids:
                            out.add(chunk.output_ids, chunk.logprobs, chunk.top_logprobs,
                                    adapter.version if adapter else parse_version(chunk.weight_version))
                            yield len(chunk.output_ids)
                        if chunk.finish_reason is not None:
                            out.finish = chunk.finish_reason
                finally:
                    await gen.aclose()
            else:
                backend, res = await pool.run_with_failover(session_id, group_id, functools.partial(_generate_on, payload=payload))
                out.served_by(backend.id)
                out.prompt_tokens = res.prompt_tokens or out.prompt_tokens
                out.cached_tokens = res.cached_tokens or out.cached_tokens
                out.add(res.output_ids, res.logprobs, res.top_logprobs,
                        adapter.version if adapter else parse_version(res.weight_version))
                out.finish = res.finish_reason
                if res.output_ids:
                    yield len(res.output_ids)
        except BackendRejected as e:
            if adapter is not None and missing(e):  # unloaded meanwhile (evicted, another gateway): route again
                if out_of_sync(e):  # a restarted server: out of rotation until its recovery loads the adapters
                    with contextlib.suppress(NoBackendAvailable):
                        pool.mark_failed(pool.pick(session_id, group_id), f"adapter {adapter.name}: {e}")
                await pool.adapters.refresh()
                continue
            raise BadRequest(f"the inference backend refused the request: {e}") from e
        except NoBackendAvailable as e:
            raise ServiceUnavailable(f"no inference backend is available: {e}", retry_after=5) from e
        except BackendUnavailable as e:
            # Lost mid-stream (the pool marked it failed): what was sent on stays, the rest comes from
            # another backend, as after a publish's abort.
            log.warning("backend lost mid-reply after %d tokens, resubmitting: %s", len(out.ids), e)
            out.finish = None
        if out.finish is not None and (out.finish_type != "abort" or out.client_gone):
            return
        out.resubmits = attempt + 1
    raise ServiceUnavailable(
        f"generation was interrupted {max_resubmits + 1} times (weight updates?); giving up", retry_after=5
    )


GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
"""sampling_params that constrain decoding (docs/sglang-contract.md "Constrained decoding")."""


def _restart(out: Generation, stream: bool) -> None:
    """An interrupted reply under a grammar starts over: a backend given prompt + partial would start the grammar
    again at the partial's end (SGLang cannot resume one), and the reply would not be what it forced. A stream
    that already sent tokens cannot take them back: 503, and the client retries."""
    if stream:
        raise ServiceUnavailable(
            "a reply decoded under a grammar (a forced tool_choice or response_format) was interrupted mid-stream "
            "(a weight update or a lost backend) and cannot be resumed; retry the request", retry_after=1)
    log.info("restarting a constrained reply interrupted after %d tokens", len(out.ids))
    out.ids.clear()
    out.logprobs.clear()
    out.versions.clear()
    out.top_logprobs.clear()
    out.backends.clear()


async def _generate_on(backend: Backend, payload: dict[str, Any]) -> tuple[Backend, Any]:
    return backend, await backend.client.generate(payload)
