"""Weights over a torch process group, as SGLang takes them (docs/sglang-contract.md "The process-group path"):
`POST /init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`, on gloo.

Why: a publish through `/update_weights_from_disk` needs a filesystem the trainer and every server share; here
the trainer (rank 0) broadcasts the tensors and this engine (rank `rank_offset`) receives them, one HTTP call per
bucket while the trainer broadcasts that bucket. Received tensors are copied into the served model in place, on
the model thread between two steps; the weight version changes only when a call that names one succeeds (the
gateway names it on the last bucket), so a server interrupted mid-update keeps reporting its old version while
its weights are a mix: as in SGLang, such a server must be discarded or loaded again, never served as is.

Every collective has a timeout (the group's, `ROLLWAY_WEIGHT_SYNC_TIMEOUT` seconds, default 120): a trainer that
never broadcasts fails the call instead of hanging it. The engine speaks gloo only (`backend: "nccl"` is refused).
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollway_common.process_group import init_custom_process_group

log = logging.getLogger(__name__)
DEFAULT_GROUP = "weight_update_group"


def timeout_s() -> float:
    return float(os.environ.get("ROLLWAY_WEIGHT_SYNC_TIMEOUT", "120"))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def bucket_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each tensor in a flattened bucket, as SGLang 0.5.23 lays one out
    (`srt/weight_sync/tensor_bucket.py` `FlattenedTensorBucket.empty`): the tensors' bytes back to back, in order,
    each starting at a multiple of its dtype's size (a bucket that breaks that is refused, as SGLang refuses it)."""
    out, offset = [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        size = torch.Size(shape).numel() * dtype.itemsize
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {i}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {i}: byte offset {offset}, dtype {dtype}")
        out.append((offset, offset + size))
        offset += size
    return out


def receive(pg: dist.ProcessGroup, dtypes: list[torch.dtype], shapes: list[list[int]], flattened: bool) -> list[torch.Tensor]:
    """Receive one bucket from rank 0: with `flattened_bucket`, one broadcast of a `uint8` buffer holding the
    tensors' bytes (SGLang's `_receive_bucketed_weights_from_distributed`), each tensor a view of its bytes; else
    one broadcast per tensor, in order. Blocks (call it off the event loop) until done or the group's timeout."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if not flattened:
        tensors = [torch.empty(s, dtype=d) for d, s in zip(dtypes, shapes, strict=True)]
        for t in tensors:
            pg.broadcast([t], opts).wait()
        return tensors
    layout = bucket_layout(dtypes, shapes)
    flat = _buffer(layout[-1][1] if layout else 0)
    pg.broadcast([flat], opts).wait()
    return [flat[a:b].view(d).reshape(s) for (a, b), s, d in zip(layout, shapes, dtypes, strict=True)]


_BUFFER: list[torch.Tensor] = []


def _buffer(nbytes: int) -> torch.Tensor:
    """One receive buffer of `nbytes` bytes, kept between calls (buckets are loaded one at a time): fresh memory
    would cost its page faults on every bucket of every publish."""
    if not _BUFFER or _BUFFER[0].numel() < nbytes:
        _BUFFER[:] = [torch.empty(nbytes, dtype=torch.uint8)]
    return _BUFFER[0][:nbytes]


class WeightSync:
    """The groups this engine has joined, by name, and the calls on them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._lock = asyncio.Lock()  # one update at a time: buckets must be received in the order sent
        self.session_open = False
        """SGLang 0.5.21+'s weight-update session (srt/managers/scheduler_components/weight_updater.py
        `begin_weight_update`, `end_weight_update`): an update outside one is refused, when the engine demands it
        (`engine.weight_update_session`, else it serves as SGLang before 0.5.21, without the routes)."""

    def begin(self) -> tuple[bool, str]:
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    async def init_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        name = str(body.get("group_name") or DEFAULT_GROUP)
        backend = str(body.get("backend") or "nccl")
        if backend != "gloo":
            return False, f"the CPU engine joins gloo groups only, not {backend!r}"
        if name in self.groups:
            return False, f"group {name!r} already exists: destroy it first"
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            pg = await asyncio.to_thread(init_custom_process_group, "gloo", f"tcp://{address}:{port}", world, rank,
                                         name, timedelta(seconds=timeout_s()))
        except Exception as e:  # refused, timed out, bad body: the caller retries with a new group
            return False, f"Failed to initialize custom process group: {type(e).__name__}: {e}."
        self.groups[name] = pg
        return True, "Succeeded to initialize custom process group."

    async def destroy_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        pg = self.groups.pop(str(body.get("group_name") or DEFAULT_GROUP), None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        await asyncio.to_thread(dist.destroy_process_group, pg)
        return True, "Succeeded to destroy custom process group."

    async def update(self, body: dict[str, Any]) -> tuple[bool, str]:
        name = str(body.get("group_name") or DEFAULT_GROUP)
        pg = self.groups.get(name)
        if pg is None:
            return False, f"Group {name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first."
        try:
            names, shapes = [str(n) for n in body["names"]], [[int(x) for x in s] for s in body["shapes"]]
            dtypes = [_dtype(d) for d in body["dtypes"]]
            if not (len(names) == len(dtypes) == len(shapes)) or not names:
                raise ValueError("names, dtypes and shapes must be non-empty lists of one length")
            load_format = body.get("load_format")
            if load_format not in (None, "flattened_bucket"):
                raise ValueError(f"unknown load_format {load_format!r}")
        except (KeyError, TypeError, ValueError) as e:
            return False, f"Bad request: {e}"
        if getattr(self.engine, "weight_update_session", False) and not self.session_open:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        scheduler = self.engine.scheduler
        async with self._lock:
            try:
                if body.get("abort_all_requests"):
                    await asyncio.wrap_future(scheduler.abort(None))
                with self.engine.liveness.loads():  # /health waits while weights load, as SGLang's does
                    tensors = await asyncio.to_thread(receive, pg, dtypes, shapes, load_format == "flattened_bucket")
                    await asyncio.wrap_future(scheduler.call(lambda: _load(scheduler.model, names, tensors)))
            except Exception as e:  # timed out, peer gone, unknown name: the model may hold a mix now
                log.error("update from group %s failed: %s", name, e)
                return False, (f"Failed to update parameter online: {type(e).__name__}: {e}. The full weights of the "
                               "ModelRunner are partially updated. Please discard the whole weights.")
            version = body.get("weight_version")
            if version is not None:  # the last bucket: rows in flight (an unpaused server) are prefilled again
                await asyncio.wrap_future(scheduler.swap_model(scheduler.model, str(version), False))
        return True, "Succeeded to update parameter online."


def _load(model: torch.nn.Module, names: list[str], tensors: list[torch.Tensor]) -> None:
    """Copy into the served parameters by HF name (a tied `lm_head.weight` is the embedding's tensor)."""
    targets = model.state_dict(keep_vars=True)
    missing = [n for n in names if n not in targets]
    if missing:
        raise KeyError(f"the model has no parameter {missing[:3]}")
    with torch.no_grad():
        for n, t in zip(names, tensors, strict=True):
            if targets[n].shape != t.shape:
                raise ValueError(f"{n}: shape {list(t.shape)} != the model's {list(targets[n].shape)}")
            targets[n].copy_(t)


def add_routes(app: FastAPI, engine: Any, json_body: Any) -> WeightSync:
    sync = WeightSync(engine)

    def answer(result: tuple[bool, str]) -> JSONResponse:
        return JSONResponse({"success": result[0], "message": result[1]}, 200 if result[0] else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        return answer(await sync.init_group(await json_body(request)))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        return answer(await sync.update(await json_body(request)))

    if getattr(engine, "weight_update_session", False):
        @app.post("/begin_weight_update")
        async def begin_weight_update(request: Request) -> JSONResponse:
            await json_body(request)  # {"selector": "target"|"draft"|"all"}: one model here
            return answer(sync.begin())

        @app.post("/end_weight_update")
        async def end_weight_update(request: Request) -> JSONResponse:
            await json_body(request)
            return answer(sync.end())

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        return answer(await sync.destroy_group(await json_body(request)))

    return sync
