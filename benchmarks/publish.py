"""Publish benchmark: how long a new version takes to reach the servers, end to end, by each way of publishing.

    python benchmarks/publish.py                  # ~100M-parameter Qwen2 (benchmarks/trainer.py's "100m"), 2 engines
    python benchmarks/publish.py --size tiny --backends 1 --reps 2

A publish is timed from the end of the trainer's step (the trained model in memory on rank 0's process) to every
backend generating with the new version: the gather / export, the gateway's pause, the load on each server, the
continue, and one /generate per server that answers with the new `weight_version` (all servers asked at once, on
clients kept open, as agents ask them; `--probes sequential`: one after the other on a new client each, as before).
Real processes: `rollway engine` servers (CPU) behind `rollway serve`; the trainer's side runs here (world size 1,
gloo).

- disk, fsync:    `export_hf` (safetensors + config + tokenizer, fsync, atomic rename), POST /v1/weights; each
                  server reads the folder (`/update_weights_from_disk`)
- disk, no fsync: the same with the fsyncs skipped (a filesystem that acknowledges writes before they are durable)
- process group:  `SyncPayload.gather` + `publish` (trainer/weight_sync.py): POST /v1/weights/sync/init and
                  /v1/weights/sync, one gloo group per server, buckets of --bucket-mb
- tensor:         `backend="tensor"` (trainer/tensor_sync.py) as the trainer runs it with one rank on CPU: the
                  parameters themselves moved into one shared-memory file (once, on the first publish), each server
                  handed their names through `/update_weights_from_tensor` (named tensors) and copying straight out of the
                  trainer's memory, no gather copy (servers on this machine only); target: <= 0.5x the process group
- tensor, copied: the same path with the weights first copied into shared-memory buckets (`flattened_bucket`), as it
                  runs with several ranks, a dtype to cast to, or on a GPU

bytes/s = the weights' bytes (what is broadcast, about the safetensors file) / seconds. Target: process group
<= 0.5x disk. The median is of publishes after a warm-up one of each way (`--warmup`), as a training run publishes
hundreds of times: a first publish also pays for memory touched for the first time (the trainer's reused bucket
buffers, the engine's receive buffer, and its weights, which the disk path maps from the file read-only and the
process-group path writes into), shown apart as "first". Each way runs as a block of publishes, not interleaved with
the others, because a run uses one way: after a disk publish the engine serves weights mapped from the file, and a
process-group publish right after it would pay for copying them out again (a state no real run is in). `ROWS` maps a row name to a function (ctx, version) -> bytes published: another way to publish (a
LoRA adapter's) adds its row there. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_procs import Procs  # noqa: E402
from benchmarks.trainer_models import make_model  # noqa: E402
from rollway.embedded import free_port, wait_healthy  # noqa: E402
from rollway_common import paths  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.client import GatewayClient  # noqa: E402
from trainer.tensor_sync import LiveWeights  # noqa: E402
from trainer.weight_sync import SyncOptions, SyncPayload  # noqa: E402

ADMIN = "rw-admin-bench-publish"


@dataclass
class Ctx:
    model: Any
    source: Path
    out: Path
    client: GatewayClient
    engines: list[str]
    bucket_bytes: int
    live: LiveWeights
    """The trainer's guard of the exposed weights: each "step" below waits on it, as the optimizer step does."""


def _disk(fsync: bool) -> Callable[[Ctx, int], int]:
    def run(ctx: Ctx, version: int) -> int:
        saved = checkpoint._fsync_tree, checkpoint._fsync_dir
        t0 = time.perf_counter()
        if not fsync:
            checkpoint._fsync_tree = checkpoint._fsync_dir = lambda path: None  # type: ignore[assignment]
        try:
            path = checkpoint.export_hf(ctx.model, ctx.source, ctx.out / "weights" / f"v{version:06d}")
        finally:
            checkpoint._fsync_tree, checkpoint._fsync_dir = saved
        t1 = time.perf_counter()
        answer = ctx.client._request("POST", "/v1/weights", json={"version": version, "model_path": str(path)},
                                     timeout=600).json()
        assert not answer["failed_backends"], answer
        print(f"    export {t1 - t0:.3f} s, gateway {answer['seconds']:.3f} s", flush=True)
        return (path / "model.safetensors").stat().st_size

    return run


def _process_group(ctx: Ctx, version: int) -> int:
    opts = SyncOptions(address="127.0.0.1", backend="gloo", bucket_bytes=ctx.bucket_bytes, timeout=300)
    t0 = time.perf_counter()
    payload = SyncPayload.gather(ctx.model, ctx.source, opts)
    t1 = time.perf_counter()
    payload.publish(ctx.client, version, [], {})
    print(f"    gather {t1 - t0:.3f} s, publish {payload.last['seconds']:.3f} s "
          f"(gateway {payload.last['answer']['seconds']:.3f} s)", flush=True)
    return payload.nbytes


def _tensor(exposed: bool) -> Callable[[Ctx, int], int]:
    def run(ctx: Ctx, version: int) -> int:
        opts = SyncOptions(backend="tensor", bucket_bytes=ctx.bucket_bytes, timeout=300,
                           live=ctx.live if exposed else None)
        t0 = time.perf_counter()
        payload = SyncPayload.gather(ctx.model, ctx.source, opts)
        t1 = time.perf_counter()
        assert (payload.live is not None) == exposed, "the weights were not exposed as they are"
        payload.publish(ctx.client, version, [], {})
        print(f"    gather {t1 - t0:.3f} s, publish {payload.last['seconds']:.3f} s "
              f"(gateway {payload.last['answer']['seconds']:.3f} s)", flush=True)
        return payload.nbytes

    return run


ROWS: dict[str, Callable[[Ctx, int], int]] = {
    "disk, fsync": _disk(True),
    "disk, no fsync": _disk(False),
    "process group (gloo)": _process_group,
    "tensor (shared memory)": _tensor(True),
    "tensor, copied buckets": _tensor(False),
}


class Probes:
    """One `/generate` per server that must answer with the new version (what an agent would next see). Each server
    is asked on a client kept open across publishes, all at once (`concurrent`, what agents do), one after the other
    on those kept clients (`in-turn`), or one after the other on a client made for each call (`sequential`: how the
    figures before 2026-11-28 were taken; making an
    httpx client loads its TLS context, tens of ms, part of those figures)."""

    def __init__(self, engines: list[str], mode: str) -> None:
        self.engines, self.mode = engines, mode
        self.clients = [httpx.Client(timeout=300) for _ in engines]
        self.pool = ThreadPoolExecutor(len(engines)) if mode == "concurrent" else None

    def __call__(self, version: int) -> None:
        if self.pool is None:
            for url, c in zip(self.engines, self.clients, strict=True):
                self._one(url, c if self.mode == "in-turn" else None, version)
            return
        pending = [self.pool.submit(self._one, url, c, version)
                   for url, c in zip(self.engines, self.clients, strict=True)]
        for f in pending:
            f.result()

    @staticmethod
    def _one(url: str, client: httpx.Client | None, version: int) -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        answer = client.post(url + "/generate", json=body) if client is not None else \
            httpx.post(url + "/generate", json=body, timeout=300)
        got = answer.json()["meta_info"]["weight_version"]
        assert got == str(version), (url, got, version)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        for c in self.clients:
            c.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", choices=["tiny", "100m"])
    ap.add_argument("--backends", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="publishes of each way first, not counted in the median but shown as 'first' (default 1)")
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--rows", nargs="*", default=list(ROWS))
    ap.add_argument("--probes", default="concurrent", choices=["concurrent", "in-turn", "sequential"],
                    help="the servers' first /generate at the new version: all at once on kept clients (default), one "
                         "after the other on kept clients (in-turn), or one after the other on a fresh client each "
                         "(sequential: the figures before 2026-11-28)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="rollway-bench-publish-"))
    procs = Procs(work)
    generating: Probes | None = None
    try:
        from engine.tiny_model import create_tiny_model

        tok = create_tiny_model(work / "tok", seed=0)
        source = work / "model"
        n_params = make_model(args.size, source)
        for name in paths.TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copyfile(tok / name, source / name)
        env = {"ROLLWAY_ADMIN_KEY": ADMIN, "OMP_NUM_THREADS": "1"}
        engines = []
        for i in range(args.backends):
            port = free_port()
            procs.start(f"engine{i}", [sys.executable, "-m", "rollway.cli", "engine", "--model", str(source),
                                       "--port", str(port)], env)
            engines.append(f"http://127.0.0.1:{port}")
        gw_port = free_port()
        cmd = [sys.executable, "-m", "rollway.cli", "serve", "--tokenizer", str(source), "--port", str(gw_port),
               "--db", f"sqlite:///{work / 'gw.db'}", "--data-dir", str(work / "data")]
        for url in engines:
            cmd += ["--backend", url]
        gateway = procs.start("gateway", cmd, {**env, "ROLLWAY_HEALTH_INTERVAL_S": "1"})
        for i, url in enumerate(engines):
            wait_healthy(url, procs.procs[f"engine{i}"], timeout=600)
        wait_healthy(f"http://127.0.0.1:{gw_port}", gateway, timeout=600)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        deadline = time.monotonic() + 300
        while not all(b["healthy"] for b in httpx.get(f"http://127.0.0.1:{gw_port}/v1/backends", headers=admin,
                                                      timeout=30).json()["data"]):
            assert time.monotonic() < deadline, "the gateway did not take every engine in"
            time.sleep(0.5)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        client = GatewayClient(f"http://127.0.0.1:{gw_port}", ADMIN, timeout=600)
        ctx = Ctx(model, source, work / "out", client, engines, max(1, int(args.bucket_mb * (1 << 20))), LiveWeights())
        generating = Probes(engines, args.probes)
        results: dict[str, dict[str, float]] = {}
        version = 0
        for name in args.rows:  # each way in a block, as a run uses one: see the docstring
            for rep in range(-args.warmup, args.reps):
                version += 1
                ctx.live.before_step()  # as the optimizer step: the servers have read the exposed weights
                with torch.no_grad():  # "a step": the weights change, so every publish carries new values
                    next(model.parameters()).add_(1e-3)
                t0 = time.perf_counter()
                nbytes = ROWS[name](ctx, version)
                generating(version)
                seconds = time.perf_counter() - t0
                row = results.setdefault(name, {"bytes": nbytes, "runs": [], "first": []})
                row["runs" if rep >= 0 else "first"].append(seconds)  # type: ignore[attr-defined]
                print(f"  {'rep ' + str(rep) if rep >= 0 else 'warm-up'} {name}: {seconds:.3f} s", flush=True)
        base = statistics.median(results["disk, fsync"]["runs"]) if "disk, fsync" in results else None  # type: ignore[arg-type]
        print(f"\npublish, end to end: {args.size} ({n_params / 1e6:.1f}M parameters), {args.backends} CPU engine(s), "
              f"median of {args.reps} after {args.warmup} warm-up publish(es) of each way, {os.cpu_count()} cores")
        print(f"{'way':<24} {'seconds':>8} {'MB':>8} {'MB/s':>8} {'x disk+fsync':>13} {'x disk':>8} {'first':>7}")
        nofsync = statistics.median(results["disk, no fsync"]["runs"]) if "disk, no fsync" in results else None  # type: ignore[arg-type]
        table = {}
        for name, r in results.items():
            sec = statistics.median(r["runs"])  # type: ignore[arg-type]
            row = {"seconds": round(sec, 3), "bytes": int(r["bytes"]), "bytes_per_s": round(r["bytes"] / sec),
                   "vs_disk_fsync": round(sec / base, 3) if base else None,
                   "vs_disk_no_fsync": round(sec / nofsync, 3) if nofsync else None,
                   "runs": [round(x, 3) for x in r["runs"]],  # type: ignore[union-attr]
                   "first": [round(x, 3) for x in r["first"]]}  # type: ignore[union-attr]
            table[name] = row
            ratio = f"{row['vs_disk_fsync']:.2f}x" if base else "-"
            ratio2 = f"{row['vs_disk_no_fsync']:.2f}x" if nofsync else "-"
            first = f"{r['first'][0]:.3f}" if r["first"] else "-"  # type: ignore[index]
            print(f"{name:<24} {sec:>8.3f} {r['bytes'] / 1e6:>8.1f} {r['bytes'] / sec / 1e6:>8.1f} {ratio:>13} "
                  f"{ratio2:>8} {first:>7}")
        print(json.dumps({"benchmark": "publish", "size": args.size, "parameters": n_params, "backends": args.backends,
                          "reps": args.reps, "warmup": args.warmup, "bucket_mb": args.bucket_mb, "probes": args.probes,
                          "rows": table}))
    finally:
        if generating is not None:
            generating.close()
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
