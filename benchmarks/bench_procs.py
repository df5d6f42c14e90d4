"""Servers the benchmarks start: each in its own process group, logged to a file, always stopped; and the
CPU time of those processes, read from /proc (Linux).

Shared by benchmarks/gateway.py and benchmarks/pool.py; ports and health waits come from rollway.embedded.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Procs:
    """Servers started by a benchmark; `stop_all` removes every one (newest first)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
              code: Path = ROOT) -> subprocess.Popen[bytes]:
        """Run `cmd` from the checkout `code` (its working directory and PYTHONPATH; default this one)."""
        with open(self.logdir / f"{name}.log", "ab") as log:  # the child holds its own copy of the fd
            proc = subprocess.Popen(cmd, cwd=code, env={**os.environ, "PYTHONPATH": str(code), **(env or {})},
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


TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


# --- processes and their CPU ---------------------------------------------------------------------------


def proc_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (ppid, comm, cpu ticks of itself + its reaped children)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            data = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        head, _, rest = data.rpartition(")")
        f = rest.split()
        table[int(entry.name)] = (int(f[1]), head.partition("(")[2], sum(int(x) for x in f[11:15]))
    return table


def tree_ms(table: dict[int, tuple[int, str, int]], root: int) -> float:
    """CPU time of a process tree (utime + stime, itself and its reaped children) in clock ticks' resolution."""
    return sum(table[p][2] for p in tree_pids(table, root) if p in table) * TICK_MS


def tree_pids(table: dict[int, tuple[int, str, int]], root: int) -> set[int]:
    """`root` and its descendants in `table`."""
    pids, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (pp, _, _) in table.items() if pp == parent and p not in pids]
        pids.update(kids)
        frontier.extend(kids)
    return pids


def tree_run_ms(table: dict[int, tuple[int, str, int]], root: int) -> float:
    """CPU time of a process tree to the nanosecond: the sum of its live threads' run times (the first field
    of /proc/PID/task/TID/schedstat). `tree_ms` counts clock ticks (10 ms): over a step of a few ms of CPU
    it reads 0 or 10. A thread that has exited is no longer counted here (its CPU stays in `tree_ms`)."""
    total = 0
    for pid in tree_pids(table, root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e6


def postgres_ms(table: dict[int, tuple[int, str, int]], dbname: str | None) -> tuple[float, float]:
    """(all processes named postgres, only the backends connected to `dbname`)."""
    total = ours = 0.0
    for pid, (_, comm, ticks) in table.items():
        if comm != "postgres":
            continue
        total += ticks * TICK_MS
        if dbname:
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f" {dbname} " in title:
                ours += ticks * TICK_MS
    return total, ours


def machine_busy_ms() -> float:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) * TICK_MS  # all but idle and iowait


@dataclass
class Snapshot:
    server: float
    backend: float
    pg_all: float
    pg_ours: float
    wrk: float
    machine: float
    at: float

    @classmethod
    def take(cls, server: int, backend: int, dbname: str | None) -> Snapshot:
        table = proc_table()
        pg_all, pg_ours = postgres_ms(table, dbname)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk, once reaped
        return cls(tree_ms(table, server), tree_ms(table, backend), pg_all, pg_ours,
                   (usage.ru_utime + usage.ru_stime) * 1000, machine_busy_ms(), time.monotonic())
