"""The embedded default: the tiny model and a CPU engine process beside the gateway (no GPU, no network)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


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
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
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
                   extra: list[str] | None = None) -> Iterator[str]:
    """`rollway engine` as a child process; yields its URL; stops it on exit."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "rollway.cli", "engine", "--model", str(model_dir), "--port", str(port),
           *(extra or [])]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)
        if log_path:
            log.close()  # type: ignore[union-attr]


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def admin_key(data_dir: Path) -> tuple[str, bool]:
    """ROLLWAY_ADMIN_KEY, else the key stored in data_dir (generated once). Returns (key, newly_generated)."""
    env = os.environ.get("ROLLWAY_ADMIN_KEY")
    if env:
        return env, False
    path = data_dir / "admin_key"
    if path.is_file():
        return path.read_text().strip(), False
    data_dir.mkdir(parents=True, exist_ok=True)
    key = "rw-admin-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, True
