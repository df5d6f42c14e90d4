"""Asynchronous RL: wall time to N trainer steps with η = 0 (synchronous) and η = 2 (rollouts keep running
while the trainer trains), on the demo task.

    python benchmarks/async.py                        # SFT warm-up once (~3 min, cached); η = 0, 2; 20 steps
    python benchmarks/async.py --model DIR --steps 5  # an already warmed-up HF model folder, a short run
    python benchmarks/async.py --etas 0 1 2 4

The task is the demo's: two-digit addition with the arithmetic agent (agents/arithmetic.py, exact-match
reward, tasks agents/tasks/arithmetic.jsonl, taken in file order so every η sees the same tasks). The model
is the demo's warm-up (`rollway.demo._sft`: the tiny model, SFT'd until its expected exact match at T = 1
reaches 0.12, so most groups carry reward signal); it is cached in OUT/warmup-seed<seed>/ and reused.

Per η, from scratch: a CPU engine on the warmed-up weights; a gateway on a fresh SQLite database, with
admission set to η and B from its first group (ROLLWAY_MAX_HEAD_OFFPOLICYNESS and
ROLLWAY_DEFAULT_GROUPS_PER_STEP; without them it admits without limit until the trainer's first lease); the
trainer as the demo starts it (`rollway train`, B = 8 groups of 8 samples a step, lr 1e-4, advantages /
group std, wait 5 s); and this process keeping --in-flight groups running through `Runner.run_group` (a 429
from staleness control makes the runner wait the Retry-After, 1 s). It stops when the trainer has logged
step N (or at --timeout-minutes). Every child runs with OMP_NUM_THREADS=1.

Columns (from the trainer's metrics.jsonl, except samples/s and 429s):
  wall_s         trainer start (process spawn, model load included) to step N logged
  first_s        trainer start to step 1 logged: start-up plus the first B groups, the same for every η
  s/step         (wall_s - first_s) / (N - 1): the steady-state pace η changes
  step_s         mean time of the optimizer step itself, steps 2..N
  wait_s         mean time the trainer spent leasing (idle for rollouts), steps 2..N
  stale_max/mean version lag of trained tokens (trainer version - token version); must be <= η, and 0 at η = 0
  dropped        groups dropped as stale at lease time; filtered: groups with equal rewards (no gradient)
  samples/s      samples finished by the runner between trainer start and step N, per second
  429s           group creations refused by staleness control (gateway /metrics)
  reward         mean training reward over the N steps (before filtering)

η > 0 wins when the trainer would otherwise wait for rollouts (wait_s at η = 0 is large) and the engine has
cores to run on while the trainer trains: on a 2-core machine they share them, so expect less than the sum.
Prints a table, then one JSON line with every figure; exits 1 (after a FAIL line) when a staleness bound is
broken or a run did not reach N steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# `engine` and `trainer` must be the packages, not benchmarks/engine.py and benchmarks/trainer.py
sys.path.insert(0, str(ROOT))

from bench_procs import Procs  # noqa: E402

from rollway.demo import GROUPS_IN_FLIGHT, GROUPS_PER_STEP, N_SAMPLES, RL_LR, SFT_MAX_STEPS, _read_steps, _sft  # noqa: E402
from rollway.embedded import free_port, wait_healthy  # noqa: E402
from rollway.rollout import Runner, load_agent, load_tasks  # noqa: E402
from rollway_common.paths import agent_file  # noqa: E402

COUNTERS = ("rollway_admission_refused_total", "rollway_resubmits_total")


# --- the model --------------------------------------------------------------------------------------------


def warmed_up_model(out: Path, seed: int, tasks: list[dict[str, Any]]) -> Path:
    """The demo's SFT warm-up, cached in out/warmup-seed<seed>/ (a run that did not finish starts over)."""
    warm = out / f"warmup-seed{seed}"
    final = warm / "sft" / "weights" / "sft-final"
    if (final / "config.json").is_file():
        print(f"reusing the warmed-up model {final}", flush=True)
        return final
    shutil.rmtree(warm, ignore_errors=True)
    warm.mkdir(parents=True)
    from engine.tiny_model import create_tiny_model

    print(f"SFT warm-up into {warm} (~3 minutes on 2 cores)", flush=True)
    return _sft(warm, create_tiny_model(warm / "model-init", seed=seed), tasks, seed, SFT_MAX_STEPS)


# --- rollouts ---------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """What the runner finished: (finish time, samples with a reward) per group; groups that failed."""

    done: list[tuple[float, int]] = field(default_factory=list)
    failed: int = 0
    first_error: str = ""

    def samples_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in self.done if t0 <= t <= t1)


async def drive(gateway: str, key: str, trainer: subprocess.Popen[bytes], metrics: Path, steps: int,
                in_flight: int, tasks: list[dict[str, Any]], deadline: float) -> Rollouts:
    """Keep `in_flight` groups running (as rollway/demo.py does) until the trainer has logged `steps` steps,
    exits, or the deadline passes."""
    runner = Runner(gateway, key, load_agent(agent_file("arithmetic.py")), concurrency=in_flight * N_SAMPLES)
    out = Rollouts()
    running: set[asyncio.Task[list[float | None]]] = set()
    i = 0
    try:
        while trainer.poll() is None and len(_read_steps(metrics)) < steps and time.time() < deadline:
            while len(running) < in_flight:
                running.add(asyncio.ensure_future(runner.run_group(tasks[i % len(tasks)], N_SAMPLES)))
                i += 1
            done, running = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            now = time.time()
            for d in done:
                error = d.exception()
                if error is not None:  # one failed group (a dropped connection) is no reason to stop
                    out.failed += 1
                    out.first_error = out.first_error or repr(error)
                else:
                    out.done.append((now, sum(r is not None for r in d.result())))
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await runner.close()
    return out


def scrape(gateway: str) -> dict[str, float]:
    """The gateway's counters named in COUNTERS (Prometheus text from GET /metrics)."""
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            values[name] = float(value)
    return values


# --- one η ------------------------------------------------------------------------------------------------


def start_servers(procs: Procs, model: Path, workdir: Path, env: dict[str, str]) -> str:
    """A CPU engine on `model` and a gateway on a fresh SQLite file in front of it; returns its URL."""
    engine_url = f"http://127.0.0.1:{free_port()}"
    engine = procs.start("engine", [sys.executable, "-m", "rollway.cli", "engine", "--model", str(model),
                                    "--port", engine_url.rsplit(":", 1)[1], "--max-batch-size", "64"])
    wait_healthy(engine_url, engine)
    port = free_port()
    gw = procs.start("gateway", [sys.executable, "-m", "rollway.cli", "serve", "--backend", engine_url,
                                 "--tokenizer", str(model), "--db", f"sqlite:///{workdir / 'rollway.db'}",
                                 "--port", str(port), "--data-dir", str(workdir)], env)
    gateway = f"http://127.0.0.1:{port}"
    wait_healthy(gateway, gw, timeout=120)
    return gateway


def run_eta(eta: int, model: Path, args: argparse.Namespace, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    workdir = args.out / f"eta{eta}"
    shutil.rmtree(workdir, ignore_errors=True)  # a trainer resumes from checkpoints in its out folder
    workdir.mkdir(parents=True)
    key = "rw-admin-" + secrets.token_urlsafe(24)
    env = {"ROLLWAY_ADMIN_KEY": key, "ROLLWAY_MAX_HEAD_OFFPOLICYNESS": str(eta),
           "ROLLWAY_DEFAULT_GROUPS_PER_STEP": str(GROUPS_PER_STEP)}
    metrics = workdir / "train" / "metrics.jsonl"
    procs = Procs(workdir)
    try:
        gateway = start_servers(procs, model, workdir, env)
        train_cmd = [sys.executable, "-m", "rollway.cli", "train", "--gateway", gateway,
                     "--model", str(model), "--out", str(workdir / "train"), "--nproc", "1",
                     "--seed", str(args.seed), "--groups-per-step", str(GROUPS_PER_STEP),
                     "--max-head-offpolicyness", str(eta), "--lr", str(RL_LR), "--adv-std-norm", "true",
                     "--wait-seconds", "5", "--checkpoint-every", "50", "--steps", str(args.steps)]
        print(f"η = {eta}: engine and gateway up; trainer started for {args.steps} steps", flush=True)
        t_start = time.time()
        trainer = procs.start("trainer", train_cmd, env)
        rollouts = asyncio.run(drive(gateway, key, trainer, metrics, args.steps, args.in_flight, tasks,
                                     t_start + args.timeout_minutes * 60))
        rows = _read_steps(metrics)[: args.steps]
        if len(rows) == args.steps:  # let it write its reward plot and exit, rather than stop it mid-way
            with contextlib.suppress(subprocess.TimeoutExpired):
                trainer.wait(30)
        elif trainer.poll() not in (None, 0):
            raise RuntimeError(f"η = {eta}: the trainer exited with {trainer.returncode} after {len(rows)} "
                               f"steps:\n{procs.log_tail('trainer')}")
        counters = scrape(gateway)
    finally:
        procs.stop_all()
    return summarize(eta, rows, t_start, rollouts, counters)


def summarize(eta: int, rows: list[dict[str, Any]], t_start: float, rollouts: Rollouts,
              counters: dict[str, float]) -> dict[str, Any]:
    t_end = rows[-1]["time"] if rows else time.time()
    steady = rows[1:] or rows  # step 1 waits for the first groups whatever η is

    def mean(key: str, of: list[dict[str, Any]]) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in of) if of else 0.0

    wall = t_end - t_start
    first = rows[0]["time"] - t_start if rows else wall
    return {
        "eta": eta, "steps": len(rows), "wall_s": round(wall, 2), "first_step_s": round(first, 2),
        "s_per_step": round((wall - first) / (len(rows) - 1), 3) if len(rows) > 1 else None,
        "step_time_s": round(mean("step_time_s", steady), 3),
        "lease_wait_s": round(mean("lease_wait_s", steady), 3),
        "staleness_max": max((int(r.get("staleness_max", 0)) for r in rows), default=0),
        "staleness_mean": round(mean("staleness_mean", rows), 4),
        "groups_stale": sum(int(r.get("groups_stale", 0)) for r in rows),
        "groups_filtered": sum(int(r.get("groups_filtered", 0)) for r in rows),
        "groups_done": sum(1 for t, _ in rollouts.done if t <= t_end), "groups_failed": rollouts.failed,
        "samples_per_s": round(rollouts.samples_between(t_start, t_end) / max(wall, 1e-9), 2),
        "admission_refused": int(counters.get("rollway_admission_refused_total", 0)),
        "resubmits": int(counters.get("rollway_resubmits_total", 0)),
        "reward_mean": round(mean("reward_mean", rows), 4),
    }


# --- report -----------------------------------------------------------------------------------------------


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'η':>2} {'steps':>5} {'wall_s':>7} {'first_s':>7} {'s/step':>6} {'step_s':>6} {'wait_s':>6} "
          f"{'stale_max':>9} {'stale_mean':>10} {'dropped':>7} {'filtered':>8} {'samples/s':>9} {'429s':>5} "
          f"{'reward':>6}")
    for r in results:
        pace = f"{r['s_per_step']:.2f}" if r["s_per_step"] is not None else "-"
        print(f"{r['eta']:>2} {r['steps']:>5} {r['wall_s']:>7.1f} {r['first_step_s']:>7.1f} {pace:>6} "
              f"{r['step_time_s']:>6.2f} {r['lease_wait_s']:>6.2f} {r['staleness_max']:>9} "
              f"{r['staleness_mean']:>10.3f} {r['groups_stale']:>7} {r['groups_filtered']:>8} "
              f"{r['samples_per_s']:>9.1f} {r['admission_refused']:>5} {r['reward_mean']:>6.3f}")


def failures(results: list[dict[str, Any]], steps: int) -> list[str]:
    out = []
    for r in results:
        if r["staleness_max"] > r["eta"]:
            out.append(f"η = {r['eta']}: trained on tokens {r['staleness_max']} versions old "
                       f"(bound {r['eta']})")
        if r["steps"] < steps:
            out.append(f"η = {r['eta']}: reached {r['steps']} of {steps} steps before the timeout")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 2], metavar="η",
                        help="max head off-policyness values to run, each from scratch (default: 0 2)")
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per run, N (default: 20)")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="an already warmed-up HF model folder; skips (and ignores the cache of) the SFT")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async"), metavar="DIR",
                        help="warm-up cache; per η the database, logs, trainer output (default: %(default)s)")
    parser.add_argument("--in-flight", type=int, default=GROUPS_IN_FLIGHT,
                        help=f"groups the runner keeps running (default: {GROUPS_IN_FLIGHT}, as the demo)")
    parser.add_argument("--timeout-minutes", type=float, default=20.0, help="per η run (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="tiny model, SFT and trainer seed (default: 0)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every child; the SFT raises it for its own run
    tasks = load_tasks(agent_file("tasks/arithmetic.jsonl"))
    model = args.model.resolve() if args.model else warmed_up_model(args.out, args.seed, tasks)

    results = [run_eta(eta, model, args, tasks) for eta in args.etas]
    print_table(results)
    problems = failures(results, args.steps)
    for p in problems:
        print(f"FAIL: {p}")
    summary: dict[str, Any] = {"benchmark": "async", "steps": args.steps, "groups_per_step": GROUPS_PER_STEP,
                               "n_samples": N_SAMPLES, "in_flight": args.in_flight, "model": str(model),
                               "seed": args.seed, "omp_threads": os.environ["OMP_NUM_THREADS"]}
    summary.update({f"eta{r['eta']}": r for r in results})
    base = next((r for r in results if r["eta"] == 0), None)
    for r in results:
        if base is not None and r["eta"] != 0 and r["wall_s"] > 0:
            summary[f"speedup_eta{r['eta']}"] = round(base["wall_s"] / r["wall_s"], 3)
    summary["ok"] = not problems
    print(json.dumps(summary))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
