"""rollway's side of benchmarks/loop.py: the demo's RL phase (`rollway.demo.keep_groups_running`, the loop
`rollway demo` runs) on the demo's stack, timestamped through the loop's hooks: each group's finish time and
rewards, CPU and engine counters at the clock's start and end; then its figures from the trainer's
metrics.jsonl, the gateway's and engine's /metrics and the store."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import sqlite3
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_procs import machine_busy_ms, proc_table, tree_ms
from loop_common import CORES, ENGINE_MAX_BATCH, log, pct, ratio, reward_figures, stack

from rollway.demo import (
    N_SAMPLES,
    RLHooks,
    _read_steps,
    arithmetic_runner,
    keep_groups_running,
    train_command,
)
from rollway.embedded import die_with_parent, stop
from rollway.rollout import run_async, run_eval

COUNTERS = ("rollway_admission_refused_total", "rollway_resubmits_total", "rollway_groups_dropped_stale_total",
            "rollway_weight_publish_seconds_sum", "rollway_weight_publish_seconds_count")


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


# --- the run ----------------------------------------------------------------------------------------------


class _Clock(RLHooks):
    """What benchmarks/loop.py records of the demo's loop: CPU and the engine's counters at the clock's start and
    end, and each finished group's time, sessions rewarded and reward sum."""

    def __init__(self, roots: dict[str, int], engine_url: str) -> None:
        super().__init__()
        self.roots, self.engine_url = roots, engine_url
        self.groups: list[tuple[float, int, float]] = []  # (finish time, sessions rewarded, reward sum)

    def started(self, t0: float) -> None:
        self.cpu0 = cpu_snapshot(self.roots)
        self.engine0 = scrape(self.engine_url, "rollway_engine_")

    def group_done(self, t: float, rewards: list[float | None] | None, error: BaseException | None) -> None:
        if rewards is not None:
            scored = [r for r in rewards if r is not None]
            self.groups.append((t, len(scored), sum(scored)))

    def ended(self, t_end: float) -> None:
        self.cpu1 = cpu_snapshot(self.roots)
        self.engine1 = scrape(self.engine_url, "rollway_engine_")


async def drive_rollway(gateway: str, key: str, trainer: subprocess.Popen[bytes], budget: float,
                        tasks: list[dict[str, Any]], eval_tasks: list[dict[str, Any]],
                        servers: dict[str, int], engine_url: str) -> dict[str, Any]:
    """The demo's RL loop (`keep_groups_running`) with the trainer just set up, for the budget (counted from the
    first group requested) or until the trainer exits, timestamped through its hooks; then (the trainer stopped)
    the held-out eval on the live stack."""
    runner = arithmetic_runner(gateway, key)
    clock = _Clock({**servers, "trainer": trainer.pid}, engine_url)
    try:
        run = await keep_groups_running(runner, trainer, tasks, budget, clock)
        version = await runner.weight_version()
        end = await run_eval(runner, eval_tasks, 1, version)
    finally:
        await runner.close()
    engine = {k.removeprefix("rollway_engine_").removesuffix("_total"): clock.engine1[k] - clock.engine0.get(k, 0.0)
              for k in clock.engine1}
    return {"t0": run.t0, "t_end": run.t_end, "cpu": cpu_shares(clock.cpu0, clock.cpu1, run.t_end - run.t0),
            "groups": clock.groups, "engine": engine, "groups_failed": run.groups_failed,
            "first_error": run.first_error, "trainer_rc": trainer.returncode,
            "trainer_exited_early": run.t_end < run.t0 + budget - 1.0,
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
        # rollway/demo.py's train command (--nproc 1 and --steps 0: the demo's defaults)
        train_cmd = train_command(gateway, model, wd / "train", seed=seed)
        log(f"seed {seed}: rollway for {budget:.0f} s (engine + gateway up, trainer starting)")
        # as the demo: SIGTERM if this process dies however it dies; `rollway train` then stops torchrun
        with open(wd / "trainer.log", "ab") as tlog:
            trainer = subprocess.Popen(train_cmd, env=env, stdout=tlog, stderr=subprocess.STDOUT,
                                       preexec_fn=die_with_parent(signal.SIGTERM))
        try:
            started = wait_trainer_ready(wd / "trainer.log", trainer)
            log(f"seed {seed}: trainer ready after {started:.1f} s (model loaded, about to lease); clock starts")
            res = run_async(drive_rollway(gateway, key, trainer, budget, tasks, eval_tasks, servers, engine_url))
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
