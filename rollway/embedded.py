"""The embedded default: the tiny model and a CPU engine process beside the gateway (no GPU, no network)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

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
