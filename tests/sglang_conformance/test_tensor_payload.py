"""The tensor path's payloads (`--weight-sync tensor`) read by SGLang 0.5.23's own code: what the trainer builds
(`SyncPayload.gather` + `tensor_sync.payloads`, as `rollway train` sends them) is opened in the SGLang venv
(`sglang_venv.py`) by `tensor_payload_in_venv.py`, another process, as a server would: SGLang's
`MultiprocessingSerializer.deserialize` with its `SafeUnpickler`, and its `FlattenedTensorBucket` for the flattened
buckets. Each tensor it gets must be the trainer's, byte for byte, with the same dtype and shape.

Three payloads: the parameters themselves as named tensors (`load_format` unset; one CPU rank, `LiveWeights`),
float32 flattened buckets (the copying path), and bfloat16 flattened buckets (a cast to the checkpoint's dtype).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.sglang_conformance.sglang_venv import ensure_venv
from trainer.tensor_sync import LiveWeights, payloads
from trainer.weight_sync import SyncOptions, SyncPayload

pytestmark = pytest.mark.slow
GROUPS = [{"group_name": "g0", "world_size": 2, "backend_id": "b0"}]  # one server of one TP rank


def _expected(payload: SyncPayload) -> dict[str, dict[str, Any]]:
    out = {}
    for b in payload.buckets:
        for name, t in b.tensors().items():
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                         "sha256": hashlib.sha256(data).hexdigest()}
    return out


def _sglang_reads(payload: SyncPayload) -> dict[str, Any]:
    request = {"payloads": [{"load_format": payload.load_format, "entries": payloads(payload.buckets, GROUPS)["g0"]}]}
    r = subprocess.run([str(ensure_venv()), str(Path(__file__).with_name("tensor_payload_in_venv.py"))],
                       input=json.dumps(request), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(json.loads(r.stdout))


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    m = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # "trained": not the values on disk
    return m


def test_sglang_reads_the_parameters_handed_out_as_named_tensors(model: Any, tiny_model_dir: Path) -> None:
    live = LiveWeights()
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="tensor", bucket_bytes=60_000, live=live))
    assert payload.live is live and payload.load_format is None and len(payload.buckets) > 1
    report = _sglang_reads(payload)
    assert report["tensors"] == _expected(payload)
    assert report["metadata_class"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sglang_reads_the_flattened_buckets(model: Any, tiny_model_dir: Path, dtype: torch.dtype) -> None:
    model.config.dtype = dtype
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="tensor", bucket_bytes=60_000))
    assert payload.load_format == "flattened_bucket" and len(payload.buckets) > 1
    report = _sglang_reads(payload)
    want = _expected(payload)
    assert report["tensors"] == want and {v["dtype"] for v in want.values()} == {str(dtype).removeprefix("torch.")}
    assert report["metadata_class"] == "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"
