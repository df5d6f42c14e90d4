"""SGLang 0.5.23's `/update_weights_from_tensor` payload, both ends: what its `MultiprocessingSerializer` writes
(`srt/utils/common.py`: base64 of a `ForkingPickler` dump) and reads (its `SafeUnpickler`: tensor, storage and dtype
rebuilders and a few of SGLang's data classes, nothing else). The trainer writes it (trainer/tensor_sync.py), the
CPU engine reads it (engine/tensor_sync.py); tests/sglang_conformance/test_tensor_payload.py has SGLang's own code
read what the trainer writes.

Two shapes of payload, as SGLang's model runner takes them (`update_weights_from_tensor`):

- `load_format="flattened_bucket"`: `{"flattened_tensor": <uint8 tensor>, "metadata": [FlattenedTensorMetadata,
  ...]}` (`srt/weight_sync/tensor_bucket.py`), rebuilt as views of the one buffer;
- `load_format` unset (None): a list of `(name, tensor)` pairs, handed to the model's `load_weights` as they are.

A pickled tensor is a handle, not bytes: a CUDA IPC handle on a GPU, on CPU the name of a shared-memory file
(torch's `file_system` sharing strategy), so only a process on the same machine can open it.

This module imports torch: the gateway, which is torch-free, never imports it (tests/test_import_graph.py).
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """SGLang's `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`: the same fields in its order,
    pickled under its name and unpickled into this class (sglang need not be installed)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """SGLang's `LocalSerializedTensor`: one serialized tensor per TP rank (`values[rank]`)."""

    values: list[bytes]


def share_cpu_tensors() -> None:
    """CPU tensors pickle as shared-memory file names; process-wide. The default `file_descriptor` strategy passes
    descriptors over a socket, which a server reading HTTP cannot receive."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


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


def serialize(obj: Any) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`. CPU tensors in `obj` must already be in
    shared memory (`share_memory_()` after `share_cpu_tensors()`): pickling one that is not would move it there, a
    copy, every time for a fresh tensor."""
    buf = io.BytesIO()
    if isinstance(obj, dict) and "metadata" in obj:  # SGLang's metadata class, under its own name
        _Pickler(buf).dump(obj)
    else:  # named tensors: ForkingPickler itself (the C pickler, ~5x faster over a model's ~150 tensors)
        ForkingPickler(buf, 4).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_TORCH_REBUILDERS = {
    ("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                                  "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage",
                                  "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_cpu_tensor")
} | {
    ("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_meta_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd",
        "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")
} | {
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"), ("torch", "Tensor"), ("torch", "Size"),
    ("torch", "device"), ("torch.nn.parameter", "Parameter"), ("collections", "OrderedDict"),
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"), ("copyreg", "__newobj__"),
    ("copyreg", "_reconstructor"), ("builtins", "object"),
}
_SGLANG_CLASSES: dict[tuple[str, str], type] = {
    SGLANG_METADATA: FlattenedTensorMetadata,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SGLANG_CLASSES:
            return _SGLANG_CLASSES[(module, name)]
        if (module, name) in _TORCH_REBUILDERS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("torch", "torch.cuda") and name.endswith("Storage"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked global {module}.{name} in a serialized tensor payload")


def deserialize(data: str | bytes) -> Any:
    """SGLang's `MultiprocessingSerializer.deserialize`: base64 text (HTTP) or raw bytes."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    return _Unpickler(io.BytesIO(raw)).load()
