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
  training tasks for the demo's fixed 900 steps, at most 300 s), cached in WORK/warmup-seed<seed>/ (the
  layout benchmarks/async.py uses). Its held-out greedy accuracy (below) is measured once and cached.
- rollway: the demo's RL phase: a CPU engine (--max-batch-size 64) and a gateway on a fresh SQLite store, the
  arithmetic agent (agents/arithmetic.py, the OpenAI SDK) through the gateway via `Runner.run_group`, 24
  groups of 8 in flight, tasks in file order, and `rollway train` under torchrun (1 rank) with the demo's
  flags: 8 groups x 8 samples a step, lr 1e-4, advantages / group std, eta 2, wait 5 s, checkpoint every 50;
  every process OMP_NUM_THREADS=1, as the demo. The loop is the demo's own (rollway.demo.keep_groups_running),
  timestamped through its hooks (benchmarks/loop_rollway.py). The trainer is started first and the clock
  starts when it says it is set up (model and optimizer loaded, about to lease: `trainer: 1 rank(s) on cpu` in
  its log) and the first group is requested: neither side's process start and model load is counted (the demo
  starts its trainer before its held-out eval, so there too its start-up is off the RL clock). The trainer is
  stopped at the budget.
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
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `engine`/`trainer` are the packages, not benchmarks/engine.py, trainer.py

from loop_common import CORES, THRESHOLDS, WINDOW_S, log, ratio, start_accuracy, warmed_up_model  # noqa: E402
from loop_report import across, fmt, print_report, ratio_bound  # noqa: E402
from loop_rollway import run_rollway  # noqa: E402
from loop_trl import run_trl  # noqa: E402

from rollway.demo import EVAL_TASKS  # noqa: E402
from rollway.rollout import load_tasks  # noqa: E402
from rollway_common.paths import agent_file  # noqa: E402

DEFAULT_BUDGET_S = 400.0  # the demo's RL phase: 570 s in all, less SFT (~1.5-2 min), evals and the end reserve


def main() -> int:
    # The demo's environment (rollway/demo.py): idle OpenMP threads sleep rather than spin, so a busy machine does
    # not slow every torch step of the warm-up, the engine and both sides' trainers ~10x. Both sides inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
