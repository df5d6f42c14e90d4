"""Servers the benchmarks start: each in its own process group, logged to a file, always stopped.

Shared by benchmarks/gateway.py and benchmarks/pool.py; ports and health waits come from rollway.embedded.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Procs:
    """Servers started by a benchmark; `stop_all` removes every one (newest first)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.logdir / f"{name}.log", "ab") as log:  # the child holds its own copy of the fd
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""
