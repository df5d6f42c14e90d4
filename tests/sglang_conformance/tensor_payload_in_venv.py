"""Runs in the SGLang venv (tests/sglang_conformance/sglang_venv.py): opens `/update_weights_from_tensor` payloads with
SGLang 0.5.23's own code and reports the tensors it gets. Reads a JSON request on stdin, writes a JSON report on
stdout. Only the standard library, torch and sglang's files.

Request: {"payloads": [{"load_format": "flattened_bucket" | null, "entries": [<one TP rank's entry>, ...]}, ...]}
Report:  {"tensors": {name: {"dtype", "shape", "sha256"}}, "metadata_class": "<module>.<name>" | null}

SGLang's code used as it is:
- `MultiprocessingSerializer.deserialize` and its `SafeUnpickler` (and `_safe_load_torch_storage`, which it names),
  from `sglang/srt/utils/common.py`. That module imports the whole GPU stack (triton, zmq, ...), which the venv
  has not, so these three definitions are taken from its source text (`ast`) and run with its imports: `io`,
  `pickle`, `torch`, `ForkingPickler`, and `pybase64` (a faster `base64` with the same `b64decode`).
- `FlattenedTensorMetadata` and `FlattenedTensorBucket` from `sglang/srt/weight_sync/tensor_bucket.py`, imported.
- What `ModelRunner`'s weight updater (`model_runner_components/weight_updater.py` `update_weights_from_tensor`)
  does next is restated here, a few lines: a flattened bucket's metadata converted field by field into
  `FlattenedTensorMetadata` and rebuilt with `FlattenedTensorBucket(...).reconstruct_tensors()`; named tensors each
  `.to(device)` (`_unwrap_tensor`; CPU here). Its `monkey_patch_torch_reductions` changes CUDA handles only.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import io
import json
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    pkg = types.ModuleType("sglang")  # its __init__ pulls in the whole server
    pkg.__path__ = [str(root)]
    sys.modules["sglang"] = pkg
    return root


def _serializer(root: Path) -> Any:
    """`MultiprocessingSerializer` with SGLang's `SafeUnpickler`, defined from its source."""
    source = (root / "srt" / "utils" / "common.py").read_text()
    wanted = {"_safe_load_torch_storage", "SafeUnpickler", "MultiprocessingSerializer"}
    nodes: list[ast.stmt] = [n for n in ast.parse(source).body
             if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in wanted]
    assert {getattr(n, "name", None) for n in nodes} == wanted, f"sglang's common.py no longer defines {wanted}"
    namespace: dict[str, Any] = {"io": io, "pickle": pickle, "torch": torch, "ForkingPickler": ForkingPickler,
                                 "pybase64": base64, "__name__": "sglang_common_excerpt"}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "sglang/srt/utils/common.py", "exec"), namespace)
    return namespace["MultiprocessingSerializer"]


def main() -> None:
    request = json.load(sys.stdin)
    root = _sglang_root()
    serializer = _serializer(root)
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    tensors: dict[str, Any] = {}
    metadata_class = None
    for payload in request["payloads"]:
        for entry in payload["entries"]:
            obj = serializer.deserialize(entry[0])  # TP rank 0 reads entry 0 (`deserialize_own_rank`)
            if payload["load_format"] == "flattened_bucket":
                metadata = obj["metadata"]
                metadata_class = f"{type(metadata[0]).__module__}.{type(metadata[0]).__name__}"
                converted = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                                     end_idx=m.end_idx, numel=m.numel) for m in metadata]
                pairs = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                              metadata=converted).reconstruct_tensors()
            elif payload["load_format"] is None:
                pairs = [(name, t.to("cpu")) for name, t in obj]
            else:
                raise ValueError(payload["load_format"])
            for name, t in pairs:
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                tensors[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                 "sha256": hashlib.sha256(data).hexdigest()}
            del obj, pairs  # the sender's memory unmapped, as the server does before it answers
    json.dump({"tensors": tensors, "metadata_class": metadata_class}, sys.stdout)


if __name__ == "__main__":
    main()
