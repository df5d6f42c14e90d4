"""The trainer's side of a publish over torch process groups (`--weight-sync distributed`): no shared disk.

    rank 0, after a step:  state = SyncPayload.gather(model)      (collective, like the HF export)
    publish thread:        plan = POST /v1/weights/sync/init       the gateway picks the backends, one group each
                           rank 0 of every group (a TCP store per group on this host, one thread each)
                           POST /v1/weights/sync {ports, buckets}  while it is pending, every group gets the buckets
                           -> the gateway's answer: version published, backends that failed (out of rotation)

One group per backend, so a backend that dies mid-update breaks only its own group: the others finish and serve
the new version (docs/http-api.md "Weight sync over process groups"). Buckets are consecutive tensors of one
dtype up to `weight_sync_bucket_mb`, each sent as one `uint8` buffer of its bytes (SGLang's `flattened_bucket`).
Every rendezvous and broadcast has `weight_sync_timeout`. When no backend could take the weights over a group
(the gateway answers 503), the same state is written as an HF folder and published by path (the disk path).

A backend that lacks the current version (added after it was published, restarted, or failed mid-update) has no
folder to load it from: `CatchUp` (a thread on rank 0) sees it listed by the gateway and sends it the last
published payload again (`catch_up: true`), within `weight_sync_catch_up_s` seconds, without a new version.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from rollway_common.process_group import init_custom_process_group
from rollway_common.procs import free_port
from trainer import tensor_sync
from trainer.checkpoint import TOKENIZER_FILES, _fsync_dir, _fsync_tree, full_state_dict, save_dtype
from trainer.client import GatewayClient, GatewayHTTPError
from trainer.tensor_sync import LiveWeights, WeightsStillRead, exposable, host_id, share_cpu_tensors

log = logging.getLogger("trainer")


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into buckets of consecutive tensors of one dtype up to `bucket_bytes` (a larger tensor
    goes alone): one dtype, so the flat tensor the server rebuilds has exactly the tensors' dtype."""
    buckets: list[list[str]] = []
    size, dtype = 0, None
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if not buckets or t.dtype != dtype or size + n > bucket_bytes:
            buckets.append([])
            size, dtype = 0, t.dtype
        buckets[-1].append(name)
        size += n
    return buckets


@dataclass
class Bucket:
    names: list[str]
    shapes: list[list[int]]
    dtype: torch.dtype
    flat: torch.Tensor | None
    """The tensors back to back (a publish buffer); None when `views` holds them."""
    views: list[torch.Tensor] | None = None
    """The tensor path with the weights exposed (`LiveWeights`): the model's own tensors, no copy."""

    @property
    def nbytes(self) -> int:
        parts = self.views if self.views is not None else [self.flat] if self.flat is not None else []
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def is_cuda(self) -> bool:
        parts = self.views if self.views is not None else [self.flat] if self.flat is not None else []
        return any(t.is_cuda for t in parts)

    def manifest(self) -> dict[str, Any]:
        dtype = str(self.dtype).removeprefix("torch.")
        return {"names": self.names, "dtypes": [dtype] * len(self.names), "shapes": self.shapes}

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.views is not None:
            return dict(zip(self.names, self.views, strict=True))
        assert self.flat is not None
        numels = [int(torch.Size(s).numel()) for s in self.shapes]
        return {n: p.view(s) for n, p, s in zip(self.names, self.flat.split(numels), self.shapes, strict=True)}


def wire_bytes(flat: torch.Tensor) -> torch.Tensor:
    """A bucket as SGLang 0.5.23 receives a `flattened_bucket`: one `uint8` buffer of the tensors' bytes
    (`srt/weight_sync/tensor_bucket.py` `FlattenedTensorBucket.empty`, which the server allocates and broadcasts
    into; NCCL and gloo need both ends to name the same dtype and count). A view, no copy: a bucket holds one dtype,
    so every tensor starts at a multiple of its size, as the server checks."""
    return flat.reshape(-1).view(torch.uint8)


@dataclass
class Sender:
    """Rank 0 of one backend's group, on its own thread: join, broadcast every bucket, leave."""

    group: dict[str, Any]
    address: str
    port: int
    backend: str
    timeout: float
    buckets: list[Bucket]
    sent: int = 0
    error: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> Sender:
        self.thread = threading.Thread(target=self._run, name=f"sync-{self.group['group_name']}", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        pg = None
        try:
            pg = init_custom_process_group(self.backend, f"tcp://{self.address}:{self.port}",
                                           int(self.group["world_size"]), 0, str(self.group["group_name"]),
                                           timedelta(seconds=self.timeout))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for b in self.buckets:
                assert b.flat is not None  # process groups always send buckets
                flat = wire_bytes(b.flat)
                flat = flat.cuda() if self.backend == "nccl" else flat
                pg.broadcast([flat], opts).wait()
                self.sent += 1
        except Exception as e:  # reported with the gateway's answer; the other groups go on
            self.error = f"{type(e).__name__}: {e}"
        finally:
            if pg is not None:
                try:
                    dist.destroy_process_group(pg)
                except Exception as e:  # a broken group may refuse a clean teardown; it is dropped either way
                    log.debug("destroying group %s: %s", self.group["group_name"], e)

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


@dataclass
class SyncOptions:
    address: str = "127.0.0.1"
    """The address of this host that the inference servers reach (the groups' TCP stores listen here)."""
    backend: str = "auto"
    """gloo, nccl, or auto (nccl when CUDA is available); `tensor`: memory handles to servers on this machine, no
    process group (trainer/tensor_sync.py)."""
    device: str | None = None
    """The tensor path: where the buckets live (None: CPU shared memory; `cuda`: CUDA IPC handles)."""
    bucket_bytes: int = 512 << 20
    timeout: float = 120.0
    fallback_dir: Path | None = None
    """Where the disk fallback writes `vNNNNNN` (None: no fallback, the error is raised)."""
    on_bucket: Callable[[int], None] | None = None
    """Tests and benchmarks: called by the publish thread with each bucket count sent to every group."""
    catch_up: CatchUp | None = None
    """Told of each version published over process groups, to send it again to backends that lack it."""
    live: LiveWeights | None = None
    """The tensor path with one trainer rank: where the weights can be handed out as they are (CPU, in the
    checkpoint's dtype), the payload is the model's own parameters, no gather copy; the optimizer step waits on this
    for the servers' reads (trainer/tensor_sync.py)."""

    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


def sync_options(cfg: Any, out: Path, catch_up: CatchUp | None = None, live: LiveWeights | None = None) -> SyncOptions:
    """From the trainer's config (`weight_sync_*`); the disk fallback writes under `out/weights`."""
    tensor = cfg.weight_sync == "tensor"
    device = "cuda" if tensor and torch.cuda.is_available() else None
    return SyncOptions(address=cfg.weight_sync_address, backend="tensor" if tensor else cfg.weight_sync_backend,
                       device=device,
                       bucket_bytes=max(1, int(cfg.weight_sync_bucket_mb * (1 << 20))),
                       timeout=cfg.weight_sync_timeout, fallback_dir=out / "weights", catch_up=catch_up,
                       live=live if tensor else None)


class BufferSet:
    """One set of a publish's flat buffers. `generation` counts the gathers written into it, so a catch-up holding
    an older payload of this set sees that its data is gone; `lock` keeps a gather from overwriting the set while
    a catch-up sends from it."""

    def __init__(self, flats: list[torch.Tensor]) -> None:
        self.flats = flats
        self.generation = 0
        self.lock = threading.Lock()
        self.stranded = False
        """Servers may still be reading it (a publish whose end the gateway never confirmed): left as it is."""


_POOL: dict[tuple[Any, ...], list[BufferSet]] = {}
_TURN: dict[tuple[Any, ...], int] = {}


def _buffers(layout: list[list[str]], state: dict[str, torch.Tensor], device: str | None = None,
             shared: bool = False) -> BufferSet:
    """The flat buffers of a publish, reused: two sets per layout, taken in turn (the training loop holds at most
    two payloads: one publishing, the next just gathered). Fresh memory costs its page faults on every step: a
    100M-parameter copy took 1.5 s into new pages on 2 busy cores."""
    key = (*((tuple(names), state[names[0]].dtype) for names in layout), device, shared)

    def make(names: list[str]) -> torch.Tensor:
        t = torch.empty(sum(state[n].numel() for n in names), dtype=state[names[0]].dtype, device=device)
        if shared and t.device.type == "cpu":  # the tensor path hands out its memory by name
            share_cpu_tensors()
            t.share_memory_()
        return t

    if key not in _POOL:
        _POOL.clear()
        _TURN.clear()
        _POOL[key] = [BufferSet([make(names) for names in layout]) for _ in range(2)]
    turn = _TURN[key] = 1 - _TURN.get(key, 1)
    if _POOL[key][turn].stranded:  # servers may still read it: a fresh set takes its place
        _POOL[key][turn] = BufferSet([make(names) for names in layout])
    return _POOL[key][turn]


class SyncPayload:
    """A step's weights for a process-group publish: the flat buckets (rank 0; nothing on the other ranks), the
    model's config, and the folder the tokenizer files come from (for the disk fallback)."""

    def __init__(self, buckets: list[Bucket], config: Any, source: str | Path, options: SyncOptions,
                 buffers: BufferSet | None = None, live: LiveWeights | None = None, generation: int = 0) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self.live = live
        """Set when the buckets are the model's own tensors (`LiveWeights.expose` was called for this payload)."""
        self.generation = buffers.generation if buffers is not None else generation
        self.config = config
        self.source = Path(source)
        self.options = options
        self.nbytes = sum(b.nbytes for b in buckets)
        self.load_format: str | None = "flattened_bucket"
        """What the servers are told the tensor path's entries are: None for named tensors (`views`)."""
        self.last: dict[str, Any] = {}
        """The last publish: the gateway's answer, seconds, and per group what was sent (tests, benchmarks)."""

    @classmethod
    def gather(cls, model: nn.Module, source: str | Path, options: SyncOptions) -> SyncPayload:
        """Collective: the full state dict on rank 0, as the HF export writes it (tied `lm_head.weight` left out,
        in the checkpoint's dtype), cut into buckets."""
        live_tensor = options.live is not None and options.resolved_backend() == "tensor"
        state = (tensor_sync.plain_state(model) if live_tensor else None) or full_state_dict(model)
        config: Any = model.config
        buckets: list[Bucket] = []
        buffers = None
        if state:
            if getattr(config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)
            dtype = save_dtype(config)
            tensor = options.resolved_backend() == "tensor"
            live = options.live if tensor else None
            exposed = live is not None and exposable(state, dtype, options.device)
            state = state if exposed else {k: v.to(dtype) for k, v in state.items()}
            layout = plan_buckets(state, options.bucket_bytes)
            if exposed and live is not None:  # the weights as they are: no copy (the servers read the parameters)
                state = tensor_sync.share_in_one(model, state)
                buckets = [Bucket(names, [list(state[n].shape) for n in names], dtype, None, [state[n] for n in names])
                           for names in layout]
                payload = cls(buckets, config, source, options, live=live, generation=live.expose())
                payload.load_format = None
                return payload
            buffers = _buffers(layout, state, options.device if tensor else None, shared=tensor)
            with buffers.lock:  # waits for a catch-up sending the payload these buffers held
                buffers.generation += 1
                for names, flat in zip(layout, buffers.flats, strict=True):
                    if flat.device == state[names[0]].device:
                        torch.cat([state[n].reshape(-1) for n in names], out=flat)
                    else:  # the tensor path on a GPU: the CPU state dict copied into the device's buckets
                        offset = 0
                        for n in names:
                            k = state[n].numel()
                            flat[offset:offset + k].copy_(state[n].reshape(-1), non_blocking=True)
                            offset += k
                    buckets.append(Bucket(names, [list(state[n].shape) for n in names], flat.dtype, flat))
        return cls(buckets, config, source, options, buffers)

    def publish(self, client: GatewayClient, version: int, batch_ids: list[str], results: dict[str, str | int]) -> int:
        """Publish over process groups; on a 503 (no backend took them) write the HF folder and publish that."""
        try:
            return self._publish(client, version, batch_ids, results)
        finally:
            self._strand()  # first: a step waiting for `done` must see it
            if self.live is not None and not self._done:  # no server reads the weights any more: the step may go on
                self._done = True
                self.live.done()

    _done = False
    stranded = False
    """The tensor path: servers may still read these tensors (`WeightsStillRead`): they must never change."""

    def _strand(self) -> None:
        if self.stranded and self.live is not None:  # every later optimizer step raises
            self.live.strand("the gateway never said the servers stopped reading the published weights")
        if self.stranded and self.buffers is not None:
            self.buffers.stranded = True  # never written again: the next gathers get fresh buffers

    @contextmanager
    def reading(self) -> Iterator[bool]:
        """Held while a catch-up sends this payload again: yields whether its tensors still hold the version it was
        gathered at (a later gather into the same buffers, or an optimizer step on exposed weights, changed them)."""
        if self.live is not None:
            with self.live.hold(self.generation) as current:
                yield current
        elif self.buffers is None:
            yield False
        else:
            with self.buffers.lock:  # a gather into these buffers waits for the catch-up
                yield self.buffers.generation == self.generation

    def _publish(self, client: GatewayClient, version: int, batch_ids: list[str], results: dict[str, str | int]) -> int:
        try:
            published = self._publish_distributed(client, version, batch_ids, results)
            if self.options.catch_up is not None:
                self.options.catch_up.published(self, published)
            return published
        except GatewayHTTPError as e:
            if e.status != 503 or self.options.fallback_dir is None:
                raise
            log.warning("publish of version %d over process groups failed (%s): falling back to the disk path",
                        version, e.message)
        path = write_hf(self, self.options.fallback_dir / f"v{version:06d}")
        return client.publish(version, str(path), batch_ids, results)

    def catch_up(self, client: GatewayClient, version: int) -> dict[str, Any] | None:
        """Send this payload (the current version, `version`) again to the backends the gateway lists as lacking
        it; None when there were none, else the gateway's answer. Call it with the buffers' lock held and the
        generation checked (`CatchUp`)."""
        opts = self.options
        plan = client.sync_init(version, opts.address, opts.resolved_backend(), opts.timeout, catch_up=True,
                                host_id=host_id())
        if not plan["groups"]:
            return None
        try:
            return self._send(client, plan, version, [], {})
        finally:
            self._strand()

    def _publish_distributed(self, client: GatewayClient, version: int, batch_ids: list[str],
                             results: dict[str, str | int]) -> int:
        opts = self.options
        plan = client.sync_init(version, opts.address, opts.resolved_backend(), opts.timeout, host_id=host_id())
        answer = self._send(client, plan, version, batch_ids, results)
        return int(answer.get("version", version))

    def _send(self, client: GatewayClient, plan: dict[str, Any], version: int, batch_ids: list[str],
              results: dict[str, str | int]) -> dict[str, Any]:
        opts = self.options
        t0 = time.perf_counter()
        backend = opts.resolved_backend()
        groups = plan["groups"]
        if backend == "tensor":  # no group: each backend opens the buckets' memory itself
            try:
                answer = tensor_sync.sync_tensors(client, plan, version, self.buckets, batch_ids, results,
                                                  opts.timeout, self.load_format)
            except WeightsStillRead:
                self.stranded = True  # `publish` keeps the memory from ever changing under those reads
                raise
            self.last = {"answer": answer, "seconds": time.perf_counter() - t0, "groups": {}}
            return answer
        senders = [Sender(g, opts.address, free_port(), backend, opts.timeout, self.buckets).start() for g in groups]
        watcher = _Progress(senders, opts.on_bucket).start() if opts.on_bucket else None
        try:
            answer = client.sync(
                plan["sync_id"], version, {s.group["group_name"]: s.port for s in senders},
                [b.manifest() for b in self.buckets], batch_ids, results,
                timeout=opts.timeout * (2 + len(self.buckets)),
            )
        finally:
            for s in senders:  # each ends by itself: done, failed, or its collective timed out
                s.join(opts.timeout * (2 + len(self.buckets)))
            if watcher is not None:
                watcher.stop()
        self.last = {"answer": answer, "seconds": time.perf_counter() - t0,
                     "groups": {s.group["group_name"]: {"sent": s.sent, "error": s.error} for s in senders}}
        for s in senders:
            if s.error:
                log.warning("weight sync to backend %s: %s", s.group.get("backend_id"), s.error)
        return answer


class CatchUp:
    """Rank 0's watch for backends that lack the current version (added, restarted or failed mid-update since it
    was published): every `interval` seconds it asks the gateway (`GET /v1/weights/sync`, `awaiting_backends`) and
    sends them the last published payload, so they serve again within seconds instead of at the next publish. It
    never blocks training beyond one thing: a gather into the buffers it is sending from waits for that send."""

    def __init__(self, client: GatewayClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.caught_up = 0
        """Backends brought to the current version (tests, logs)."""
        self._last: tuple[SyncPayload, int] | None = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-catch-up", daemon=True)

    def start(self) -> CatchUp:
        self._thread.start()
        return self

    def published(self, payload: SyncPayload, version: int) -> None:
        with self._mutex:
            self._last = (payload, version)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as e:  # the gateway away or a send failed: the next round (or publish) tries again
                log.warning("weight catch-up: %s", e)

    def check(self) -> int:
        """One round: returns how many backends took the current version."""
        with self._mutex:
            last = self._last
        if last is None:
            return 0
        status = self.client.sync_status()
        payload, version = last
        if not status.get("awaiting_backends") or int(status.get("version", -1)) != version:
            return 0  # none waits, or a newer version is out: its own payload serves it
        with payload.reading() as current:
            if not current:
                return 0  # the tensors changed since (a later gather, a step): that version's publish reaches them
            try:
                answer = payload.catch_up(self.client, version)
            except GatewayHTTPError as e:
                if e.status == 409:  # a newer version was published meanwhile
                    return 0
                raise
        if answer is None:
            return 0
        took = len(answer.get("backends", []))
        self.caught_up += took
        log.info("weight catch-up: version %d sent; taken by %s, failed: %s", version, answer.get("backends"),
                 answer.get("failed_backends") or "none")
        return took


class _Progress:
    """Calls `on_bucket(k)` each time every live sender has sent k buckets (tests kill a server mid-update)."""

    def __init__(self, senders: list[Sender], on_bucket: Callable[[int], None] | None) -> None:
        self.senders, self.on_bucket = senders, on_bucket
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Progress:
        self._thread.start()
        return self

    def _run(self) -> None:
        seen = 0
        while not self._stop.wait(0.002):
            live = [s.sent for s in self.senders if s.error is None]
            done = min(live, default=0)
            while seen < done and self.on_bucket is not None:
                seen += 1
                self.on_bucket(seen)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def write_hf(payload: SyncPayload, dest: Path) -> Path:
    """The payload as an HF folder (what `checkpoint.export_hf` writes), for the disk fallback; rank 0 only."""
    dest = dest.resolve()
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for b in payload.buckets for k, v in b.tensors().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    payload.config.to_json_file(str(tmp / "config.json"))
    for name in TOKENIZER_FILES:
        if (payload.source / name).is_file():
            shutil.copyfile(payload.source / name, tmp / name)
    _fsync_tree(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    return dest
