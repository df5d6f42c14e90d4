"""What both sides of benchmarks/loop.py share: the SFT checkpoint, the demo's serving stack (CPU engine +
gateway) and the held-out evaluation on it, and the reward figures computed alike for both sides' logs."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] != str(ROOT):  # `engine`/`trainer` are the packages, not benchmarks/engine.py, trainer.py
    sys.path.insert(0, str(ROOT))

from bench_procs import proc_table  # noqa: E402

from rollway.demo import SFT_MAX_STEPS, _sft, arithmetic_runner  # noqa: E402
from rollway.embedded import die_with_parent, engine_process, free_port, stop, wait_healthy  # noqa: E402
from rollway.rollout import run_async, run_eval  # noqa: E402

THRESHOLDS = (0.3, 0.5)
WINDOW_S = 30.0
GRID_S = 0.5
ENGINE_MAX_BATCH = 64  # the demo's --max-batch-size
CORES = os.cpu_count() or 1


def log(msg: str) -> None:
    print(f"[loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the checkpoint, the stack and the held-out accuracy ---------------------------------------------------


def warmed_up_model(work: Path, seed: int, tasks: list[dict[str, Any]]) -> Path:
    """The demo's SFT warm-up of `seed`, cached in work/warmup-seed<seed>/ (an unfinished one starts over)."""
    warm = work / f"warmup-seed{seed}"
    final = warm / "sft" / "weights" / "sft-final"
    if (final / "config.json").is_file():
        log(f"seed {seed}: reusing the warmed-up model {final}")
        return final
    shutil.rmtree(warm, ignore_errors=True)
    warm.mkdir(parents=True)
    from engine.tiny_model import create_tiny_model

    log(f"seed {seed}: SFT warm-up into {warm} (the demo's, ~2-3 minutes on 2 cores)")
    return _sft(warm, create_tiny_model(warm / "model-init", seed=seed), tasks, seed, SFT_MAX_STEPS)


def _child_pid(fragment: str) -> int:
    """The pid of this process's child whose command line contains `fragment`."""
    me = os.getpid()
    for pid, (ppid, _, _) in proc_table().items():
        if ppid != me:
            continue
        with contextlib.suppress(OSError):
            if fragment in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                return pid
    raise RuntimeError(f"no child process with {fragment!r} in its command line")


@contextlib.contextmanager
def stack(model: Path, wd: Path, key: str) -> Iterator[tuple[str, dict[str, int], str]]:
    """The demo's serving side: a CPU engine on `model` and a gateway on a fresh SQLite store in `wd`.
    Yields the gateway URL and the pids {"engine", "gateway"}."""
    env = {**os.environ, "ROLLWAY_ADMIN_KEY": key}
    port = free_port()
    with engine_process(model, port=port, log_path=wd / "engine.log",
                        extra=["--max-batch-size", str(ENGINE_MAX_BATCH)]) as engine_url:
        engine_pid = _child_pid(f"--port {port}")
        gport = free_port()
        with open(wd / "gateway.log", "ab") as glog:
            gw = subprocess.Popen(
                [sys.executable, "-m", "rollway.cli", "serve", "--backend", engine_url, "--tokenizer", str(model),
                 "--db", f"sqlite:///{wd / 'rollway.db'}", "--port", str(gport), "--data-dir", str(wd)],
                env=env, stdout=glog, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(signal.SIGTERM))
        gateway = f"http://127.0.0.1:{gport}"
        try:
            wait_healthy(gateway, gw, timeout=120)
            yield gateway, {"engine": engine_pid, "gateway": gw.pid}, engine_url
        finally:
            stop(gw)


def heldout(model: Path, wd: Path, eval_tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy held-out accuracy of `model`: a fresh engine + gateway, `run_eval` (the demo's evaluator)."""
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    key = "rw-admin-" + secrets.token_urlsafe(24)
    with stack(model, wd, key) as (gateway, _, _):
        async def go() -> dict[str, Any]:
            runner = arithmetic_runner(gateway, key)
            try:
                return await run_eval(runner, eval_tasks, 1, await runner.weight_version())
            finally:
                await runner.close()

        return run_async(go())


def start_accuracy(model: Path, sdir: Path, eval_tasks: list[dict[str, Any]]) -> float:
    cache = sdir / "start_eval.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads(cache.read_text())
        if saved["model"] == str(model) and saved["n_tasks"] == len(eval_tasks):
            return float(saved["eval_mean_reward"])
    log("held-out greedy accuracy of the SFT checkpoint")
    res = heldout(model, sdir / "eval-start", eval_tasks)
    cache.write_text(json.dumps({**res, "model": str(model)}))
    return float(res["eval_mean_reward"])


# --- figures ----------------------------------------------------------------------------------------------


def rolling(points: list[tuple[float, float, int]], t: float) -> float | None:
    """Sample-weighted mean reward of the steps logged in (t - WINDOW_S, t]."""
    inside = [(r, n) for tp, r, n in points if t - WINDOW_S < tp <= t and n > 0]
    total = sum(n for _, n in inside)
    return sum(r * n for r, n in inside) / total if total else None


def reward_figures(points: list[tuple[float, float, int]], wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {f"ttt_{thr}": None for thr in THRESHOLDS}
    best = None
    t = WINDOW_S
    while t <= wall + 1e-9:
        m = rolling(points, t)
        if m is not None:
            best = m if best is None else max(best, m)
            for thr in THRESHOLDS:
                if out[f"ttt_{thr}"] is None and m >= thr:
                    out[f"ttt_{thr}"] = round(t, 1)
        t += GRID_S
    final = rolling(points, wall)
    first = [r for _, r, _ in points[:3]]
    out.update(reward_first3=round(statistics.fmean(first), 4) if first else None,
               reward_window_max=None if best is None else round(best, 4),
               reward_window_end=None if final is None else round(final, 4))
    return out


def pct(part: float | None, whole: float) -> float | None:
    return None if part is None else round(100.0 * part / max(whole, 1e-9), 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None
