"""The trainer's side of the tensor path (`--weight-sync tensor`): weights handed to servers on this machine
through SGLang's `POST /update_weights_from_tensor`, no bytes sent (docs/scaling.md "One device").

    rank 0, after a step:  SyncPayload.gather(model)       buckets in shared memory (CPU) or on the GPU
    publish thread:        POST /v1/weights/sync/init {backend: "tensor", host_id}    the gateway checks locality
                           per backend, bucket and TP rank: serialize the bucket (handles, not bytes)
                           POST /v1/weights/sync {buckets, tensors}   the gateway pauses, marks, begins, one
                           /update_weights_from_tensor per bucket on each backend, ends, continues, records

Each payload is SGLang 0.5.23's own format (rollway_common/tensor_payload.py), one entry per TP rank of the server
(each rank opens its own, so CUDA IPC reference counts stay right), in one of two shapes:

- **the weights themselves** (one trainer rank whose parameters are already what a server loads: on CPU, in the
  checkpoint's dtype): `load_format` unset, a list of `(name, tensor)` pairs whose tensors are the model's own
  parameters, moved into shared memory once, all into one file (`share_in_one`, in place). No gather copy: each
  server copies straight out of the trainer's memory. `LiveWeights` keeps the next optimizer step from changing
  them until every server has read them (the publish's paused begin/end session ends first): until the gateway
  answers, or, when that call fails, says the publish is over (`wait_sync_over`); never, when it does not say
  (`WeightsStillRead`).
- **buckets** (otherwise: several ranks, a dtype to cast to, a GPU): as SGLang's `Engine.update_weights_from_tensor`
  callers (verl, slime) build it for `load_format="flattened_bucket"`, `{"flattened_tensor": <the bucket's bytes,
  uint8>, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel), ...]}`
  (`srt/weight_sync/tensor_bucket.py`), the gathered weights copied into the publish's reused buffers (two sets, as
  for the process-group path), freed with the process.

A pickled tensor is a handle: a CUDA IPC handle on a GPU, and on CPU the name of a shared-memory file (torch's
`file_system` sharing strategy). The server reads nothing of it once it answered (`rollway engine` keeps the
parameters' one file mapped until its next update, which opens the same file: engine/tensor_sync.py `_KEPT`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rollway_common.sync_deadline import answer_timeout
from rollway_common.tensor_payload import FlattenedTensorMetadata, serialize, share_cpu_tensors
from trainer.client import GatewayClient, GatewayHTTPError

log = logging.getLogger("trainer")

__all__ = ["LiveWeights", "WeightsStillRead", "exposable", "host_id", "payloads", "plain_state", "serialize_bucket",
           "serialize_named", "share_cpu_tensors", "share_in_one", "sync_tensors", "wait_sync_over"]


def serialize_bucket(flat: torch.Tensor, names: list[str], shapes: list[list[int]]) -> str:
    """One TP rank's `/update_weights_from_tensor` entry for a bucket (one dtype, `flat` its tensors back to back),
    `load_format="flattened_bucket"`: SGLang's `MultiprocessingSerializer.serialize({...}, output_str=True)`."""
    raw = flat.reshape(-1).view(torch.uint8)
    itemsize = flat.element_size()
    metadata, offset = [], 0
    for name, shape in zip(names, shapes, strict=True):
        size = int(torch.Size(shape).numel()) * itemsize
        metadata.append(FlattenedTensorMetadata(name, torch.Size(shape), flat.dtype, offset, offset + size, size))
        offset += size
    if raw.device.type == "cpu":
        share_cpu_tensors()
        if not raw.is_shared():
            raw.share_memory_()
    return serialize({"flattened_tensor": raw, "metadata": metadata})


def serialize_named(names: list[str], tensors: list[torch.Tensor]) -> str:
    """One TP rank's entry for tensors handed as they are (`load_format` unset): a list of `(name, tensor)` pairs,
    each a handle to its own memory (the model's parameters themselves, `LiveWeights`). CPU tensors are moved into
    shared memory the first time (in place: the model's parameters then live there)."""
    pairs = []
    for name, t in zip(names, tensors, strict=True):
        if t.device.type == "cpu":
            share_cpu_tensors()
            if not t.is_shared():
                t.share_memory_()
        pairs.append((name, t.detach()))
    return serialize(pairs)


class WeightsStillRead(RuntimeError):
    """The gateway never said a tensor-path publish was over: servers may still be reading its memory."""


def wait_sync_over(client: GatewayClient, sync_id: str, limit: float, error: Exception) -> dict[str, Any]:
    """After the tensor path's `POST /v1/weights/sync` failed with `error` (timed out, connection dropped, a proxy's
    5xx), the gateway may still be driving the servers' reads of the trainer's memory: ask it (`GET
    /v1/weights/sync`) until that sync is no longer pending, which it is until every server's read has ended or
    been given up on (that server left "<v>-partial": docs/scaling.md "Ways to publish"). Returns the gateway's
    answer when it published; raises its error (or `error`) when it did not; WeightsStillRead when the gateway did
    not say within `limit` seconds."""
    t0 = time.monotonic()
    delay, last = 0.2, error
    if not isinstance(error, GatewayHTTPError) or error.status >= 500:
        log.warning("the publish's answer failed (%s): waiting for the gateway to say the servers stopped reading "
                    "the weights before they may change", error)
    while True:
        try:
            status = client.sync_status()
        except Exception as e:  # the gateway away for now: it may still be driving the reads
            last = e
        else:
            pending = status.get("sync")
            if not pending or pending.get("sync_id") != sync_id:  # over (a gateway that restarted drives nothing)
                finished = status.get("finished") or {}
                if finished.get("sync_id") == sync_id and isinstance(finished.get("answer"), dict):
                    return dict(finished["answer"])
                if finished.get("sync_id") == sync_id and isinstance(finished.get("error"), dict):
                    err = finished["error"]
                    raise GatewayHTTPError("POST", "/v1/weights/sync", int(err.get("status") or 500),
                                           {"error": {"message": err.get("message")}}) from error
                raise error
        if time.monotonic() - t0 > limit:
            raise WeightsStillRead(f"the gateway did not say within {limit:.0f} s that weight sync {sync_id} was over "
                                   f"(last: {last}); servers may still be reading the published weights, which are "
                                   "kept as they are") from error
        time.sleep(delay)
        delay = min(2.0, delay * 2)


def sync_tensors(client: GatewayClient, plan: dict[str, Any], version: int, buckets: list[Any], batch_ids: list[str],
                 results: dict[str, str | int], timeout_s: float, load_format: str | None) -> dict[str, Any]:
    """`POST /v1/weights/sync` with the buckets' handles (`payloads`); returns the gateway's answer only once no
    server can still be reading them: the gateway answers after every server's read ended or was given up on, and
    is waited for longer than its deadline; if the call fails anyway, `wait_sync_over` asks it."""
    if any(b.is_cuda for b in buckets):
        torch.cuda.synchronize()  # the gather's copies are done before another process reads them
    limit = answer_timeout(timeout_s, len(buckets))
    try:
        return client.sync(plan["sync_id"], version, {}, [b.manifest() for b in buckets], batch_ids, results,
                           timeout=limit, tensors=payloads(buckets, plan["groups"]), load_format=load_format)
    except Exception as e:  # timed out, connection dropped, a proxy's 5xx: the servers may still be reading
        return wait_sync_over(client, str(plan["sync_id"]), limit + 60.0, e)


@cache
def host_id() -> str:
    """This machine's kernel boot id (the gateway compares it with its own); empty where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def payloads(buckets: list[Any], groups: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """Per group (backend): per bucket, one entry per TP rank (the group's world size less the trainer). A bucket with
    `views` (the model's own tensors, `LiveWeights`) is sent as named tensors, else as a flattened bucket."""
    def entry(b: Any) -> str:
        return serialize_named(b.names, b.views) if b.views is not None else serialize_bucket(b.flat, b.names, b.shapes)

    return {str(g["group_name"]): [[entry(b) for _ in range(max(1, int(g["world_size"]) - 1))] for b in buckets]
            for g in groups}


def exposable(state: dict[str, torch.Tensor], dtype: torch.dtype, device: str | None) -> bool:
    """Whether the state dict's tensors can be handed to the servers as they are: one trainer rank (so they are the
    model's own parameters, not a gathered copy), on CPU (`device` None: shared memory), already in the dtype the
    servers load, dense plain tensors."""
    if device is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
               and t.layout == torch.strided for t in state.values())


_WRAPPED = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "_fsdp_module")


def plain_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's state dict as `full_state_dict` gives it, when one trainer rank holds a plain module (no FSDP, no
    wrapper whose prefix that would strip): `model.state_dict()` itself, detached views of the parameters, ~1 ms
    against its ~20-40 ms for a 100M model. None otherwise (`full_state_dict` then decides)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None
    state = model.state_dict()
    if any(type(t) is not torch.Tensor for t in state.values()) or any(w in k for k in state for w in _WRAPPED):
        return None
    return state


def share_in_one(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exposed weights (`exposable`) moved into shared memory, once: all of them into one shared-memory buffer,
    each parameter (or buffer) of `model` that `state` names rebound to its slice (`.data`, in place, as
    `share_memory_()` moves one tensor). A server then opens one file, not one per tensor (each open and mapping cost
    ~0.15 ms: ~20 ms for a 147-tensor model, every publish, on each server). Returns the state dict over the new
    memory. Left to the per-tensor way (`serialize_named`) when a tensor of the state is not exactly one of the
    model's own (a slice of another, or one whose memory other tensors of the model share in another shape)."""
    if not state or all(t.is_shared() for t in state.values()):
        return state
    owners: dict[str, torch.Tensor] = {}
    for name in state:
        try:
            owners[name] = model.get_parameter(name)
        except AttributeError:
            try:
                owners[name] = model.get_buffer(name)
            except AttributeError:
                return state
    same = {n: o for n, o in owners.items() if o.data_ptr() == state[n].data_ptr() and o.shape == state[n].shape}
    whole = {n: o for n, o in same.items() if o.is_contiguous() and o.storage_offset() == 0
             and o.untyped_storage().nbytes() == o.numel() * o.element_size()}
    if len(whole) != len(state):
        return state
    by_memory: dict[int, list[torch.Tensor]] = {}
    for _, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        by_memory.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    unique = list({o.untyped_storage().data_ptr(): o for o in whole.values()}.values())  # tied: one slice
    if len({o.dtype for o in unique}) != 1:
        return state  # one buffer holds one dtype: copying another into it would cast the model's tensor
    if any(t is not o and (t.shape != o.shape or t.storage_offset() != 0)
           for o in unique for t in by_memory.get(o.untyped_storage().data_ptr(), [])):
        return state  # a model tensor that views another one's memory differently: not rebound safely
    share_cpu_tensors()
    flat = torch.empty(sum(o.numel() for o in unique), dtype=unique[0].dtype)
    flat.share_memory_()
    offset = 0
    with torch.no_grad():
        for o in unique:
            view = flat[offset:offset + o.numel()].view(o.shape)
            view.copy_(o)
            for t in by_memory.get(o.untyped_storage().data_ptr(), [o]):
                t.data = view  # every tensor of the model on that memory (a tied weight is one object, or several)
            offset += o.numel()
    return {n: whole[n].detach() for n in state}


class LiveWeights:
    """The model's parameters handed to the servers as they are, without a gather copy (one trainer rank, the
    tensor path): the servers copy straight out of the trainer's memory. They must do so before the optimizer
    changes it, so the optimizer's step waits (`before_step`, a step pre-hook) until every reader is done: the
    publish of the last gather (counted from `expose`, on the training thread, so no step can slip in before the
    publish thread starts) and any catch-up (`hold`). Each step bumps `generation`: a catch-up of a payload
    gathered before it sends nothing (the weights are no longer that version; the next publish reaches those
    servers), as with the reused buffers of the copying path.

    The forward and backward of the next step still overlap the publish; only the optimizer step waits."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        """How long a step waits for the readers before it raises; None: as long as they take (each publish and
        catch-up ends within its own HTTP limits), saying so every minute."""
        self.generation = 0
        self.readers = 0
        self.exposed = 0
        """Gathers that handed the weights out."""
        self.waited_s = 0.0
        """The optimizer steps' total wait for readers (tests, benchmarks)."""
        self.stranded: str | None = None
        """Why servers may still be reading the weights with nobody to say when they stop (`WeightsStillRead`): no
        optimizer step may change them any more."""
        self._cond = threading.Condition()

    def expose(self) -> int:
        """A gather handing out the weights: one reader (its publish, which calls `done`). Returns the generation."""
        with self._cond:
            if not self.exposed:
                log.info("--weight-sync tensor: the parameters are handed to the servers as they are (one rank, "
                         "no gather copy); each optimizer step waits until the servers have read them")
            self.exposed += 1
            self.readers += 1
            return self.generation

    def done(self) -> None:
        with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    def strand(self, reason: str) -> None:
        """A publish whose end nobody confirmed (`WeightsStillRead`): its reader never leaves, every later step
        raises instead of changing the weights under a server's read."""
        with self._cond:
            self.stranded = reason
            self._cond.notify_all()

    @contextmanager
    def hold(self, generation: int) -> Iterator[bool]:
        """A catch-up reading the weights of `generation`: yields False (and holds nothing) when a step changed them
        since."""
        with self._cond:
            current = generation == self.generation
            if current:
                self.readers += 1
        try:
            yield current
        finally:
            if current:
                self.done()

    def before_step(self, *args: Any) -> None:
        """`optimizer.register_step_pre_hook(live.before_step)`: wait for the readers, then the weights change."""
        t0 = time.perf_counter()
        with self._cond:
            while not self._cond.wait_for(lambda: self.readers == 0 or self.stranded is not None,
                                          60.0 if self.timeout is None else self.timeout):
                if self.timeout is not None:
                    raise RuntimeError(f"the servers did not finish reading the published weights in "
                                       f"{self.timeout:.0f} s (--weight-sync tensor); the optimizer step would change "
                                       "them under the reads")
                log.warning("the optimizer step waits for the servers to finish reading the published weights "
                            "(%.0f s so far)", time.perf_counter() - t0)
            if self.stranded is not None:
                raise WeightsStillRead(f"the optimizer step would change weights servers may still be reading: "
                                       f"{self.stranded}")
            self.generation += 1
        self.waited_s += time.perf_counter() - t0
