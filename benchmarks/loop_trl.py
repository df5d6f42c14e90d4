"""TRL's side of benchmarks/loop.py, as the orchestrator sees it: benchmarks/trl_side.py (GRPOTrainer) run in
its own process with every core for the budget, its logged steps read back, and its final weights evaluated
on the held-out tasks in a fresh engine + gateway (the same evaluator as rollway's side)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from loop_common import CORES, ROOT, heldout, log, reward_figures

from rollway.demo import GROUPS_PER_STEP, N_SAMPLES, _read_steps
from rollway.embedded import die_with_parent, stop


def run_trl(model: Path, sdir: Path, seed: int, budget: float, eval_tasks: list[dict[str, Any]],
            threads: int) -> dict[str, Any]:
    wd = sdir / "trl"
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log(f"seed {seed}: TRL GRPOTrainer for {budget:.0f} s ({threads} threads)")
    with open(wd / "trl.log", "ab") as tlog:
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "trl_side.py"), "--model", str(model),
                                 "--out", str(wd), "--budget", str(budget), "--seed", str(seed),
                                 "--threads", str(threads)],
                                env=env, stdout=tlog, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent(signal.SIGTERM))
        try:
            rc = proc.wait()
        finally:
            stop(proc)
    if rc != 0:
        tail = (wd / "trl.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"seed {seed}: trl_side.py exited with {rc}:\n{tail}")
    summary = json.loads((wd / "summary.json").read_text())
    # It stops at the first step end past the budget; that step is not counted (rollway's trainer is stopped
    # at the budget), but it is in the final weights (as a step rollway's trainer publishes while being stopped)
    t0, wall = summary["t0"], min(summary["t_end"] - summary["t0"], budget)
    rows = [r for r in _read_steps(wd / "steps.jsonl") if r["time"] <= t0 + wall]
    log(f"seed {seed}: TRL held-out eval (its final weights in a fresh engine + gateway)")
    end = heldout(wd / "final", wd / "eval-end", eval_tasks)
    batch = GROUPS_PER_STEP * N_SAMPLES
    points = [(r["time"] - t0, float(r["reward"]), batch) for r in rows]
    later = rows[1:]

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in later if r.get(key) is not None]
        return round(statistics.fmean(vals), 3) if vals else None

    cpu_ms = (summary["cpu1"] - summary["cpu0"]) * 1000.0  # train begin to the last step's end
    busy_ms = (summary["busy1"] - summary["busy0"]) * 1000.0
    total = (summary["t_end"] - t0) * 1000.0 * CORES
    return {
        "side": "trl", "wall_s": round(wall, 1), "steps": len(rows), "threads": threads,
        "overshoot_s": round(summary["t_end"] - t0 - wall, 1), "steps_run": summary["steps"],
        "first_step_s": round(rows[0]["time"] - t0, 1) if rows else None,
        "steps_per_s": round(len(rows) / wall, 4),
        "samples_in_per_s": round(len(rows) * batch / wall, 2), "trained_per_s": round(len(rows) * batch / wall, 2),
        "generated_per_s": round(len(rows) * batch / wall, 2),
        **reward_figures(points, wall),
        "heldout_end": round(end["eval_mean_reward"], 4),
        "cpu": {"trl": round(100 * cpu_ms / total, 1), "other": round(100 * max(0.0, busy_ms - cpu_ms) / total, 1)},
        "time_split": {"generate_score_s": mean("gen_s"), "fwd_bwd_clip_s": mean("fwd_bwd_s"),
                       "optimizer_s": mean("opt_s"), "between_steps_s": mean("between_s"),
                       "s_per_step": round(statistics.fmean(
                           b["time"] - a["time"] for a, b in itertools.pairwise(rows)), 3)
                       if len(rows) > 1 else None},
        "zero_std_frac": round(statistics.fmean(float(r.get("frac_reward_zero_std", 0.0)) for r in rows), 3)
        if rows else None,
        "config": json.loads((wd / "config.json").read_text()),
    }
