"""Held-out accuracy at the end of a `benchmarks/loop.py` run, rollway against TRL, task by task.

`loop.py` reports each side's greedy accuracy on the 200 held-out tasks. Two accuracies a few tasks apart say
little on their own: this script evaluates, per seed, the weights each side ended with (rollway's last
published version, `WORK/seed<s>/rollway/train/weights/`, and TRL's `WORK/seed<s>/trl/final/`) on the same
tasks, greedy, each in a fresh CPU engine + gateway (`loop_common.heldout`'s stack), and pairs the answers: tasks both
got right, only rollway, only TRL, neither. The difference (rollway - TRL) comes with an exact two-sided
McNemar p-value (binomial on the discordant tasks) and a 95% interval (Wilson's, on the discordant split,
mapped to the difference); pooled over the seeds too.

    python benchmarks/heldout_paired.py --seeds 0 1 2          # after `python benchmarks/loop.py --seeds 0 1 2`
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `engine` is the package, not benchmarks/engine.py

from loop_common import stack

from rollway.demo import EVAL_TASKS, GROUPS_IN_FLIGHT, N_SAMPLES
from rollway.rollout import Runner, load_agent, load_tasks, run_async
from rollway_common.paths import agent_file


def per_task(model: Path, wd: Path, tasks: list[dict[str, Any]]) -> list[bool]:
    """Greedy, one sample per task, as `run_eval` with k = 1: whether each task's answer earned a reward > 0."""
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    key = "rw-admin-" + secrets.token_urlsafe(24)
    with stack(model, wd, key) as (gateway, _, _):
        async def go() -> list[bool]:
            import asyncio

            runner = Runner(gateway, key, load_agent(agent_file("arithmetic.py")),
                            concurrency=GROUPS_IN_FLIGHT * N_SAMPLES)
            try:
                rewards = await asyncio.gather(*(runner.run_group(t, 1, eval_group=True, sampling={"temperature": 0.0})
                                                 for t in tasks))
                return [any((r or 0) > 0 for r in rs) for rs in rewards]
            finally:
                await runner.close()

        return list(run_async(go()))


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n at p = 1/2 (McNemar's exact test on discordant pairs)."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def paired(a: list[bool], b: list[bool]) -> dict[str, Any]:
    """a = rollway, b = TRL, on the same tasks."""
    both = sum(x and y for x, y in zip(a, b, strict=True))
    only_a = sum(x and not y for x, y in zip(a, b, strict=True))
    only_b = sum(y and not x for x, y in zip(a, b, strict=True))
    n, d = len(a), only_a + only_b
    lo, hi = wilson(only_a, d)  # share of the discordant tasks that rollway got: difference = d / n * (2 share - 1)
    return {"tasks": n, "both": both, "only_rollway": only_a, "only_trl": only_b, "neither": n - both - d,
            "rollway": round((both + only_a) / n, 4), "trl": round((both + only_b) / n, 4),
            "diff": round((only_a - only_b) / n, 4),
            "diff_95": [round(d / n * (2 * lo - 1), 4), round(d / n * (2 * hi - 1), 4)],
            "p_mcnemar": round(binom_two_sided(only_a, d), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--work", default="runs/bench-loop", help="loop.py's --work (default runs/bench-loop)")
    ap.add_argument("--eval-tasks", type=int, default=EVAL_TASKS)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    tasks = load_tasks(agent_file("tasks/arithmetic_eval.jsonl"))[: args.eval_tasks]
    rows, pooled_a, pooled_b = [], [], []
    for seed in args.seeds:
        sdir = work / f"seed{seed}"
        versions = sorted((sdir / "rollway" / "train" / "weights").glob("v*"))
        trl = sdir / "trl" / "final"
        if not versions or not (trl / "config.json").is_file():
            raise SystemExit(f"seed {seed}: no finished loop.py run in {sdir} (rollway weights, trl/final)")
        a = per_task(versions[-1], sdir / "paired-rollway", tasks)
        b = per_task(trl, sdir / "paired-trl", tasks)
        pooled_a += a
        pooled_b += b
        rows.append({"seed": seed, "rollway_weights": versions[-1].name, **paired(a, b)})
    rows.append({"seed": "pooled", **paired(pooled_a, pooled_b)})
    print(f"\n{'seed':>7s} {'tasks':>5s} {'both':>5s} {'only rw':>7s} {'only TRL':>8s} {'neither':>7s} "
          f"{'rollway':>7s} {'TRL':>6s} {'diff':>7s} {'95% interval':>17s} {'p':>6s}")
    for r in rows:
        lo, hi = r["diff_95"]
        print(f"{r['seed']!s:>7s} {r['tasks']:5d} {r['both']:5d} {r['only_rollway']:7d} {r['only_trl']:8d} "
              f"{r['neither']:7d} {r['rollway']:7.3f} {r['trl']:6.3f} {r['diff']:+7.3f} "
              f"[{lo:+.3f}, {hi:+.3f}] {r['p_mcnemar']:6.3f}")
    print(json.dumps({"benchmark": "heldout_paired", "work": str(work), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
