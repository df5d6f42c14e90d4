"""The whole loop against TRL: rollway's RL phase (`rollway demo`'s) and TRL's GRPOTrainer, from the same SFT'd
checkpoint, with the same learning settings, each for the same wall-clock budget; how fast each one's training
reward rises, and the held-out greedy accuracy each ends with.

    python benchmarks/loop.py                                  # seed 0, 400 s each (the demo's RL phase)
    python benchmarks/loop.py --seeds 0 1 2                    # medians and spreads (~50 min on 2 cores)
    python benchmarks/loop.py --seeds 0 --budget 90            # a smoke run (~7 min, warm-up cached)
    python benchmarks/loop.py --skip-trl                       # rollway's side only (no TRL needed)

TRL's side needs the `bench` extra: `pip install -e '.[bench]'` (trl==1.16.0; no change to torch or
transformers). Run on an otherwise quiet machine: the `other` CPU column says how much other work took.

Per seed:
- The checkpoint: `rollway demo`'s SFT warm-up (`rollway.demo._sft`: the tiny model of that seed, SFT'd on the
  training tasks until its expected exact match at T = 1 reaches 0.12), cached in WORK/warmup-seed<seed>/ (the
  layout benchmarks/async.py uses). Its held-out greedy accuracy (below) is measured once and cached.
- rollway: the demo's RL phase: a CPU engine (--max-batch-size 64) and a gateway on a fresh SQLite store, the
  arithmetic agent (agents/arithmetic.py, the OpenAI SDK) through the gateway via `Runner.run_group`, 24
  groups of 8 in flight, tasks in file order, and `rollway train` under torchrun (1 rank) with the demo's
  flags: 8 groups x 8 samples a step, lr 1e-4, advantages / group std, eta 2, wait 5 s, checkpoint every 50;
  every process OMP_NUM_THREADS=1, as the demo. The loop is rollway.demo._rl's, with timestamps (see
  `drive_rollway`). The trainer is started first and the clock starts when it says it is set up (model and
  optimizer loaded, about to lease: `trainer: 1 rank(s) on cpu` in its log) and the first group is requested:
  neither side's process start and model load is counted (the demo starts its trainer before its held-out
  eval, so there too its start-up is off the RL clock). The trainer is stopped at the budget.
- TRL: benchmarks/trl_side.py in its own process with every core: GRPOTrainer, plain generate, 8 prompts x
  8 generations = 64 completions a step, lr 1e-4 constant, scale_rewards "group", T = 1, 8 new tokens,
  beta 0, the same exact-match reward on the same tasks and chat template; bf16 and gradient checkpointing
  off to match rollway's float32, no-recompute trainer (the rest TRL's defaults; both configurations are
  printed in full). The clock starts at on_train_begin (the first generation follows at once); model loading
  before it is not counted. Training stops at the first step end past the budget.
- The two run one after the other; even seeds run rollway first, odd seeds TRL first.

Figures:
- time to 0.3 / 0.5: first time (from the clock start) the rolling mean training reward over the last 30 s
  of wall clock reaches the threshold. The training reward is what each trainer logs per step: rollway's
  `reward_mean` (every leased session of the step, filtered groups included; weighted by `reward_n`),
  TRL's `reward` (the step's 64 completions). Evaluated on a 0.5 s grid from 30 s (full windows only) to the
  budget; steps logged after the budget do not count. "-" = not reached within the budget.
- held-out: greedy accuracy on the first 200 tasks of agents/tasks/arithmetic_eval.jsonl (disjoint from the
  training tasks) with `rollway.rollout.run_eval` through the CPU engine + gateway: at the start (the SFT
  checkpoint, shared), rollway's end (its live stack after the trainer stops, serving the last published
  weights) and TRL's end (its final weights loaded into a fresh engine + gateway: the same evaluator).
- samples/s in: sessions the trainer leased and scored per second (filtered groups included); trained/s:
  samples in the groups it trained on. TRL: 64 completions per step, all trained (zero-std groups stay in the
  batch with zero advantage: `zero-std` is its share, rollway's analog is `filtered`).
- CPU: each process tree's CPU time over the window / (window x cores): trainer (rollway train, torchrun,
  worker), engine, gateway, runner (this process: the agents' event loop), other (the rest of the machine).
- rollway's trainer time split (from its metrics.jsonl, per step after the first), the training thread's:
  lease wait (the batch leased during the previous step not there yet), forward/backward (plan, passes,
  backward), optimizer (clip + AdamW), checkpoint, HF export, publish wait (the previous version's publish not
  done yet), other (the rest of the gap between two step logs); and on their own threads (trainer/pipeline.py):
  the lease calls and the publish (the gateway's pause / load / continue / commit). TRL's: generate + score, forward/backward + clip, optimizer, between steps.
- engine: from its `GET /metrics` over the window: the share of the time it was paused (publishes) and
  computing (prefill and decode), decode batch occupancy (rows per decode step, at most 64), prefill rows
  and rows actually computed (identical prompts once); generations in flight as the gateway saw them (turn
  prepare -> stored, from the store), and the gateway's publish time (rollway_weight_publish_seconds).
- rollway's 429s (admission refusals), groups dropped stale and token staleness, from /metrics and
  metrics.jsonl.

Prints both configurations, a per-seed table, the per-seed details, for several seeds the medians and
spreads (min..max) of the time ratios (rollway / TRL: below 1, rollway is faster) and held-out figures, then
one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import secrets
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `engine`/`trainer` are the packages, not benchmarks/engine.py, trainer.py

from bench_procs import machine_busy_ms, proc_table, tree_ms  # noqa: E402

from rollway.demo import (  # noqa: E402
    ETA,
    EVAL_TASKS,
    GROUPS_IN_FLIGHT,
    GROUPS_PER_STEP,
    N_SAMPLES,
    RL_LR,
    SFT_MAX_STEPS,
    _read_steps,
    _sft,
)
from rollway.embedded import die_with_parent, engine_process, free_port, stop, wait_healthy  # noqa: E402
from rollway.rollout import Runner, load_agent, load_tasks, run_async, run_eval  # noqa: E402
from rollway_common.paths import agent_file  # noqa: E402

THRESHOLDS = (0.3, 0.5)
WINDOW_S = 30.0
GRID_S = 0.5
DEFAULT_BUDGET_S = 400.0  # the demo's RL phase: 570 s in all, less SFT (~1.5-2 min), evals and the end reserve
ENGINE_MAX_BATCH = 64  # the demo's --max-batch-size
CORES = os.cpu_count() or 1
OTHER_WARN_PCT = 10.0  # other work's share of the machine above which the report warns
COUNTERS = ("rollway_admission_refused_total", "rollway_resubmits_total", "rollway_groups_dropped_stale_total",
            "rollway_weight_publish_seconds_sum", "rollway_weight_publish_seconds_count")


def log(msg: str) -> None:
    print(f"[loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the checkpoint and its held-out accuracy -------------------------------------------------------------


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
            runner = Runner(gateway, key, load_agent(agent_file("arithmetic.py")),
                            concurrency=GROUPS_IN_FLIGHT * N_SAMPLES)
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


# --- CPU accounting ---------------------------------------------------------------------------------------


def self_ms() -> float:
    """This process's own CPU (not its children: they are the servers, counted on their own)."""
    f = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(roots: dict[str, int]) -> dict[str, float]:
    table = proc_table()
    snap = {name: tree_ms(table, pid) for name, pid in roots.items()}
    snap["runner"] = self_ms()
    snap["machine"] = machine_busy_ms()
    return snap


def cpu_shares(a: dict[str, float], b: dict[str, float], wall_s: float) -> dict[str, float]:
    """Per process: % of the machine (wall x cores) over the window; `other` = the machine less ours."""
    total = wall_s * 1000.0 * CORES
    used = {k: b[k] - a[k] for k in a if k != "machine"}
    out = {k: round(100.0 * v / total, 1) for k, v in used.items()}
    out["other"] = round(100.0 * max(0.0, (b["machine"] - a["machine"]) - sum(used.values())) / total, 1)
    return out


# --- rollway's side ---------------------------------------------------------------------------------------


async def drive_rollway(gateway: str, key: str, trainer: subprocess.Popen[bytes], budget: float,
                        tasks: list[dict[str, Any]], eval_tasks: list[dict[str, Any]],
                        servers: dict[str, int], engine_url: str) -> dict[str, Any]:
    """rollway.demo._rl without its start eval, with a clock: with the trainer just spawned, GROUPS_IN_FLIGHT
    groups kept running until the budget (counted from the first group requested) or the trainer's exit; CPU
    snapshots at both ends; each group's finish time and rewards; then the trainer stopped and the held-out
    eval on the live stack."""
    agent = load_agent(agent_file("arithmetic.py"))
    runner = Runner(gateway, key, agent, concurrency=GROUPS_IN_FLIGHT * N_SAMPLES)
    groups: list[tuple[float, int, float]] = []  # (finish time, sessions rewarded, reward sum)
    failed, first_error = 0, ""
    try:
        roots = {**servers, "trainer": trainer.pid}
        t0 = time.time()
        cpu0 = cpu_snapshot(roots)
        engine0 = scrape(engine_url, "rollway_engine_")
        deadline = t0 + budget
        i = 0
        in_flight: set[asyncio.Task[Any]] = set()
        try:
            while trainer.poll() is None and time.time() < deadline:
                while len(in_flight) < GROUPS_IN_FLIGHT:
                    in_flight.add(asyncio.ensure_future(runner.run_group(tasks[i % len(tasks)], N_SAMPLES)))
                    i += 1
                done, in_flight = await asyncio.wait(in_flight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                now = time.time()
                for d in done:
                    if d.exception() is not None:  # as the demo: one failed group is no reason to stop
                        failed += 1
                        first_error = first_error or repr(d.exception())
                    else:
                        rewards = [r for r in d.result() if r is not None]
                        groups.append((now, len(rewards), sum(rewards)))
            t_end = time.time()
            cpu1 = cpu_snapshot(roots)
            engine1 = scrape(engine_url, "rollway_engine_")
        finally:
            if trainer.poll() is None:
                stop(trainer, timeout=60)
            for t in in_flight:
                t.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        version = await runner.weight_version()
        end = await run_eval(runner, eval_tasks, 1, version)
    finally:
        await runner.close()
    engine = {k.removeprefix("rollway_engine_").removesuffix("_total"): engine1[k] - engine0.get(k, 0.0)
              for k in engine1}
    return {"t0": t0, "t_end": t_end, "cpu": cpu_shares(cpu0, cpu1, t_end - t0), "groups": groups, "engine": engine,
            "groups_failed": failed, "first_error": first_error, "trainer_rc": trainer.returncode,
            "trainer_exited_early": t_end < deadline - 1.0,
            "weight_version": version, "heldout_end": end["eval_mean_reward"]}


def wait_trainer_ready(trainer_log: Path, trainer: subprocess.Popen[bytes], timeout: float = 180.0) -> float:
    """Seconds until the trainer says it is set up (`trainer: N rank(s) on ...`: its model and optimizer are
    loaded; it leases next). The clock starts after that, as TRL's starts at on_train_begin, after its model is
    loaded: neither side's process start-up and model load is counted."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited with {trainer.returncode} before it was ready; see {trainer_log}")
        with contextlib.suppress(OSError):
            if " rank(s) on " in trainer_log.read_text(errors="replace"):
                return time.time() - t0
        time.sleep(0.1)
    raise RuntimeError(f"the trainer was not ready within {timeout:.0f} s; see {trainer_log}")


def scrape(server: str, prefix: str = "") -> dict[str, float]:
    """`GET /metrics`: the gateway's COUNTERS, or every line whose name starts with `prefix` (the engine's)."""
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if (name.startswith(prefix) if prefix else name in COUNTERS):
            values[name] = float(value)
    return values


def in_flight_stats(db: Path, t0: float, t1: float) -> dict[str, float]:
    """Training generations in flight as the gateway saw them (turn prepared -> stored) over [t0, t1]: the time
    mean, and the share of the window with none and with at least ENGINE_MAX_BATCH (a full engine batch)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT t.timings FROM turns t JOIN sessions s ON t.session_id = s.id "
                           "JOIN groups g ON s.group_id = g.id WHERE g.is_eval = 0").fetchall()
    finally:
        con.close()
    events: list[tuple[float, int]] = []
    for (raw,) in rows:
        tm = json.loads(raw) if isinstance(raw, str) else raw
        a, b = max(float(tm["started"]), t0), min(float(tm["finished"]), t1)
        if b > a:
            events += [(a, 1), (b, -1)]
    events.sort()
    level, last, area, idle, full = 0, t0, 0.0, 0.0, 0.0
    for t, d in events:
        span = t - last
        area += level * span
        idle += span if level == 0 else 0.0
        full += span if level >= ENGINE_MAX_BATCH else 0.0
        level, last = level + d, t
    idle += t1 - last  # level is 0 after the last event
    wall = max(t1 - t0, 1e-9)
    return {"mean": round(area / wall, 1), "idle_pct": round(100 * idle / wall, 1),
            "full_pct": round(100 * full / wall, 1)}


def run_rollway(model: Path, sdir: Path, seed: int, budget: float, tasks: list[dict[str, Any]],
                eval_tasks: list[dict[str, Any]]) -> dict[str, Any]:
    wd = sdir / "rollway"
    shutil.rmtree(wd, ignore_errors=True)  # a trainer resumes from checkpoints in its out folder
    wd.mkdir(parents=True)
    key = "rw-admin-" + secrets.token_urlsafe(24)
    env = {**os.environ, "ROLLWAY_ADMIN_KEY": key}
    with stack(model, wd, key) as (gateway, servers, engine_url):
        # rollway/demo.py's train command, word for word (--nproc 1 and --steps 0: the demo's defaults)
        train_cmd = [sys.executable, "-m", "rollway.cli", "train", "--gateway", gateway, "--model", str(model),
                     "--out", str(wd / "train"), "--nproc", "1", "--seed", str(seed),
                     "--groups-per-step", str(GROUPS_PER_STEP), "--max-head-offpolicyness", str(ETA),
                     "--lr", str(RL_LR), "--adv-std-norm", "true", "--wait-seconds", "5",
                     "--checkpoint-every", "50", "--steps", "0"]
        log(f"seed {seed}: rollway for {budget:.0f} s (engine + gateway up, trainer starting)")
        # as the demo: SIGTERM if this process dies however it dies; `rollway train` then stops torchrun
        with open(wd / "trainer.log", "ab") as tlog:
            trainer = subprocess.Popen(train_cmd, env=env, stdout=tlog, stderr=subprocess.STDOUT,
                                       preexec_fn=die_with_parent(signal.SIGTERM))
        try:
            started = wait_trainer_ready(wd / "trainer.log", trainer)
            log(f"seed {seed}: trainer ready after {started:.1f} s (model loaded, about to lease); clock starts")
            res = run_async(drive_rollway(gateway, key, trainer, budget, tasks, eval_tasks, servers,
                                             engine_url))
            res["trainer_start_s"] = started
        finally:
            stop(trainer, timeout=60)
        counters = scrape(gateway)
    rows = [r for r in _read_steps(wd / "train" / "metrics.jsonl") if r["time"] <= res["t_end"]]
    config = json.loads((wd / "train" / "config.json").read_text())
    return summarize_rollway(res, rows, counters, in_flight_stats(wd / "rollway.db", res["t0"], res["t_end"]),
                             config)


def summarize_rollway(res: dict[str, Any], rows: list[dict[str, Any]], counters: dict[str, float],
                      flight: dict[str, float], config: dict[str, Any]) -> dict[str, Any]:
    t0, wall = res["t0"], res["t_end"] - res["t0"]
    points = [(r["time"] - t0, float(r.get("reward_mean", 0.0)), int(r.get("reward_n", 0))) for r in rows]
    later = rows[1:]  # step 1 includes the trainer's start-up and the first B groups

    def mean(key: str, of: list[dict[str, Any]] = later) -> float | None:
        vals = [float(r[key]) for r in of if key in r]
        return round(statistics.fmean(vals), 3) if vals else None

    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(rows)]
    # What the training thread spent each step on (trainer/pipeline.py: leasing and publishing run on their own
    # threads; the thread waits only when the next batch or the previous publish is not done yet)
    fwd_bwd = [float(r["step_time_s"]) - float(r["optimizer_time_s"]) for r in later if "optimizer_time_s" in r]
    split = {"lease_wait_s": mean("lease_wait_s"),
             "fwd_bwd_s": round(statistics.fmean(fwd_bwd), 3) if fwd_bwd else None,  # plan, passes, backward
             "optimizer_s": mean("optimizer_time_s"),  # clip + AdamW step
             "checkpoint_s": mean("checkpoint_time_s"), "export_s": mean("export_time_s"),
             "publish_wait_s": mean("publish_wait_s")}
    background = {"lease_s": mean("lease_time_s"), "publish_s": mean("publish_time_s")}
    if gaps:
        covered = sum(v for v in split.values() if v is not None)
        split["other_s"] = round(statistics.fmean(gaps) - covered, 3)
        split["s_per_step"] = round(statistics.fmean(gaps), 3)
    accepted = sum(int(r.get("groups_accepted", 0)) for r in rows)
    filtered = sum(int(r.get("groups_filtered", 0)) for r in rows)
    generated = sum(n for t, n, _ in res["groups"] if t <= res["t_end"])
    publish_n = counters.get("rollway_weight_publish_seconds_count", 0.0)
    return {
        "side": "rollway", "wall_s": round(wall, 1), "steps": len(rows),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "first_step_s": round(rows[0]["time"] - t0, 1) if rows else None,
        "steps_per_s": round(len(rows) / wall, 4),
        "samples_in_per_s": round(sum(int(r.get("reward_n", 0)) for r in rows) / wall, 2),
        "trained_per_s": round(accepted * N_SAMPLES / wall, 2),
        "generated_per_s": round(generated / wall, 2),
        **reward_figures(points, wall),
        "heldout_end": round(res["heldout_end"], 4), "weight_version": res["weight_version"],
        "cpu": res["cpu"], "time_split": split, "background_s": background,
        "trainer_start_s": round(res.get("trainer_start_s", 0.0), 1),
        "filtered_frac": round(filtered / max(1, filtered + accepted), 3),
        "groups_stale_dropped": sum(int(r.get("groups_stale", 0)) for r in rows),
        "staleness_mean": mean("staleness_mean", rows), "staleness_max": max(
            (int(r.get("staleness_max", 0)) for r in rows), default=0),
        "admission_429s": int(counters.get("rollway_admission_refused_total", 0)),
        "resubmits": int(counters.get("rollway_resubmits_total", 0)),
        "engine": {"paused_pct": pct(res["engine"].get("paused_s"), wall),
                   "busy_pct": pct(res["engine"].get("busy_s"), wall),
                   "decode_occupancy": ratio(res["engine"].get("decode_rows"), res["engine"].get("decode_steps")),
                   "prefill_rows": int(res["engine"].get("prefill_rows", 0)),
                   "prefill_computed_rows": int(res["engine"].get("prefill_computed_rows", 0)),
                   "publish_s_total": round(counters.get("rollway_weight_publish_seconds_sum", 0.0), 2),
                   "publish_s_mean": round(counters.get("rollway_weight_publish_seconds_sum", 0.0)
                                           / publish_n, 3) if publish_n else None,
                   "in_flight_mean": flight["mean"], "in_flight_idle_pct": flight["idle_pct"],
                   "in_flight_full_pct": flight["full_pct"]},
        "groups_failed": res["groups_failed"], "first_error": res["first_error"], "trainer_rc": res["trainer_rc"],
        "trainer_exited_early": res["trainer_exited_early"],
        "config": config,
    }


# --- TRL's side -------------------------------------------------------------------------------------------


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


def ratio_bound(a: float | None, b: float | None, budget: float) -> str | None:
    """When one side reached the threshold and the other did not within the budget: the bound on the ratio."""
    if a is not None and b is None:
        return f"<{a / budget:.3f}"
    if a is None and b is not None:
        return f">{budget / b:.3f}"
    return None


def spread(values: list[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4), "max": round(max(vals), 4),
            "n": len(vals)}


# --- report -----------------------------------------------------------------------------------------------


def config_rows(r: dict[str, Any] | None, t: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    c = (r or {}).get("config", {})
    k = (t or {}).get("config", {})

    def rw(fmt: str) -> str:
        return fmt.format(**c) if c else "-"

    def tr(fmt: str) -> str:
        return fmt.format(**k) if k else "-"

    return [
        ("learning rate", rw("{lr:g} constant, AdamW betas ({adam_beta1}, {adam_beta2}) wd {weight_decay}"),
         tr("{lr:g} {lr_schedule}, {optimizer} betas ({adam_betas[0]}, {adam_betas[1]}) wd {weight_decay}")),
        ("grad clip (norm)", rw("{max_grad_norm}"), tr("{max_grad_norm}")),
        ("ratio clip", rw("{clip_low} / {clip_high} around the proximal policy (decoupled PPO)"),
         tr("{clip[0]} / {clip[1]} ({loss_type}, {importance_sampling_level}-level)")),
        ("off-policy weight", rw("behaviour weight cap {behaviour_weight_cap} ({behaviour_weight_cap_mode}), "
                                 "eta {max_head_offpolicyness}"), tr("none (on-policy)")),
        ("loss aggregation", rw("{loss_agg}"), tr("{loss_type} (token mean over the batch)")),
        ("KL", rw("{kl_coef}"), tr("beta {beta_kl}")),
        ("advantage", rw("(r - group mean) / group std: adv_std_norm {adv_std_norm}"),
         tr("(r - group mean) / (group std + 1e-4): scale_rewards {scale_rewards}")),
        ("zero-std groups", rw("dynamic_filter {dynamic_filter}: dropped, replaced by more groups"),
         tr("kept in the batch (zero advantage)")),
        ("group size", f"{N_SAMPLES}" if c else "-", tr("{num_generations}")),
        ("batch / optimizer step", rw("{groups_per_step} groups x 8 = 64 samples, optimizer_steps {optimizer_steps}"),
         tr("{per_device_train_batch_size} completions (generation batch {generation_batch_size}), "
            "num_iterations {num_iterations}")),
        ("sampling", "T 1 (group policy), top_p 1, top_k off" if c else "-",
         tr("T {temperature}, top_p {top_p}, top_k {top_k}")),
        ("new tokens", "8 (agent max_tokens)" if c else "-", tr("{max_completion_length}")),
        ("precision", "float32" if c else "-", tr("{dtype}, bf16 {bf16}, gradient_checkpointing {gradient_checkpointing}")),
        ("processes / threads", f"trainer 1 rank + engine + gateway + runner, OMP_NUM_THREADS "
                                f"{(r or {}).get('omp_threads', '?')} each; engine batch <= {ENGINE_MAX_BATCH}, "
                                f"{GROUPS_IN_FLIGHT} groups in flight" if c else "-",
         tr("{processes} process, {torch_threads} torch threads, {generation}")),
        ("tasks", "file order, cycled" if c else "-", tr("shuffled ({shuffle_dataset})")),
        ("versions", "torch " + importlib.metadata.version("torch") if c else "-",
         tr("trl {trl}, transformers {transformers}, torch {torch}")),
    ]


def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def print_report(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    first_r = next((s["rollway"] for s in results if s.get("rollway")), None)
    first_t = next((s["trl"] for s in results if s.get("trl")), None)
    print("\nconfigurations")
    rows = config_rows(first_r, first_t)
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    print(f"  {'':<{w0}}  {'rollway':<{w1}}  TRL GRPOTrainer")
    for a, b, c in rows:
        print(f"  {a:<{w0}}  {b:<{w1}}  {c}")

    print(f"\nper seed (clock from the first rollout request; rolling {WINDOW_S:.0f} s mean training reward)")
    head = (f"  {'seed':>4} {'side':<7} {'order':>5} {'wall_s':>6} {'steps':>5} {'steps/s':>7} {'in/s':>6} "
            f"{'trained/s':>9} {'r_first':>7} {'r_max30':>7} {'r_end30':>7} {'t->0.3':>6} {'t->0.5':>6} "
            f"{'held-out':>13}  cpu %")
    print(head)
    for s in results:
        for side in ("rollway", "trl"):
            x = s.get(side)
            if not x:
                continue
            cpu = " ".join(f"{k} {v}" for k, v in x["cpu"].items())
            print(f"  {s['seed']:>4} {side:<7} {s['order'].index(side) + 1:>5} {x['wall_s']:>6.0f} {x['steps']:>5} "
                  f"{x['steps_per_s']:>7.3f} {x['samples_in_per_s']:>6.1f} {x['trained_per_s']:>9.1f} "
                  f"{fmt(x['reward_first3'], '.3f'):>7} {fmt(x['reward_window_max'], '.3f'):>7} "
                  f"{fmt(x['reward_window_end'], '.3f'):>7} {fmt(x['ttt_0.3'], '.0f'):>6} {fmt(x['ttt_0.5'], '.0f'):>6} "
                  f"{s['heldout_start']:>5.3f} -> {x['heldout_end']:.3f}  {cpu}")

    for s in results:
        if s.get("rollway") and s.get("trl"):
            print(f"  seed {s['seed']}: time ratio rollway / TRL "
                  + ", ".join(f"to {thr}: {fmt(s[f'ratio_ttt_{thr}'] or s[f'ratio_ttt_{thr}_bound'])}"
                              for thr in THRESHOLDS)
                  + f"; held-out end rollway {s['rollway']['heldout_end']:.3f}, TRL {s['trl']['heldout_end']:.3f}")
    for s in results:
        r, t = s.get("rollway"), s.get("trl")
        if r:
            e = r["engine"]
            print(f"\n  seed {s['seed']} rollway: trainer time per step (after the first; first at "
                  f"{fmt(r['first_step_s'])} s): " + ", ".join(f"{k} {fmt(v)}" for k, v in r["time_split"].items())
                  + "; on their own threads: " + ", ".join(f"{k} {fmt(v)}" for k, v in r["background_s"].items())
                  + f"; trainer set up in {r['trainer_start_s']} s before the clock")
            print(f"    filtered {r['filtered_frac']:.1%} of leased groups, {r['groups_stale_dropped']} dropped stale, "
                  f"staleness mean {fmt(r['staleness_mean'])} max {r['staleness_max']}, 429s {r['admission_429s']}, "
                  f"resubmits {r['resubmits']}, generated {r['generated_per_s']}/s, groups failed "
                  f"{r['groups_failed']}, trainer "
                  + ("EXITED BEFORE THE BUDGET (see trainer.log)" if r["trainer_exited_early"]
                     else "stopped at the budget"))
            print(f"    engine: paused {fmt(e['paused_pct'])}% and computing {fmt(e['busy_pct'])}% of the time, "
                  f"decode batch occupancy {fmt(e['decode_occupancy'])} of {ENGINE_MAX_BATCH} rows, prefill "
                  f"computed {e['prefill_computed_rows']} of {e['prefill_rows']} rows (identical prompts once); "
                  f"generations in flight (gateway) mean {e['in_flight_mean']}, none {e['in_flight_idle_pct']}% / "
                  f"full {e['in_flight_full_pct']}% of the time; publishes {e['publish_s_total']} s in all "
                  f"({fmt(e['publish_s_mean'])} s each, the engine paused within them)")
        if t:
            print(f"  seed {s['seed']} TRL ({t['threads']} threads; its last step ended {t['overshoot_s']} s past the "
                  f"budget and is not counted): time per step (after the first; first at {fmt(t['first_step_s'])} s): "
                  + ", ".join(f"{k} {fmt(v)}" for k, v in t["time_split"].items())
                  + f"; zero-std groups {fmt(t['zero_std_frac'], '.1%')}")

    busy = [f"seed {s['seed']} {side} {s[side]['cpu']['other']}%" for s in results for side in ("rollway", "trl")
            if s.get(side) and s[side]["cpu"].get("other", 0) > OTHER_WARN_PCT]
    if busy:
        print(f"\nWARNING: other work took more than {OTHER_WARN_PCT}% of the machine during: {', '.join(busy)}. "
              "Times are not comparable; rerun on a quiet machine.")

    if summary.get("across"):
        a = summary["across"]
        print(f"\nacross seeds {summary['seeds']} (median [min..max], n = seeds where both reached it)")
        for key, label in (("ratio_ttt_0.3", "time to 0.3, rollway / TRL"), ("ratio_ttt_0.5", "time to 0.5, rollway / TRL"),
                           ("heldout_end_rollway", "held-out end, rollway"), ("heldout_end_trl", "held-out end, TRL"),
                           ("heldout_gain_rollway", "held-out gain, rollway"), ("heldout_gain_trl", "held-out gain, TRL")):
            v = a[key]
            print(f"  {label:<28} {fmt(v['median'])} [{fmt(v['min'])}..{fmt(v['max'])}] n={v['n']}")
        for thr in THRESHOLDS:
            bounds = [f"seed {s['seed']} {s[f'ratio_ttt_{thr}_bound']}" for s in results
                      if s.get(f"ratio_ttt_{thr}_bound")]
            if bounds:
                print(f"  time to {thr}, rollway / TRL, one side only within the budget: {', '.join(bounds)}")
            for side in ("rollway", "trl"):
                v = a[f"ttt_{thr}_{side}"]
                print(f"  time to {thr}, {side:<8} {fmt(v['median'])} s [{fmt(v['min'])}..{fmt(v['max'])}] "
                      f"reached in {v['n']} of {a[f'seeds_{side}']} seeds")
        for side in ("rollway", "trl"):
            if a.get(f"cpu_{side}"):
                print(f"  CPU %, {side:<8} " + ", ".join(f"{k} {fmt(v['median'])} [{fmt(v['min'])}..{fmt(v['max'])}]"
                                                      for k, v in a[f"cpu_{side}"].items()))


def across(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for thr in THRESHOLDS:
        out[f"ratio_ttt_{thr}"] = spread([s.get(f"ratio_ttt_{thr}") for s in results])
    for side in ("rollway", "trl"):
        done = [s for s in results if s.get(side)]
        out[f"seeds_{side}"] = len(done)
        out[f"heldout_end_{side}"] = spread([s[side]["heldout_end"] for s in done])
        out[f"heldout_gain_{side}"] = spread([s[side]["heldout_end"] - s["heldout_start"] for s in done])
        for thr in THRESHOLDS:
            out[f"ttt_{thr}_{side}"] = spread([s[side][f"ttt_{thr}"] for s in done])
        if done:
            out[f"cpu_{side}"] = {k: spread([s[side]["cpu"].get(k) for s in done]) for k in done[0][side]["cpu"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (model, SFT, trainers; default 0)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"wall-clock seconds of RL for each side (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--work", type=Path, default=Path("runs/bench-loop"),
                        help="warm-up cache and per-seed run folders (default: %(default)s)")
    parser.add_argument("--eval-tasks", type=int, default=EVAL_TASKS, help=f"held-out tasks (default {EVAL_TASKS})")
    parser.add_argument("--trl-threads", type=int, default=CORES,
                        help=f"TRL's torch threads (default: every core, {CORES}). On a loaded machine threads "
                             "beyond the idle cores slow it down (each parallel region waits for its slowest thread)")
    parser.add_argument("--skip-trl", action="store_true", help="rollway's side only")
    parser.add_argument("--skip-rollway", action="store_true", help="TRL's side only")
    args = parser.parse_args()
    if args.budget <= WINDOW_S:
        parser.error(f"--budget must exceed the {WINDOW_S:.0f} s reward window")
    if not args.skip_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            parser.error("TRL is not installed: pip install -e '.[bench]' (or pass --skip-trl)")
    # SIGTERM unwinds like Ctrl-C, so every child (engine, gateway, trainer, TRL) is stopped on the way
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every child of rollway's side, as the demo
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tasks = load_tasks(agent_file("tasks/arithmetic.jsonl"))
    eval_tasks = load_tasks(agent_file("tasks/arithmetic_eval.jsonl"))[: args.eval_tasks]
    assert not {t["prompt"] for t in eval_tasks} & {t["prompt"] for t in tasks}, "held-out tasks overlap training"

    results = []
    for seed in args.seeds:
        model = warmed_up_model(work, seed, tasks)
        sdir = work / f"seed{seed}"
        sdir.mkdir(parents=True, exist_ok=True)
        s: dict[str, Any] = {"seed": seed, "model": str(model),
                             "order": ["rollway", "trl"] if seed % 2 == 0 else ["trl", "rollway"]}
        s["heldout_start"] = round(start_accuracy(model, sdir, eval_tasks), 4)
        log(f"seed {seed}: held-out greedy accuracy at the start {s['heldout_start']:.3f}")
        for side in s["order"]:
            if side == "rollway" and not args.skip_rollway:
                s["rollway"] = run_rollway(model, sdir, seed, args.budget, tasks, eval_tasks)
            elif side == "trl" and not args.skip_trl:
                s["trl"] = run_trl(model, sdir, seed, args.budget, eval_tasks, args.trl_threads)
            if s.get(side):
                x = s[side]
                log(f"seed {seed}: {side}: {x['steps']} steps, rolling reward max {fmt(x['reward_window_max'])}, "
                    f"t->0.3 {fmt(x['ttt_0.3'])} s, t->0.5 {fmt(x['ttt_0.5'])} s, held-out "
                    f"{s['heldout_start']:.3f} -> {x['heldout_end']:.3f}")
        if s.get("rollway") and s.get("trl"):
            for thr in THRESHOLDS:
                a, b = s["rollway"][f"ttt_{thr}"], s["trl"][f"ttt_{thr}"]
                s[f"ratio_ttt_{thr}"] = ratio(a, b)
                s[f"ratio_ttt_{thr}_bound"] = ratio_bound(a, b, args.budget)
        results.append(s)

    summary: dict[str, Any] = {"benchmark": "loop", "seeds": args.seeds, "budget_s": args.budget,
                               "window_s": WINDOW_S, "thresholds": list(THRESHOLDS), "cores": CORES,
                               "eval_tasks": len(eval_tasks), "clock": "first rollout request"}
    if len(results) > 1:
        summary["across"] = across(results)
    print_report(results, summary)
    summary["per_seed"] = results
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
