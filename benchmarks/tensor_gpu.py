"""The tensor path on one GPU: the trainer and a `rollway engine` server on the same device, the weights handed over
as CUDA IPC handles (`POST /update_weights_from_tensor`, SGLang's body), checked and timed.

    python benchmarks/tensor_gpu.py                     # 100M Qwen2, median of 5 after a warm-up
    python benchmarks/tensor_gpu.py --size tiny --reps 1   # without CUDA: the same on CPU (shared memory)

The server is the engine's own app (`engine.server.create_app`) in a process of its own, its served model moved to
the device (the CPU engine generates on CPU only; a weight update only copies into the model's tensors, which works
wherever they are). The trainer's side is the publish code of `--weight-sync tensor`: `SyncPayload.gather` into
buckets on the device (`SyncOptions(backend="tensor", device="cuda")`), `tensor_sync.payloads` (one serialized
entry per bucket), then the calls the gateway makes on each server: `/update_weight_version` "<v>-partial",
`/begin_weight_update`, one `/update_weights_from_tensor` per bucket (the version on the last),
`/end_weight_update`. After the last publish every served tensor is compared with the trainer's, bit for bit
(sha256 of its bytes in the published dtype). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def digest(t: torch.Tensor, dtype: torch.dtype) -> str:
    return hashlib.sha256(t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def serve(model_dir: str, port: int, device: str) -> None:
    """The server process: the engine's app, its model on `device`, plus `/digest` for the check."""
    import uvicorn

    from engine.server import create_app

    app = create_app(model_dir, max_batch_size=1)
    engine = app.state.engine
    engine.scheduler.model.to(device)

    @app.get("/digest")
    async def weights_digest(dtype: str = "float32") -> dict[str, Any]:
        want = getattr(torch, dtype)
        state = engine.scheduler.model.state_dict()
        return {"device": str(next(engine.scheduler.model.parameters()).device),
                "tensors": {k: digest(v, want) for k, v in state.items()}}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=600)
    out = r.json()
    assert r.status_code == 200 and out.get("success", True), (path, r.status_code, r.text[:500])
    return dict(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", choices=["tiny", "100m"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--serve", nargs=3, metavar=("MODEL", "PORT", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), args.serve[2])
        return
    from benchmarks.trainer import make_model
    from engine.tiny_model import create_tiny_model
    from rollway import paths
    from rollway.embedded import free_port
    from trainer.checkpoint import save_dtype
    from trainer.tensor_sync import payloads
    from trainer.weight_sync import SyncOptions, SyncPayload

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    work = Path(tempfile.mkdtemp(prefix="rollway-tensor-gpu-"))
    server = None
    try:
        tok = create_tiny_model(work / "tok", seed=0)
        source = work / "model"
        n_params = make_model(args.size, source)
        for name in paths.TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copyfile(tok / name, source / name)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(source), str(port), device])
        deadline = time.monotonic() + 600  # not /health: it generates, and this server's model is on the device
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                httpx.get(url + "/get_weight_version", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(device)
        opts = SyncOptions(backend="tensor", device=device if cuda else None,
                           bucket_bytes=max(1, int(args.bucket_mb * (1 << 20))), timeout=300)
        runs: list[dict[str, float]] = []
        payload = None
        for rep in range(-1, args.reps):
            version = rep + 2
            with torch.no_grad():  # "a step": new values everywhere
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            payload = SyncPayload.gather(model, source, opts)
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            entries = payloads(payload.buckets, [{"group_name": "g", "world_size": 2}])["g"]
            t2 = time.perf_counter()
            post(url, "/update_weight_version", {"new_version": f"{version}-partial", "abort_all_requests": False})
            post(url, "/begin_weight_update", {})
            for i, per_rank in enumerate(entries):
                body: dict[str, Any] = {"serialized_named_tensors": per_rank, "load_format": "flattened_bucket",
                                        "flush_cache": i == len(entries) - 1, "abort_all_requests": False}
                if i == len(entries) - 1:
                    body["weight_version"] = str(version)
                post(url, "/update_weights_from_tensor", body)
            post(url, "/end_weight_update", {})
            t3 = time.perf_counter()
            run = {"gather_s": t1 - t0, "serialize_s": t2 - t1, "handoff_s": t3 - t2, "total_s": t3 - t0,
                   "payload_chars": sum(len(e) for rank in entries for e in rank)}
            print(f"  {'warm-up' if rep < 0 else f'rep {rep}'}: gather {run['gather_s']:.3f} s, serialize "
                  f"{run['serialize_s']:.4f} s, hand-off {run['handoff_s']:.3f} s, total {run['total_s']:.3f} s "
                  f"({len(entries)} buckets, {run['payload_chars']} chars of payload)", flush=True)
            if rep >= 0:
                runs.append(run)
        assert payload is not None
        dtype = save_dtype(model.config)
        served = httpx.get(url + "/digest", params={"dtype": str(dtype).removeprefix("torch.")}, timeout=600).json()
        assert "tensors" in served, served
        mine = {k: digest(v, dtype) for b in payload.buckets for k, v in b.tensors().items()}
        differ = [k for k, d in mine.items() if served["tensors"].get(k) != d]
        version = httpx.get(url + "/get_weight_version", timeout=30).json()["weight_version"]
        assert not differ, f"served tensors differ from the trainer's: {differ[:5]}"
        assert version == str(args.reps + 1), version
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        name = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"\ntensor path on {name}: {args.size} ({n_params / 1e6:.1f}M parameters, {payload.nbytes / 1e6:.1f} MB "
              f"{dtype}), trainer and server in two processes on {device}, median of {args.reps} after a warm-up")
        print(f"  gather {med['gather_s']:.3f} s  serialize {med['serialize_s']:.4f} s  hand-off (HTTP + load) "
              f"{med['handoff_s']:.3f} s  total {med['total_s']:.3f} s  "
              f"({payload.nbytes / med['handoff_s'] / 1e9:.1f} GB/s through the hand-off)")
        print(f"  server's weights equal the trainer's: {len(mine)} tensors, bit for bit; server model on "
              f"{served['device']}, weight_version {version}")
        print(json.dumps({"benchmark": "tensor_gpu", "device": name, "size": args.size, "parameters": n_params,
                          "bytes": payload.nbytes, "dtype": str(dtype), "reps": args.reps, "median": med,
                          "runs": runs, "equal": True, "tensors": len(mine)}))
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
