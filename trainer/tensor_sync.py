"""The trainer's side of the tensor path (`--weight-sync tensor`): weights handed to servers on this machine
through SGLang's `POST /update_weights_from_tensor`, no bytes sent (docs/scaling.md "One device").

    rank 0, after a step:  SyncPayload.gather(model)       buckets in shared memory (CPU) or on the GPU
    publish thread:        POST /v1/weights/sync/init {backend: "tensor", host_id}    the gateway checks locality
                           per backend, bucket and TP rank: serialize the bucket (handles, not bytes)
                           POST /v1/weights/sync {buckets, tensors}   the gateway pauses, marks, begins, one
                           /update_weights_from_tensor per bucket on each backend, ends, continues, records

Each payload is SGLang 0.5.23's own format, as its `Engine.update_weights_from_tensor` callers (verl, slime) build
it for `load_format="flattened_bucket"`: base64 of a `ForkingPickler` dump of
`{"flattened_tensor": <the bucket's bytes, uint8>, "metadata": [FlattenedTensorMetadata(name, shape, dtype,
start_idx, end_idx, numel), ...]}` (`srt/weight_sync/tensor_bucket.py`), one entry per TP rank of the server (each
rank opens its own, so CUDA IPC reference counts stay right). A pickled tensor is a handle: a CUDA IPC handle on a
GPU, and on CPU the name of a shared-memory file (torch's `file_system` sharing strategy; the default
`file_descriptor` one passes descriptors over a socket, which a server reading HTTP cannot receive). The server
drops its mapping before it answers; the trainer's buckets are the publish's reused buffers (two sets, as for the
process-group path), freed with the process.

sglang need not be installed: the metadata class is written under SGLang's name
(`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`), which SGLang's `SafeUnpickler` allows.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from functools import cache
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """Pickled as SGLang's class of this name (the same fields, in its order)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_PyPickler: Any = pickle._Pickler


class _Pickler(_PyPickler):
    """ForkingPickler's reductions (tensors and storages as handles), with `FlattenedTensorMetadata` written under
    SGLang's module name (the pure-Python pickler, whose `save_global` can be told so)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=4)
        table = ForkingPickler._copyreg_dispatch_table.copy()  # type: ignore[attr-defined]
        table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
        self.dispatch_table = table

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:
            module, qualname = SGLANG_METADATA
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def share_cpu_tensors() -> None:
    """CPU tensors pickle as shared-memory file names (see the module docstring); process-wide."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def serialize_bucket(flat: torch.Tensor, names: list[str], shapes: list[list[int]]) -> str:
    """One TP rank's `/update_weights_from_tensor` entry for a bucket (one dtype, `flat` its tensors back to back):
    SGLang's `MultiprocessingSerializer.serialize({...}, output_str=True)`."""
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
    buf = io.BytesIO()
    _Pickler(buf).dump({"flattened_tensor": raw, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")


@cache
def host_id() -> str:
    """This machine's kernel boot id (the gateway compares it with its own); empty where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def payloads(buckets: list[Any], groups: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """Per group (backend): per bucket, one entry per TP rank (the group's world size less the trainer)."""
    return {str(g["group_name"]): [[serialize_bucket(b.flat, b.names, b.shapes)
                                    for _ in range(max(1, int(g["world_size"]) - 1))] for b in buckets]
            for g in groups}
