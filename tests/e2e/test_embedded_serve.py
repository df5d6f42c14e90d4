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
