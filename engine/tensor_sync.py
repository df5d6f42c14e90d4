"""Weights handed over in memory, as SGLang takes them (docs/sglang-contract.md "The tensor path"):
`POST /update_weights_from_tensor` with SGLang 0.5.23's body (`srt/managers/io_struct.py`
`UpdateWeightsFromTensorReqInput`):

    {"serialized_named_tensors": [<base64 of a ForkingPickler dump>, ... one per TP rank],
     "load_format": null | "direct" | "flattened_bucket", "flush_cache": true, "abort_all_requests": false,
     "weight_version": null | "<v>", "selector": "all", "torch_empty_cache": false}

Each entry is what SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` writes: with
`flattened_bucket`, obj is `{"flattened_tensor": <uint8 tensor>, "metadata": [FlattenedTensorMetadata, ...]}`
(`srt/weight_sync/tensor_bucket.py`), else a list of `(name, tensor)` pairs. The tensors are not in the body: a
pickled tensor is a handle to the sender's memory (CUDA IPC on a GPU; on CPU a shared-memory file under torch's
`file_system` sharing strategy), so only a process on the same machine can open it. This engine is one TP rank: it
reads entry 0 (as SGLang's rank r reads entry r) and copies the tensors into the served model; it reads nothing of
the sender's memory once the call answers, so the sender may change, free or reuse it then. A flattened bucket's
mapping is dropped before the answer; named tensors' (the trainer's parameters, the same memory every publish) stays
mapped until the next update, which finds it mapped (`_KEPT`).

The payload is unpickled as SGLang's `SafeUnpickler` does it (rollway_common/tensor_payload.py): only tensor, storage
and dtype rebuilders and SGLang's two metadata classes are allowed; anything else is refused (a pickle is code
otherwise).
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import pickle
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.weight_sync import WeightSync, _load
from rollway_common.tensor_payload import FlattenedTensorMetadata, LocalSerializedTensor, deserialize

log = logging.getLogger(__name__)

LOAD_FORMATS = (None, "direct", "flattened_bucket")


def named_tensors(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one rank's payload, as SGLang's model runner rebuilds them."""
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
            raise ValueError("a flattened_bucket payload is {flattened_tensor, metadata}")
        flat, metadata = payload["flattened_tensor"], payload["metadata"]
        if not isinstance(flat, torch.Tensor):
            raise ValueError("flattened_tensor is not a tensor")
        flat = flat.reshape(-1).view(torch.uint8) if flat.dtype != torch.uint8 else flat.reshape(-1)
        out = []
        for m in metadata:
            if not isinstance(m, FlattenedTensorMetadata):
                raise ValueError(f"metadata entries are FlattenedTensorMetadata, not {type(m).__name__}")
            if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
                raise ValueError(f"{m.name}: bytes {m.start_idx}:{m.end_idx} outside the bucket of {flat.numel()}")
            out.append((str(m.name), flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
        return out
    if not isinstance(payload, list | tuple):
        raise ValueError("a payload without load_format is a list of (name, tensor) pairs")
    out = []
    for item in payload:
        name, tensor = item
        if isinstance(tensor, LocalSerializedTensor):
            tensor = deserialize(tensor.values[0])
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: not a tensor")
        out.append((str(name), tensor))
    return out


_KEPT: list[torch.UntypedStorage] = []
"""The shared memory the last named-tensor update opened (the trainer's parameters, `load_format` unset), kept
mapped, never read outside an update call: the next update opens the same files (the trainer's parameters stay where
they are), and torch finds them mapped (`torch.multiprocessing.reductions.shared_cache`), so the copy reads pages
already in this process's page tables. Mapping 400 MB afresh and unmapping it cost ~70 ms a publish on each server
(page faults while copying, then the unmap), as the process-group path's kept receive buffer saves its page faults.
Replaced by the next such update's (at most one update's memory stays mapped); dropped by a flattened-bucket update
(the copied path's buffers alternate: nothing to find again) and by a failed one."""


def load_serialized(model: torch.nn.Module, entry: str | bytes, load_format: str | None) -> int:
    """Open one rank's payload, copy its tensors into `model` by HF name; returns the bytes read. On the model
    thread. A flattened bucket's mapping is dropped before the call answers; the memory of named tensors stays
    mapped until the next update (`_KEPT`)."""
    pairs = named_tensors(deserialize(entry), load_format)
    try:
        _load(model, [n for n, _ in pairs], [t for _, t in pairs])
        if load_format is None:
            _KEPT[:] = list({t.untyped_storage().data_ptr(): t.untyped_storage() for _, t in pairs}.values())
        else:
            _KEPT.clear()
        return sum(t.numel() * t.element_size() for _, t in pairs)
    except BaseException:
        _KEPT.clear()
        raise
    finally:
        del pairs  # no reference but `_KEPT`'s once this call answers


async def update_from_tensor(sync: WeightSync, body: dict[str, Any]) -> tuple[bool, str]:
    engine = sync.engine
    try:
        entries = body["serialized_named_tensors"]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
            raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")
        load_format = body.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {load_format!r}")
    except (KeyError, TypeError, ValueError) as e:
        return False, f"Bad request: {e}"
    if getattr(engine, "weight_update_session", False) and not sync.session_open:
        return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    scheduler = engine.scheduler
    async with sync._lock:
        try:
            if body.get("abort_all_requests"):
                await asyncio.wrap_future(scheduler.abort(None))
            with engine.liveness.loads():
                await asyncio.wrap_future(scheduler.call(
                    lambda: load_serialized(scheduler.model, entries[0], load_format)))
        except (binascii.Error, pickle.UnpicklingError, ValueError, KeyError, RuntimeError, OSError, EOFError,
                TypeError, AttributeError) as e:  # a payload from another machine fails to open its handles here
            log.error("update from tensor failed: %s", e)
            return False, (f"Failed to update weights from tensor: {type(e).__name__}: {e}. A tensor payload opens "
                           "only on the machine that made it (shared memory or CUDA IPC handles).")
        version = body.get("weight_version")
        if version is not None:  # the last bucket: rows in flight (an unpaused server) are prefilled again
            await asyncio.wrap_future(scheduler.swap_model(scheduler.model, str(version), False))
    return True, "Success"


def add_tensor_routes(app: FastAPI, sync: WeightSync, json_body: Any) -> None:
    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        ok, message = await update_from_tensor(sync, await json_body(request))
        return JSONResponse({"success": ok, "message": message}, 200 if ok else 400)
