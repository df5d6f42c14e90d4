"""`rollway serve` with no --backend: the tiny model is created, a CPU engine starts beside the gateway,
an OpenAI client gets replies through it, and Ctrl-C stops both processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from rollway.embedded import free_port, wait_healthy


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_embedded_serve_and_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ROLLWAY_ADMIN_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        key = (tmp_path / "data" / "admin_key").read_text().strip()  # generated, stored, printed once
        group = httpx.post(f"{url}/v1/groups", json={"task": {}, "n_samples": 2},
                           headers={"Authorization": f"Bearer {key}"}).json()
        cred = group["sessions"][0]
        client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "12+34="}],
                                           max_tokens=5)
        assert r.usage.completion_tokens >= 1
        engines = _children(proc.pid)
        assert engines, "the engine runs as a child of the gateway"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert "admin key" in err and key in err
        time.sleep(0.5)
        for pid in engines:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_with_admin_key_into_a_new_data_dir(tmp_path: Path) -> None:
    """`serve --model DIR --data-dir NEW` with ROLLWAY_ADMIN_KEY set: the data folder (engine.log, the SQLite
    store) is made although no key is generated into it (it crashed with FileNotFoundError on engine.log)."""
    from engine.tiny_model import create_tiny_model

    model = create_tiny_model(tmp_path / "model", seed=0)
    data = tmp_path / "new" / "data"
    port = free_port()
    key = "rw-admin-test-" + "k" * 24
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "serve", "--port", str(port), "--model", str(model),
         "--data-dir", str(data)],
        env={**os.environ, "ROLLWAY_ADMIN_KEY": key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        r = httpx.post(f"{url}/v1/groups", json={"task": {}, "n_samples": 1}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 201, r.text
        assert (data / "engine.log").is_file()
        assert not (data / "admin_key").exists()  # the environment's key is used, none is generated
        assert data.stat().st_mode & 0o777 == 0o700
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
