"""The runner's CPU per session: the process that hosts the agent (`rollway.rollout.Runner`, as `rollway demo` and
`rollway rollout` run it) on asyncio's default event loop and on uvloop's.

A CPU engine on a fresh tiny model and a gateway on SQLite are started once; then, in rounds that alternate
the loop (default, uvloop, default, ...), this process runs the arithmetic agent (agents/arithmetic.py, the
OpenAI SDK) through the gateway, `--groups` groups of 8 with 24 in flight, in a fresh event loop each round.
Each round's figure is this process's CPU time (user + system, all threads) per session; the table gives the
median per loop over the rounds and the ratio.

    python benchmarks/runner.py                 # 3 rounds per loop, 96 groups each (~3 min on 2 cores)
    python benchmarks/runner.py --rounds 1 --groups 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `engine` is the package, not benchmarks/engine.py

from loop import stack

from engine.tiny_model import create_tiny_model
from rollway.demo import GROUPS_IN_FLIGHT, N_SAMPLES
from rollway.rollout import Runner, event_loop_factory, load_agent, load_tasks
from rollway_common.paths import agent_file


async def drive(gateway: str, key: str, tasks: list[dict[str, Any]], groups: int) -> tuple[int, float, float]:
    """(sessions, CPU seconds of this process, wall seconds) for `groups` groups, GROUPS_IN_FLIGHT at a time."""
    runner = Runner(gateway, key, load_agent(agent_file("arithmetic.py")), concurrency=GROUPS_IN_FLIGHT * N_SAMPLES)
    sem = asyncio.Semaphore(GROUPS_IN_FLIGHT)

    async def one(i: int) -> int:
        async with sem:
            return sum(r is not None for r in await runner.run_group(tasks[i % len(tasks)], N_SAMPLES))

    try:
        await one(0)  # connections and the agent's first call out of the timed window
        c0, t0 = time.process_time(), time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(1, groups + 1)))
        return sum(done), time.process_time() - c0, time.perf_counter() - t0
    finally:
        await runner.close()


def run(factory: Callable[[], asyncio.AbstractEventLoop] | None, *args: Any) -> tuple[int, float, float]:
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(drive(*args))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per event loop (default 3)")
    ap.add_argument("--groups", type=int, default=96, help="groups of 8 per round (default 96)")
    args = ap.parse_args()
    uv = event_loop_factory()
    if uv is None:
        raise SystemExit("uvloop is not installed: nothing to compare")
    loops: dict[str, Callable[[], asyncio.AbstractEventLoop] | None] = {"asyncio": None, "uvloop": uv}
    tasks = load_tasks(str(Path(__file__).resolve().parent.parent / "agents" / "tasks" / "arithmetic.jsonl"))
    per: dict[str, list[float]] = {name: [] for name in loops}
    with tempfile.TemporaryDirectory(prefix="rollway-bench-runner-") as tmp:
        model = create_tiny_model(Path(tmp) / "model", seed=0)
        key = "rw-admin-" + secrets.token_urlsafe(24)
        with stack(model, Path(tmp), key) as (gateway, _, _):
            for rnd in range(args.rounds):
                for name, factory in loops.items():
                    sessions, cpu, wall = run(factory, gateway, key, tasks, args.groups)
                    per[name].append(1000 * cpu / max(1, sessions))
                    print(f"round {rnd + 1} {name:8s} {sessions} sessions in {wall:.1f} s: "
                          f"{per[name][-1]:.3f} ms of the runner's CPU per session", flush=True)
    med = {name: statistics.median(v) for name, v in per.items()}
    print(f"\n{'event loop':12s} {'runner CPU ms/session (median)':>32s}")
    for name, v in med.items():
        print(f"{name:12s} {v:32.3f}")
    print(f"uvloop / asyncio: {med['uvloop'] / med['asyncio']:.3f}")
    print(json.dumps({"benchmark": "runner", "rounds": args.rounds, "groups": args.groups,
                      "cpu_ms_per_session": {k: round(v, 4) for k, v in med.items()},
                      "per_round": per, "ratio_uvloop": round(med["uvloop"] / med["asyncio"], 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
