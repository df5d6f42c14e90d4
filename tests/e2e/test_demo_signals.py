"""`rollway demo` leaves no process behind: when it ends normally, and on SIGINT or SIGTERM while everything
runs (engine, gateway, `rollway train` with torchrun and its worker) or during its SFT warm-up.

Each run is a real, shortened demo (a few SFT steps, a few held-out tasks); every descendant is recorded
from /proc while it lives and must be gone once the demo has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.procs import Proc, Tree, default_sigint

pytestmark = [pytest.mark.slow,  # each run starts torchrun twice, the engine and the gateway: about a minute
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

# The demo waits for what it stops, so nothing should outlive it; a few seconds of slack only. (An orphaned
# trainer would die too, in time, of losing the stopped gateway: a generous bound would hide it.)
LEFT_BOUND_S = 5.0


def _demo(out: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "demo", "--out", str(out), "--sft-steps", "3", "--eval-tasks", "2",
         *extra],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}, "OMP_NUM_THREADS": "1"},
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, preexec_fn=default_sigint,
    )


def _rl_running(procs: list[Proc]) -> bool:
    """The engine, the gateway and the RL trainer's worker (under `rollway train`'s torchrun) all run."""
    cmds = [p.cmdline for p in procs]
    return (any(" engine " in c for c in cmds) and any(" serve " in c for c in cmds)
            and any("-m trainer.train" in c and "/train/config.json" in c and "trainer.torchrun" not in c
                    for c in cmds))


def _sft_running(procs: list[Proc]) -> bool:
    return any("-m trainer.train" in p.cmdline and "/sft/config.json" in p.cmdline
               and "trainer.torchrun" not in p.cmdline for p in procs)


def _is_trainer(p: Proc) -> bool:
    return "trainer.train" in p.cmdline or " train " in p.cmdline  # `rollway train`, torchrun, the worker


@pytest.mark.parametrize(("phase", "sig"), [("rl", signal.SIGTERM), ("rl", signal.SIGINT), ("sft", signal.SIGINT)],
                         ids=["rl-SIGTERM", "rl-SIGINT", "sft-SIGINT"])
def test_demo_signal_leaves_nothing_behind(phase: str, sig: signal.Signals, tmp_path: Path) -> None:
    proc = _demo(tmp_path / "demo", tmp_path / "demo.log", "--minutes", "5")
    tree = Tree(proc.pid)
    try:
        running = tree.wait_for(_rl_running if phase == "rl" else _sft_running, 240, f"the demo's {phase} phase",
                                root_alive=lambda: proc.poll() is None)
        proc.send_signal(sig)
        gone = tree.watch(120)
        rc = proc.wait(60)
        left = tree.left_behind(LEFT_BOUND_S)
        assert not left, f"left behind: {[p.cmdline for p in left]}\n{(tmp_path / 'demo.log').read_text()[-3000:]}"
        assert rc == (128 + signal.SIGTERM if sig == signal.SIGTERM else 130)
        if phase == "rl":
            # The trainer was stopped by the demo, before the gateway: not left to die later of losing it.
            trainer = max(gone[p.pid] for p in running if _is_trainer(p))
            gateway = min(gone[p.pid] for p in running if " serve " in p.cmdline)
            assert trainer < gateway, "the trainer outlived the gateway"
    finally:
        if proc.poll() is None:
            proc.kill()
        tree.kill_all()


def test_demo_normal_end_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = _demo(tmp_path / "demo", tmp_path / "demo.log", "--minutes", "1", "--steps", "1")
    tree = Tree(proc.pid)
    try:
        tree.wait_for(_rl_running, 240, "the demo's RL phase", root_alive=lambda: proc.poll() is None)
        while proc.poll() is None:  # record until it ends: later children must be seen too
            tree.record()
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        # 3 SFT steps leave the model scoring 0 everywhere: its groups are all filtered, so the run may train no
        # RL step, which the demo reports with exit 1 (issue 28); either way it ends on its own
        log = (tmp_path / "demo.log").read_text()
        assert proc.returncode == 0 or (proc.returncode == 1 and "no RL step trained" in log), log[-3000:]
        left = tree.left_behind(LEFT_BOUND_S)
        assert not left, f"left behind: {[p.cmdline for p in left]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        tree.kill_all()
