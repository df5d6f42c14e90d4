"""Process helpers every layer uses: a free loopback port, a health wait, a liveness ping, a child that dies
with its parent (`die_with_parent`, Linux's PDEATHSIG) and a stop that escalates to SIGKILL. The standard
library only and nothing of ours, so that the trainer (`die_with_parent`, `free_port`) and the CLI share them
without the trainer importing the CLI's embedded-engine supervisor."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

# Loopback health checks never go through an HTTP proxy named in the environment (http_proxy without no_proxy
# would send them to the proxy, which cannot reach our 127.0.0.1).
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with code {proc.returncode} before it was ready")
        try:
            with _direct.open(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy within {timeout:.0f}s")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes Linux send `sig` to the child when this process dies, however it dies: a
    SIGKILL runs none of our cleanup, and the child would be re-parented to PID 1 and live on. None where
    there is no prctl (the child then outlives a killed parent, as before).

    Linux ties the signal to the thread that starts the child: start it from a thread that lives as long as
    the child should (the main thread, in our commands)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect: nobody will send it
            os.kill(os.getpid(), sig)

    return preexec


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ping(url: str, timeout: float = 2.0) -> bool:
    """Liveness (docs/architecture.md "Liveness"): GET /ping answers 200."""
    try:
        with _direct.open(f"{url}/ping", timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
