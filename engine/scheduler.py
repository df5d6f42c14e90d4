"""Continuous batching: one thread owns the model and steps every running request together.

Each loop iteration runs the control calls posted since the last one (submit, abort, pause, continue,
weight swap), prefills newly admitted requests together (their first token comes from the prefill),
merges them into the running batch, takes one decode step for all rows, and hands each request its new
tokens. Requests join and leave between steps; nothing else touches the model, so no locks are needed.
Results go back to the asyncio side as `Delta`s through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.batch import DecodeBatch, prefill
from engine.grammar import GrammarRows, accept, new_matcher
from engine.sampling import SamplingParams, adjust_logits, sample

log = logging.getLogger(__name__)

PREFILL_TOKEN_BUDGET = 4096  # padded tokens in one prefill forward
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}

LogprobEntry = tuple[float | None, int]
TopEntry = list[tuple[float, int]] | None


@dataclass
class Delta:
    """What one request gained in one scheduler iteration. `finish` is set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopEntry] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    weight_version: str = "default"
    input_logprobs: list[LogprobEntry] | None = None
    input_top: list[TopEntry] | None = None
    error: str | None = None


@dataclass(eq=False)
class GenRequest:
    """One generation as the scheduler sees it. `queue` lives on `loop`; the scheduler only posts to it."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False  # deltas after every step; otherwise one at the end
    lora: Any = None
    """The request's LoRA adapter (engine/lora.py `Adapter`), or None: the base model."""
    grammar: Any = None
    """The request's compiled grammar (engine/grammar.py), or None: unconstrained."""


@dataclass(eq=False)
class _Seq:
    req: GenRequest
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    prefilled: bool = False
    pending: Delta | None = None
    matcher: Any = None
    """The grammar's state over this request's output (kept across a weight swap's re-prefill)."""


@dataclass
class Stats:
    """Counters since start, read by `GET /metrics` (benchmarks/loop.py takes differences over its window)."""

    paused_s: float = 0.0
    """Seconds paused (`/pause_generation` to `/continue_generation`): nothing runs."""
    busy_s: float = 0.0
    """Seconds the model thread spent in prefill and decode forwards (with sampling)."""
    decode_steps: int = 0
    decode_rows: int = 0
    """Rows over all decode steps: decode_rows / decode_steps is the mean batch occupancy."""
    prefill_forwards: int = 0
    prefill_rows: int = 0
    prefill_computed_rows: int = 0
    """Rows a prefill forward actually computed (identical sequences are computed once: engine/batch.py)."""
    swaps: int = 0
    released_kv_bytes: int = 0
    """Bytes of KV cache freed by `/release_memory_occupation` (engine/memory.py), over all releases."""


class Scheduler:
    """The model thread. Public methods are thread-safe and return futures resolved by that thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        eos_ids: set[int],
        max_batch_size: int,
        context_length: int,
    ) -> None:
        self.model = model
        self._retired: PreTrainedModel | None = None
        """The model the last swap replaced: no step uses it any more, so the next weight update may fill it."""
        self._retired_lock = threading.Lock()
        self.keep_retired = True
        """Keep the retired model for the next update (memory: two models from the first publish on). Off when
        updates always load whole (the engine with LoRA serving), where it would only hold memory."""
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_batch_size = max_batch_size
        self.context_length = context_length
        self.weight_version = "default"
        self.lora: Any = None
        """engine/lora.py `LoRAManager` when LoRA is enabled: told each forward's per-row adapters."""
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._waiting: deque[_Seq] = deque()
        self._rows: list[_Seq] = []
        self._batch = DecodeBatch()
        self._paused = False
        self._paused_at = 0.0
        self.stats = Stats()
        self._pending_swap: tuple[Callable[[], int], Future[Any]] | None = None
        self._stopping = False
        self._dirty: list[_Seq] = []
        self.released: set[str] = set()
        """Memory released by `/release_memory_occupation` (engine/memory.py): nothing runs until it is resumed."""
        self._weight_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._thread = threading.Thread(target=self._run, name="rollway-engine", daemon=True)

    # ---- called from other threads ------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stopping:
            self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call(self._request_stop).result(timeout=30)
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the model thread between two steps."""
        future: Future[Any] = Future()
        self._calls.put((fn, future))
        return future

    def submit(self, req: GenRequest) -> None:
        def enqueue() -> None:
            seq = _Seq(req, req.params.make_generator())
            if req.grammar is not None:
                seq.matcher = new_matcher(req.grammar, sorted(self._stop_ids(seq)))
            self._waiting.append(seq)

        self.call(enqueue)

    def abort(self, rid: str | None, *, exact: bool = False) -> Future[Any]:
        """Abort requests whose rid starts with `rid` (or equals it); all of them when `rid` is None. As SGLang
        0.5.23 with one tokenizer worker (`TokenizerManager.abort_request`): nothing unless a request has exactly
        `rid`; then the scheduler aborts every rid starting with it."""

        def match(seq: _Seq) -> bool:
            return rid is None or seq.req.rid == rid or (not exact and seq.req.rid.startswith(rid))

        def run() -> None:
            if rid is None or any(s.req.rid == rid for s in (*self._waiting, *self._rows)):
                self._abort(match)

        return self.call(run)

    def pause(self, mode: str) -> Future[Any]:
        return self.call(lambda: self._pause(mode))

    def resume(self) -> Future[Any]:
        return self.call(self._resume)

    def _resume(self) -> None:
        if self._paused:
            self.stats.paused_s += time.perf_counter() - self._paused_at
        self._paused = False

    def swap_model(self, model: PreTrainedModel, version: str | None, abort_all: bool) -> Future[Any]:
        """Serve `model` from the next step on; resolves with the number of requests that were paused."""
        future: Future[Any] = Future()

        def swap() -> int:
            paused = len(self._rows)
            self.stats.swaps += 1
            with self._retired_lock:
                if model is not self.model:  # a swap to the model already served (a sync) retires nothing
                    self._retired = self.model if self.keep_retired else None
                self.model = model
            if version is not None:
                self.weight_version = version
            # The cache was computed with the old weights: running rows are prefilled again.
            for seq in reversed(self._rows):
                seq.prefilled = True
                self._waiting.appendleft(seq)
            self._rows, self._batch = [], DecodeBatch()
            return paused

        def register() -> None:
            if abort_all:
                self._abort(lambda s: True)
            if self._pending_swap is not None:
                self._pending_swap[1].set_exception(RuntimeError("superseded by a later weight update"))
            self._pending_swap = (swap, future)
            self._maybe_swap()  # at once when paused or idle; otherwise once the running rows are done

        self._calls.put((register, Future()))
        return future

    def take_retired(self) -> PreTrainedModel | None:
        """The model the last swap retired, once (a second caller gets None): a buffer to load the next weights into
        (`load_like`'s `into`), from any thread."""
        with self._retired_lock:
            model, self._retired = self._retired, None
        return model

    def stats_now(self) -> dict[str, float]:
        """The counters, a pause in progress counted up to now (read from any thread: a torn read of two
        counters is off by one step at most)."""
        stats = dataclasses.asdict(self.stats)
        if self._paused:
            stats["paused_s"] += time.perf_counter() - self._paused_at
        return {k: float(v) for k, v in stats.items()}

    def busy(self) -> Future[Any]:
        return self.call(lambda: bool(self._rows or self._waiting))

    # ---- the model thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping:
            idle = not (self._rows or self._waiting or self._pending_swap)
            self._run_calls(block=self._paused or idle or bool(self.released))
            if self._stopping or self._paused or self.released:
                continue
            try:
                self._maybe_swap()
                t0 = time.perf_counter()
                self._admit()
                if self._rows:
                    self._decode()
                self.stats.busy_s += time.perf_counter() - t0
            except Exception as exc:  # a bug in a step must not hang every client: fail them and go on
                log.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
            self._flush()

    def release_memory(self, tags: list[str]) -> int:
        """On the model thread: free what `tags` name (SGLang's `release_memory_occupation`); the bytes freed.
        `kv_cache`: the running rows' cache (they go back to the queue and are prefilled again once resumed);
        `weights`: the served model's tensors (zeros once resumed, until a weight update fills them); `cuda_graph`:
        nothing here. As SGLang asserts, the server must be idle or paused."""
        if self._rows and not self._paused:
            raise RuntimeError("release_memory_occupation should be called only when server is idle.")
        freed = 0
        if "kv_cache" in tags and "kv_cache" not in self.released:
            if self._batch.cache is not None:
                layers: list[Any] = list(self._batch.cache.layers)
                for layer in layers:
                    for t in (getattr(layer, "_k", layer.keys), getattr(layer, "_v", layer.values)):
                        if t is not None:
                            freed += t.numel() * t.element_size()
            for seq in reversed(self._rows):  # retracted: prefilled again after the resume
                seq.prefilled = True
                self._waiting.appendleft(seq)
            self._rows, self._batch = [], DecodeBatch()
            self.stats.released_kv_bytes += freed
        if "weights" in tags and "weights" not in self.released:
            with self._retired_lock:
                self._retired = None
            for name, p in self.model.named_parameters():
                self._weight_shapes[name] = (p.shape, p.dtype)
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released.update(tags)
        return freed

    def resume_memory(self, tags: list[str]) -> None:
        """On the model thread: take back what `release_memory` freed (a tag not released is an error, as in
        SGLang). The cache is rebuilt by the next prefill; released weights come back as zeros."""
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise RuntimeError(f"{missing} not released: nothing to resume")
        if "weights" in tags:
            for name, p in self.model.named_parameters():
                shape, dtype = self._weight_shapes.pop(name, (p.shape, p.dtype))
                if p.numel() == 0 and shape.numel():
                    p.data = torch.zeros(shape, dtype=dtype, device=p.device)
        self.released.difference_update(tags)

    def _request_stop(self) -> None:
        self._stopping = True
        self._abort(lambda s: True)
        self._flush()

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=None) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # handed back to the caller, who decides
                    future.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
        self._flush()

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(lambda s: True)
        if not self._paused:
            self._paused_at = time.perf_counter()
        self._paused = True
        if self._pending_swap is not None:
            self._maybe_swap()

    def _maybe_swap(self) -> None:
        if self._pending_swap is None or (self._rows and not self._paused):
            return
        swap, future = self._pending_swap
        self._pending_swap = None
        future.set_result(swap())

    def _abort(self, match: Callable[[_Seq], bool]) -> None:
        for seq in [s for s in self._waiting if match(s)]:
            self._waiting.remove(seq)
            self._finish(seq, ABORTED if seq.output_ids else ABORTED_WAITING)
        keep = [i for i, s in enumerate(self._rows) if not match(s)]
        for seq in self._rows:
            if match(seq):
                self._finish(seq, ABORTED)
        self._rows = [self._rows[i] for i in keep]
        self._batch.keep(keep)

    def _fail_all(self, message: str) -> None:
        for seq in [*self._waiting, *self._rows]:
            self._delta(seq).error = message
            self._finish(seq, {"type": "abort", "message": message, "status_code": 500, "err_type": None})
        self._waiting.clear()
        self._rows, self._batch = [], DecodeBatch()

    def _admit(self) -> None:
        if self._pending_swap is not None:
            return
        admitted: list[_Seq] = []
        while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
            seq = self._waiting.popleft()
            if seq.req.params.max_new_tokens == 0:
                if self._wants_input_logprobs(seq):
                    self._prefill([seq])
                self._finish(seq, {"type": "length", "length": 0})
                continue
            admitted.append(seq)
        for group in self._prefill_groups(admitted):
            batch, logits = self._prefill(group)
            alive = self._take_step(group, logits)
            batch.keep(alive)
            self._batch.extend(batch)
            self._rows += [group[i] for i in alive]

    def _wants_input_logprobs(self, seq: _Seq) -> bool:
        return seq.req.return_logprob and seq.req.logprob_start_len >= 0 and not seq.prefilled

    def _prefill_groups(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        """Pack prefills under a padded-token budget; one that wants prompt logprobs goes alone."""
        groups: list[list[_Seq]] = []
        current: list[_Seq] = []
        width = 0
        for seq in seqs:
            n = len(seq.req.input_ids) + len(seq.output_ids)
            if self._wants_input_logprobs(seq):
                groups.append([seq])
                continue
            if current and (max(width, n) * (len(current) + 1) > PREFILL_TOKEN_BUDGET
                            or seq.req.lora is not current[0].req.lora):  # one adapter per prefill
                groups.append(current)
                current, width = [], 0
            current.append(seq)
            width = max(width, n)
        return [*groups, current] if current else groups

    def _prefill(self, group: list[_Seq]) -> tuple[DecodeBatch, torch.Tensor]:
        """Forward each sequence so far; return the rows' cache and their last logits (B, V)."""
        want_input = len(group) == 1 and self._wants_input_logprobs(group[0])
        sequences = [s.req.input_ids + s.output_ids for s in group]
        if self.lora is not None:
            self.lora.select([s.req.lora for s in group])
        batch, logits = prefill(self.model, sequences, all_logits=want_input)
        self.stats.prefill_forwards += 1
        self.stats.prefill_rows += len(sequences)
        self.stats.prefill_computed_rows += len({tuple(s) for s in sequences})
        if want_input:
            self._input_logprobs(group[0], logits[0])
            logits = logits[:, -1]
        for seq in group:
            seq.prefilled = True
        return batch, logits

    def _input_logprobs(self, seq: _Seq, logits: torch.Tensor) -> None:
        req = seq.req
        start = min(req.logprob_start_len, len(req.input_ids))
        scaled = torch.log_softmax(logits[: len(req.input_ids) - 1] / req.params.logprob_temperature, dim=-1)
        targets = torch.tensor(req.input_ids[1:])
        values = scaled.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        entries: list[LogprobEntry] = [(None, req.input_ids[0]), *zip(values, req.input_ids[1:], strict=True)]
        delta = self._delta(seq)
        delta.input_logprobs = entries[start:]
        if req.top_logprobs_num:
            k = min(req.top_logprobs_num, scaled.shape[-1])
            top_v, top_i = scaled.topk(k, dim=-1)
            tops: list[TopEntry] = [None] + [
                list(zip(v, i, strict=True)) for v, i in zip(top_v.tolist(), top_i.tolist(), strict=True)
            ]
            delta.input_top = tops[start:]

    def _decode(self) -> None:
        inputs = self._batch.step_inputs([s.output_ids[-1] for s in self._rows])
        if self.lora is not None:
            self.lora.select([s.req.lora for s in self._rows])
        logits = self.model(**inputs).logits[:, -1, :]  # (B, V)
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(self._rows)
        self._batch.stepped()
        alive = self._take_step(self._rows, logits)
        self._rows = [self._rows[i] for i in alive]
        self._batch.keep(alive)

    def _take_step(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        """Sample one token for each of `seqs` from `logits` (B, V); return the indices still running."""
        params = [s.req.params for s in seqs]
        banned = [
            sorted(self._stop_ids(s)) if len(s.output_ids) < s.req.params.min_new_tokens else [] for s in seqs
        ]
        logits = adjust_logits(logits.float(), params, [s.output_ids for s in seqs], banned)
        grammars = GrammarRows([s.matcher for s in seqs])
        if grammars.rows:  # after the penalties, as SGLang applies its vocab mask
            logits = grammars.mask(logits if logits.is_contiguous() else logits.contiguous())
        top_n = [s.req.top_logprobs_num if s.req.return_logprob else 0 for s in seqs]
        step = sample(logits, params, [s.generator for s in seqs], top_n, masked=bool(grammars.rows))
        alive = []
        for i, seq in enumerate(seqs):
            seq.output_ids.append(step.tokens[i])
            ended = seq.matcher is not None and accept(seq.matcher, step.tokens[i])
            delta = self._delta(seq)
            delta.token_ids.append(step.tokens[i])
            if seq.req.return_logprob:
                delta.logprobs.append(step.logprobs[i])
                if seq.req.top_logprobs_num:
                    delta.top.append(step.top[i])
            finish = self._check_finish(seq)
            if finish is None and ended:  # the grammar is complete: SGLang finishes on its last token
                finish = {"type": "stop", "matched": step.tokens[i]}
            elif ended is None:
                finish = {"type": "abort", "message": "the grammar allowed no token here", "status_code": 400,
                          "err_type": "BadRequestError"}
            if finish is None:
                alive.append(i)
            else:
                self._finish(seq, finish)
        return alive

    def _stop_ids(self, seq: _Seq) -> set[int]:
        p = seq.req.params
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)

    def _check_finish(self, seq: _Seq) -> dict[str, Any] | None:
        p = seq.req.params
        token, n = seq.output_ids[-1], len(seq.output_ids)
        if n >= p.min_new_tokens and token in self._stop_ids(seq):
            return {"type": "stop", "matched": token}
        if p.stop and n >= p.min_new_tokens:
            longest = max(len(s) for s in p.stop)
            tail = self.tokenizer.decode(
                seq.output_ids[-(4 * longest + 4) :], skip_special_tokens=p.skip_special_tokens
            )
            for stop in p.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if n >= p.max_new_tokens or len(seq.req.input_ids) + n >= self.context_length:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _delta(self, seq: _Seq) -> Delta:
        if seq.pending is None:
            seq.pending = Delta()
            self._dirty.append(seq)
        return seq.pending

    def _finish(self, seq: _Seq, reason: dict[str, Any]) -> None:
        self._delta(seq).finish = reason

    def _flush(self) -> None:
        """Post every pending delta, one callback per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delta], Delta]]] = {}
        deferred = []
        for seq in self._dirty:
            if seq.pending is None:
                continue
            if not (seq.req.stream or seq.pending.finish):  # a plain request hears only its end
                deferred.append(seq)
                continue
            seq.pending.weight_version = self.weight_version
            by_loop.setdefault(seq.req.loop, []).append((seq.req.queue, seq.pending))
            seq.pending = None
        self._dirty = deferred
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its clients are gone
                log.warning("dropping %d results for a closed event loop", len(items))


def _put_all(items: list[tuple[asyncio.Queue[Delta], Delta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)
