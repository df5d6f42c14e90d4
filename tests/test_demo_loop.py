"""The demo's RL loop (`rollway.demo.keep_groups_running`) and the hooks benchmarks/loop.py records it through:
the demo's arithmetic agent against a live gateway (a fake engine behind it), with a real process standing in
for the trainer. The loop's times are its injected clock's; a refused group is counted and the loop goes on; a
trainer still running at the deadline is stopped, one that exits ends the loop with its status."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollway.demo import N_SAMPLES, RLHooks, RLRun, arithmetic_runner, keep_groups_running
from rollway.rollout import Refused
from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway

GOOD = {"prompt": "12+30=", "answer": "42"}
TOO_LARGE = {"prompt": "1" * 20_000, "answer": "1"}  # over the gateway's body limit below: its group is refused


class Record(RLHooks):
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.events: list[tuple[Any, ...]] = []

    def started(self, t0: float) -> None:
        self.events.append(("started", t0))

    def group_done(self, t: float, rewards: list[float | None] | None, error: BaseException | None) -> None:
        self.events.append(("group", t, rewards, error))

    def polled(self, t: float) -> None:
        self.events.append(("polled", t))

    def ended(self, t_end: float) -> None:
        self.events.append(("ended", t_end))


def _loop(gateway: str, trainer: subprocess.Popen[bytes], tasks: list[dict[str, Any]], seconds: float,
          hooks: RLHooks) -> RLRun:
    async def go() -> RLRun:
        runner = arithmetic_runner(gateway, ADMIN_KEY)
        try:
            run = await keep_groups_running(runner, trainer, tasks, seconds, hooks)
            # the groups still running when it ended were cancelled and awaited: nothing of them is left running
            assert asyncio.all_tasks() == {asyncio.current_task()}
            return run
        finally:
            await runner.close()

    return asyncio.run(go())


def test_every_group_is_reported_at_the_clocks_time_and_the_trainer_stopped_at_the_deadline(
        tiny_model_dir: Path, sqlite_url: str) -> None:
    # One second a reading once a group has been rewarded (the deadline comes ~20 readings later, not 20 s), a
    # millisecond a reading before: the refused groups fail at once and are started again, and each of them takes
    # readings, so a busy machine could spend the 20 s before the first group of good tasks ends.
    now = [1000.0]
    hooks = Record()

    def clock() -> float:
        now[0] += 1.0 if any(e[0] == "group" and e[2] is not None for e in hooks.events) else 0.001
        return now[0]

    hooks.clock = clock
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with FakeSGLang(vocab=range(100, 1000)) as fake, \
                LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url,
                            max_body_bytes=16_384) as gw:
            run = _loop(gw.url, trainer, [GOOD, GOOD, TOO_LARGE], 20.0, hooks)
    finally:
        trainer.kill()
        trainer.wait()
    assert run.trainer_rc is None  # it was still running: the loop stopped it
    assert trainer.returncode == -signal.SIGTERM  # stopped by the loop (`stop`), not by the kill above
    ev = hooks.events
    assert ev[0] == ("started", run.t0) and 1000.0 < run.t0 < 1000.01
    assert ev[-1] == ("ended", run.t_end) and run.t_end >= run.t0 + 20.0
    groups = [e for e in ev if e[0] == "group"]
    polls = [e[1] for e in ev if e[0] == "polled"]
    assert polls == sorted(set(polls)) and all(run.t0 < t < run.t_end for t in polls)
    assert all(t in polls for _, t, _, _ in groups)  # each group at the reading of the poll that saw it end
    good = [rewards for _, _, rewards, error in groups if error is None]
    failed = [error for _, _, rewards, error in groups if error is not None]
    assert good and all(len(r) == N_SAMPLES and all(x in (0.0, 1.0) for x in r) for r in good)
    assert failed and all(isinstance(e, Refused) and e.status == 413 for e in failed)
    assert all(rewards is None for _, _, rewards, error in groups if error is not None)
    assert run.groups_failed == len(failed) and "413" in run.first_error


def test_a_trainer_that_exits_ends_the_loop_with_its_status(tiny_model_dir: Path, sqlite_url: str) -> None:
    hooks = Record()  # the real clock
    trainer = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(2); sys.exit(3)"])
    try:
        with FakeSGLang(vocab=range(100, 1000), token_delay=0.05) as fake, \
                LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
            run = _loop(gw.url, trainer, [GOOD], 600.0, hooks)
    finally:
        trainer.kill()
        trainer.wait()
    assert run.trainer_rc == 3 and run.groups_failed == 0 and run.first_error == ""
    assert run.t_end - run.t0 < 60  # not the 600 s deadline
    assert hooks.events[-1] == ("ended", run.t_end)
