"""The embedded default: the tiny model and a CPU engine process beside the gateway (no GPU, no network)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# The process helpers live in the leaf package (the trainer uses them too); the CLI, tests and benchmarks
# keep importing them from here.
from rollway_common.procs import die_with_parent, free_port, ping, stop, wait_healthy

__all__ = ["EngineSupervisor", "die_with_parent", "engine_environment", "engine_process", "ensure_tiny_model",
           "free_port", "ping", "stop", "wait_healthy"]


def ensure_tiny_model(data_dir: Path, seed: int = 0) -> Path:
    """The tiny model in data_dir/tiny-model, created on first use (seconds)."""
    out = data_dir / "tiny-model"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from engine.tiny_model import create_tiny_model

    print(f"creating the tiny model in {out} ...", file=sys.stderr)
    return create_tiny_model(out, seed=seed)


@contextlib.contextmanager
def engine_process(model_dir: Path, *, port: int | None = None, log_path: Path | None = None,
                   extra: list[str] | None = None, admin_api_key: str = "") -> Iterator[str]:
    """`rollway engine` as a child process; yields its URL; stops it on exit. `admin_api_key` goes to it in its
    environment (not its command line, which every local user can read): its admin routes take that key only."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "rollway.cli", "engine", "--model", str(model_dir), "--port", str(port),
           *(extra or [])]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    # SIGKILL when we die: the engine holds no state worth a graceful stop, and nothing else would stop it
    # when the gateway is killed outright (its own cleanup never runs then).
    env = engine_environment(os.environ)
    if admin_api_key:
        env["ROLLWAY_ENGINE_ADMIN_API_KEY"] = admin_api_key
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=die_with_parent(signal.SIGKILL))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)
        if log_path:
            log.close()  # type: ignore[union-attr]


# What the engine child inherits: the interpreter's, the libraries' (threads, Hugging Face, torch, CUDA) and
# the system's variables. Nothing else: the gateway's admin key and any other credential in our environment
# is no business of a process that serves tokens.
ENGINE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TEMP", "TMP",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "GLIBC_TUNABLES", "VIRTUAL_ENV", "CONDA_PREFIX", "SYSTEMROOT",
    "ROLLWAY_LOG_LEVEL",
})
ENGINE_ENV_PREFIXES = ("LC_", "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "HF_", "HUGGINGFACE_",
                       "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_",
                       "XDG_", "COVERAGE_", "MALLOC_")
_CREDENTIAL_WORDS = frozenset({"KEY", "KEYS", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD",
                               "CREDENTIAL", "CREDENTIALS", "AUTH"})


def engine_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` the engine child gets (ENGINE_ENV_NAMES, ENGINE_ENV_PREFIXES), less any variable whose
    name says it holds a credential (HF_TOKEN: the engine loads a local folder and never downloads)."""
    return {k: v for k, v in env.items()
            if (k in ENGINE_ENV_NAMES or k.startswith(ENGINE_ENV_PREFIXES))
            and _CREDENTIAL_WORDS.isdisjoint(k.upper().split("_"))}  # HF_TOKEN, not TOKENIZERS_PARALLELISM


class EngineSupervisor:
    """The embedded engine, kept running: started at once, watched from a thread of its own, restarted (with
    backoff) when its process exits or its liveness probe fails `misses` times in a row.

    Liveness is the policy of the gateway's pool and of compose (docs/architecture.md "Liveness"): the process, and
    `GET /ping`, which answers 200 while the gateway has the engine paused for a publish (`/health` would block
    then). A restarted engine serves its starting weights: attached to the gateway's pool (`attach`, from the app's
    lifespan), the supervisor takes it out of rotation the moment it sees the death, so the pool's `on_recover`
    loads the current weights before any request reaches the new process; `status()` is in `GET /ready`."""

    def __init__(self, model_dir: Path, *, port: int | None = None, log_path: Path | None = None,
                 extra: list[str] | None = None, probe_interval: float = 1.0, misses: int = 3,
                 backoff: tuple[float, float] = (1.0, 30.0), admin_api_key: str = "") -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [sys.executable, "-m", "rollway.cli", "engine", "--model", str(model_dir), "--port",
                     str(self.port), *(extra or [])]
        self._log_path = log_path
        self._admin_api_key = admin_api_key  # as engine_process: in the environment, never on the command line
        self._probe_interval, self._misses, self._backoff = probe_interval, misses, backoff
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.state = "starting"
        self.restarts = 0
        self.last_death: str | None = None
        self.last_restart_at: float | None = None
        self._died_at = 0.0
        self._loop: Any = None
        self._pool: Any = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL
        try:
            env = engine_environment(os.environ)
            if self._admin_api_key:
                env["ROLLWAY_ENGINE_ADMIN_API_KEY"] = self._admin_api_key
            return subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=die_with_parent(signal.SIGKILL))
        finally:
            if self._log_path:
                log.close()  # type: ignore[union-attr]

    def start(self, timeout: float = 180.0) -> str:
        """Start the engine and wait for it to answer; then watch it. Returns its URL."""
        self._thread = threading.Thread(target=self._watch, args=(timeout,), name="engine-supervisor", daemon=True)
        ready = threading.Event()
        failure: list[BaseException] = []
        self._ready, self._failure = ready, failure
        self._thread.start()  # the watcher starts every process: PDEATHSIG is tied to the thread that forks
        ready.wait()
        if failure:
            raise failure[0]
        return self.url

    def attach(self, loop: Any, pool: Any) -> None:
        """Tell the gateway's pool (on its event loop) of a death and of a restart."""
        self._loop, self._pool = loop, pool

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "restarts": self.restarts, "last_death": self.last_death,
                "last_restart_at": self.last_restart_at}

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(30)
        with self._lock:
            if self._proc is not None:
                stop(self._proc)

    # -- the watcher's thread ------------------------------------------------------------------------------------

    def _watch(self, timeout: float) -> None:
        try:
            with self._lock:
                self._proc = self._spawn()
            wait_healthy(self.url, self._proc, timeout)
        except BaseException as e:  # the first start fails the command, as before supervision
            self._failure.append(e)
            self._ready.set()
            return
        self.state = "running"
        self._ready.set()
        misses, delay = 0, self._backoff[0]
        while not self._stopping.wait(self._probe_interval):
            assert self._proc is not None
            code = self._proc.poll()
            if code is None:
                misses = 0 if ping(self.url) else misses + 1
                if misses < self._misses:
                    continue
                reason = f"no answer to GET /ping {misses} times in a row"
            else:
                reason = f"exited with code {code}"
            self._died(reason)
            misses = 0
            while not self._stopping.is_set():
                print(f"rollway serve: the embedded engine {reason}; restarting it in {delay:.0f}s "
                      f"(restart {self.restarts + 1})", file=sys.stderr, flush=True)
                if self._stopping.wait(delay):
                    return
                delay = min(delay * 2, self._backoff[1])
                if self._restart():
                    break
                reason = "failed to start again"
            else:
                return
            if self._stopping.is_set():
                return
            delay = self._backoff[0]

    def _died(self, reason: str) -> None:
        self.state, self.last_death, self._died_at = "restarting", reason, time.monotonic()
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()  # wedged: answers no probe
                self._proc.wait()
        if self._loop is not None and self._pool is not None:
            self._loop.call_soon_threadsafe(self._fail_backend, reason)

    def _restart(self) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            self._proc = self._spawn()
        try:
            wait_healthy(self.url, self._proc, 180.0)
        except (RuntimeError, TimeoutError) as e:
            print(f"rollway serve: the embedded engine did not come back: {e}", file=sys.stderr, flush=True)
            with self._lock:
                stop(self._proc)
            return False
        self.restarts += 1
        self.last_restart_at = time.time()
        self.state = "running"
        down = time.monotonic() - self._died_at
        print(f"rollway serve: the embedded engine is back at {self.url} (restart {self.restarts}, {down:.1f}s after "
              "it died); the gateway loads the current weights into it before routing to it", file=sys.stderr,
              flush=True)
        if self._loop is not None and self._pool is not None:
            self._loop.call_soon_threadsafe(self._admit)
        return True

    # -- on the gateway's event loop -----------------------------------------------------------------------------

    def _backends(self) -> list[Any]:
        return [b for b in self._pool.backends() if b.url == self.url]

    def _fail_backend(self, reason: str) -> None:
        for b in self._backends():
            self._pool.mark_failed(b, f"the embedded engine {reason}")

    def _admit(self) -> None:
        import asyncio

        task = asyncio.ensure_future(self._pool.admit(self._backends()))  # now, not at the next health round
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
