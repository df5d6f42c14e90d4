"""LoRA figures for benchmarks/trainer.py (`--lora`, `--publish`).

    python benchmarks/trainer.py --lora --sizes 100m      # step time and memory, full weights vs LoRA
    python benchmarks/trainer.py --publish --sizes 100m   # publish end to end, full disk vs LoRA adapter

`--lora`: `trainer.step.rl_step` on the same batch with full weights and with a LoRA adapter (rank 16 on
q/k/v/o, base frozen), each in a fresh process (world size 1): median step seconds, tokens/s, and the peak
memory the training adds (VmHWM after the steps minus VmRSS once the model is loaded: gradients, AdamW state,
activations).

`--publish`: a publish measured end to end, from the end of the trainer's step to the backend generating with
the new version: the export (HF folder, or the adapter folder), `POST /v1/weights` through a real `rollway serve`
(full: pause, `update_weights_from_disk`, continue; adapter: `/load_lora_adapter`, no pause) and the first
`/generate` on the engine with that version (full: `meta_info.weight_version`; adapter: `lora_path`), against a
real `rollway engine --enable-lora` on CPU. With and without fsync of the written folder; bytes are the folder's,
MB/s is bytes over export + publish. `ready` (export + publish: the server answered that it serves the version)
is the figure compared; the first generate is shown beside a generate on the previous version (`any gen`), which
on a small CPU costs the same whatever the version and would otherwise hide the difference.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

RANK = 16
TARGETS = "q_proj,k_proj,v_proj,o_proj"


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def step_worker(kind: str, size: str, reps: int) -> None:
    """One process, one variant: prints a JSON line."""
    from benchmarks.trainer_models import make_model, make_rows
    from trainer.batching import plan_step
    from trainer.config import TrainConfig
    from trainer.fsdp import init_distributed, load_sharded_model
    from trainer.lora import inject
    from trainer.loss import PPOParams
    from trainer.step import make_optimizer, rl_step

    root = Path(tempfile.mkdtemp())
    make_model(size, root / "m")
    info = init_distributed(force_cpu=False)
    cfg = TrainConfig(gateway="x", model="x", lr=1e-5, lora_rank=RANK if kind == "lora" else 0, lora_targets=TARGETS)
    model = load_sharded_model(str(root / "m"), info, prepare=(lambda m: inject(m, cfg)) if cfg.lora_rank else None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = make_optimizer(model, cfg)
    groups = make_rows(size)
    tokens = sum(len(r.token_ids) for g in groups for r in g)
    plan = plan_step(groups, world_size=1, rank=0, optimizer_steps=1, micro_batch_tokens=2048, loss_agg="token_mean")
    base_rss = _vm_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        rl_step(model, opt, plan, PPOParams(), max_grad_norm=1.0, device=info.device)
        if i:
            times.append(time.perf_counter() - t0)
    peak = _vm_kib("VmHWM") - base_rss
    print(json.dumps({"kind": kind, "trainable": trainable, "step_s": statistics.median(times),
                      "tok_s": tokens / statistics.median(times), "train_mem_mib": peak / 1024}))


def bench_steps(size: str, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("full", "lora"):
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("trainer.py")), "--lora-worker", kind, size,
                               "--reps", str(reps)], capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    out["lora_vs_full_step"] = out["lora"]["step_s"] / out["full"]["step_s"]
    out["lora_vs_full_mem"] = out["lora"]["train_mem_mib"] / max(out["full"]["train_mem_mib"], 1e-9)
    return out


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def bench_publish(size: str, reps: int, root: Path) -> dict[str, Any]:
    """Full disk publishes, then adapter publishes, through a real gateway and engine."""
    from benchmarks.trainer_models import make_model
    from rollway.embedded import engine_process, free_port, wait_healthy
    from trainer.checkpoint import export_hf
    from trainer.config import TrainConfig
    from trainer.fsdp import init_distributed, load_sharded_model
    from trainer.lora import export_adapter, inject

    make_model(size, root / "model")
    from engine.tiny_model import build_tokenizer

    build_tokenizer().save_pretrained(root / "model")  # the gateway needs a tokenizer and chat template
    info = init_distributed(force_cpu=True)
    cfg = TrainConfig(gateway="x", model="x", lora_rank=RANK, lora_targets=TARGETS)
    full = load_sharded_model(str(root / "model"), info)
    lora = load_sharded_model(str(root / "model"), info, prepare=lambda m: inject(m, cfg))
    with torch.no_grad():  # a trained adapter: B != 0
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    key = "rw-bench-" + secrets.token_hex(8)
    admin = {"Authorization": f"Bearer {key}"}
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    flags = ["--enable-lora", "--lora-target-modules", *TARGETS.split(","), "--max-lora-rank", str(RANK),
             "--max-loaded-loras", "5"]
    rows: dict[str, list[dict[str, float]]] = {}
    with engine_process(root / "model", log_path=root / "engine.log", extra=flags) as engine, \
            httpx.Client(timeout=600) as http:
        gw = subprocess.Popen([sys.executable, "-m", "rollway.cli", "serve", "--backend", engine, "--tokenizer",
                               str(root / "model"), "--db", f"sqlite:///{root / 'r.db'}", "--port", str(port),
                               "--data-dir", str(root / "gw")],
                              env={**os.environ, "ROLLWAY_ADMIN_KEY": key}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
        try:
            wait_healthy(gateway, gw, timeout=180)
            version = 0
            for kind in ("full", "lora"):
                for fsync in (True, False):
                    for _ in range(reps):
                        version += 1
                        tb = time.perf_counter()  # a generate on the current version: what any generate costs here
                        http.post(f"{engine}/generate", json={"input_ids": [5, 6, 7], **({"lora_path": f"v{version - 1}"}
                                  if kind == "lora" and version > 1 + 2 * reps else {}),
                                  "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
                        baseline = time.perf_counter() - tb
                        t0 = time.perf_counter()
                        if kind == "full":
                            dest = export_hf(full, root / "model", root / "weights" / f"v{version:06d}", fsync=fsync)
                            path, extra = str(dest), {}
                        else:
                            dest = export_adapter(lora, cfg, str(root / "model"), root / "adapters" / f"v{version:06d}",
                                                  fsync=fsync)
                            path, extra = f"lora:{dest}", {"lora_path": f"v{version}"}
                        t1 = time.perf_counter()
                        r = http.post(f"{gateway}/v1/weights", json={"version": version, "model_path": path},
                                      headers=admin)
                        r.raise_for_status()
                        t2 = time.perf_counter()
                        g = http.post(f"{engine}/generate", json={"input_ids": [5, 6, 7], **extra,
                                                                  "sampling_params": {"max_new_tokens": 1}})
                        g.raise_for_status()
                        assert kind == "lora" or g.json()["meta_info"]["weight_version"] == str(version)
                        t3 = time.perf_counter()
                        size_b = _folder_bytes(dest)
                        rows.setdefault(f"{kind}{'' if fsync else '_nofsync'}", []).append(
                            {"export_s": t1 - t0, "publish_s": t2 - t1, "ready_s": t2 - t0,
                             "first_generate_s": t3 - t2, "baseline_generate_s": baseline, "total_s": t3 - t0,
                             "bytes": size_b, "bytes_per_s": size_b / (t2 - t0)})
        finally:
            gw.terminate()
            gw.wait(30)
    out: dict[str, Any] = {}
    for name, rs in rows.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    for suffix in ("", "_nofsync"):
        out[f"lora_vs_full{suffix}"] = out[f"lora{suffix}"]["ready_s"] / out[f"full{suffix}"]["ready_s"]
        out[f"lora_vs_full_total{suffix}"] = out[f"lora{suffix}"]["total_s"] / out[f"full{suffix}"]["total_s"]
    return out


def report(steps: dict[str, dict[str, Any]] | None, publish: dict[str, dict[str, Any]] | None) -> None:
    for size, r in (steps or {}).items():
        print(f"\n{size}: trainer step, full weights vs LoRA rank {RANK} on {TARGETS}")
        print(f"{'':>6} {'trainable':>12} {'step s':>8} {'tok/s':>8} {'train MiB':>10}")
        for kind in ("full", "lora"):
            k = r[kind]
            print(f"{kind:>6} {k['trainable']:>12,} {k['step_s']:>8.2f} {k['tok_s']:>8.0f} {k['train_mem_mib']:>10.0f}")
        print(f"LoRA/full: step {r['lora_vs_full_step']:.2f}x, memory {r['lora_vs_full_mem']:.2f}x")
    for size, r in (publish or {}).items():
        print(f"\n{size}: publish end to end (export -> POST /v1/weights -> first /generate on the new version)")
        print(f"{'':>14} {'export s':>9} {'publish s':>10} {'ready s':>8} {'1st gen s':>10} {'any gen s':>10} "
              f"{'total s':>8} {'MB':>8} {'MB/s':>8}")
        for name in ("full", "full_nofsync", "lora", "lora_nofsync"):
            k = r[name]
            print(f"{name:>14} {k['export_s']:>9.3f} {k['publish_s']:>10.3f} {k['ready_s']:>8.3f} "
                  f"{k['first_generate_s']:>10.3f} {k['baseline_generate_s']:>10.3f} {k['total_s']:>8.3f} "
                  f"{k['bytes'] / 1e6:>8.2f} {k['bytes_per_s'] / 1e6:>8.1f}")
        print(f"adapter/full until served (export + publish): {r['lora_vs_full']:.3f}x with fsync, "
              f"{r['lora_vs_full_nofsync']:.3f}x without (target <= 0.1x); including the first generate: "
              f"{r['lora_vs_full_total']:.3f}x, {r['lora_vs_full_total_nofsync']:.3f}x")
    print(json.dumps({"benchmark": "trainer_lora", "steps": steps, "publish": publish}))
