"""`rollway serve` refuses what it cannot do before it starts or writes anything, and says plainly what it
waits for: a port in use, --backend without --tokenizer, a backend that never answers."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rollway.embedded import free_port
from tests.e2e.procs import child_env
from tests.fakes.sglang import FakeSGLang


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollway.cli", "serve", *args]


def test_port_in_use_fails_before_anything_starts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # No --backend: the embedded engine (and the tiny model it needs) would come first.
        r = subprocess.run(_serve("--port", str(port), "--data-dir", str(data)), env=child_env(),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"port {port}" in r.stderr and "already in use" in r.stderr, r.stderr
    assert not re.search(r"\bready\b", r.stderr) and "engine" not in r.stderr, r.stderr
    # Nothing created: no model, no database, no key, no engine log.
    assert not data.exists() or not any(data.iterdir()), list(data.iterdir())


def test_backend_without_tokenizer_fails_before_migrations(tmp_path: Path) -> None:
    db = tmp_path / "gw.db"
    r = subprocess.run(_serve("--backend", "http://127.0.0.1:9", "--db", f"sqlite:///{db}", "--port",
                              str(free_port()), "--data-dir", str(tmp_path / "data")),
                       env=child_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--tokenizer" in r.stderr, r.stderr
    assert not db.exists(), "the database was migrated before the command was refused"
    assert not (tmp_path / "data").exists()


def test_a_backend_that_never_answers_is_said_plainly(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend_port, port = free_port(), free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        _serve("--backend", backend, "--tokenizer", str(tiny_model_dir), "--port", str(port),
               "--data-dir", str(tmp_path / "data")),
        env=child_env(ROLLWAY_HEALTH_INTERVAL_S="0.5"), stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while "rollway serve: WARNING" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no warning within 60 s:\n{log.read_text()}"
            time.sleep(0.2)
        warning = next(line for line in log.read_text().splitlines() if "rollway serve: WARNING" in line)
        assert backend in warning and "GET /ready" in warning, warning
        assert "ready at" not in log.read_text()
        # It keeps serving: alive, not ready.
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 503
        with FakeSGLang(port=backend_port):  # the backend comes up: ready, and said so
            deadline = time.monotonic() + 20
            while "ready at" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert httpx.get(f"{url}/ready").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
