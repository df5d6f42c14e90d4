"""Process trees read from /proc (Linux), for tests that signal a command and check it left nothing behind.

A `Tree` records a command's descendants while they live: once the command is gone, an orphan is re-parented
(to PID 1 or a subreaper) and can no longer be found by walking down from the command, so it must have been
seen before. Each process is identified by pid and start time, so a pid reused later is not mistaken for it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    start: int
    """Start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    cmdline: str


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process; None once it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> dict[int, Proc]:
    """Every live (non-zombie) descendant of `root`, by pid."""
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[int, str, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                stats[int(entry)] = st
                children.setdefault(st[0], []).append(int(entry))
    found: dict[int, Proc] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        ppid_state_start = stats[pid]
        if ppid_state_start[1] != "Z":
            found[pid] = Proc(pid, ppid_state_start[2], _cmdline(pid))
        todo.extend(children.get(pid, []))
    return found


def alive(proc: Proc) -> bool:
    """Still running: same pid and start time, and not a zombie (a dead child its parent has not reaped)."""
    st = _stat(proc.pid)
    return st is not None and st[2] == proc.start and st[1] != "Z"


class Tree:
    """The descendants of `root`, every one ever recorded."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, Proc] = {}

    def record(self) -> list[Proc]:
        now = descendants(self.root)
        self.seen.update(now)
        return list(now.values())

    def wait_for(self, cond: Callable[[list[Proc]], bool], timeout: float, what: str,
                 root_alive: Callable[[], bool] | None = None) -> list[Proc]:
        """Record until `cond(current descendants)` holds; fail after `timeout` seconds or if the root ends."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.record()
            if cond(current):
                return current
            if root_alive is not None and not root_alive():
                raise AssertionError(f"the command ended before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; descendants: "
                                     f"{[p.cmdline for p in current]}")
            time.sleep(0.2)

    def left_behind(self, timeout: float) -> list[Proc]:
        """The recorded descendants still running after up to `timeout` seconds ([] as soon as all are gone)."""
        deadline = time.monotonic() + timeout
        while True:
            living = [p for p in self.seen.values() if alive(p)]
            if not living or time.monotonic() > deadline:
                return living
            time.sleep(0.2)

    def watch(self, timeout: float, interval: float = 0.05) -> dict[int, float]:
        """Watch the recorded descendants alive now until all are gone (or `timeout` seconds); returns pid ->
        when (time.monotonic) each was first seen gone, for tests of the order in which things stop."""
        watched = [p for p in self.seen.values() if alive(p)]
        gone: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(gone) < len(watched) and time.monotonic() < deadline:
            now = time.monotonic()
            gone.update((p.pid, now) for p in watched if p.pid not in gone and not alive(p))
            time.sleep(interval)
        return gone

    def kill_all(self) -> None:
        """Cleanup after a failed test: SIGKILL whatever recorded descendant is still running."""
        for p in self.seen.values():
            if alive(p):
                try:
                    os.kill(p.pid, 9)
                except OSError:
                    pass


def has(text: str) -> Callable[[list[Proc]], bool]:
    """At least one descendant's command line contains `text`."""
    return lambda procs: any(text in p.cmdline for p in procs)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a rollway process a test starts: this one's without any `ROLLWAY_*` setting (a
    developer's shell must not change what the test sees), one torch thread, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def default_sigint() -> None:
    """A `preexec_fn`: SIGINT back to its default in the child, as in a command started from a terminal. A test run
    started in the background by a non-interactive shell (`nohup ... &`) has SIGINT ignored, and every process
    it starts inherits that: Python then raises no KeyboardInterrupt, and a test of Ctrl-C would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
