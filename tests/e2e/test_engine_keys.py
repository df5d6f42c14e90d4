"""`rollway serve`'s embedded engine takes its admin routes from the gateway only (issue 29 item 12): another
local user who finds its port gets 401 on /pause_generation (which once hung every chat until someone sent
/continue_generation), while the gateway's chats and publishes work; the key is in neither process's command
line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollway.embedded import free_port, wait_healthy
from tests.e2e.procs import Tree, child_env, default_sigint, has
from tests.harness import ADMIN_KEY

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_embedded_engine_refuses_other_local_users(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--data-dir", str(tmp_path / "data")],
        env=child_env(ROLLWAY_ADMIN_KEY=ADMIN_KEY), stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "wb"), preexec_fn=default_sigint)
    tree = Tree(proc.pid)
    url = f"http://127.0.0.1:{port}"
    try:
        (engine,) = tree.wait_for(has(" engine "), 60, "the engine", root_alive=lambda: proc.poll() is None)
        engine_port = re.search(r"--port (\d+)", engine.cmdline)
        assert engine_port, engine.cmdline
        engine_url = f"http://127.0.0.1:{engine_port.group(1)}"
        wait_healthy(url, proc, timeout=180)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        # another local user: no key, a guess, or even the gateway's own admin key
        for headers in ({}, {"Authorization": "Bearer guess"}, admin):
            for path in ("/pause_generation", "/abort_request", "/update_weights_from_disk"):
                r = httpx.post(f"{engine_url}{path}", json={"mode": "abort", "rid": "", "model_path": "/x"},
                               headers=headers, timeout=30)
                assert r.status_code == 401, (path, r.status_code, r.text)
        assert httpx.get(f"{engine_url}/health", timeout=30).status_code == 200  # probes stay open
        environ = Path(f"/proc/{engine.pid}/environ").read_bytes().decode()
        key = re.search(r"ROLLWAY_ENGINE_ADMIN_API_KEY=([^\0]+)", environ)
        assert key and key.group(1) not in engine.cmdline and key.group(1) not in (tmp_path / "serve.log").read_text()
        # the gateway itself holds the key: a chat, then a publish (pause, load, continue)
        group = httpx.post(f"{url}/v1/groups", json={"task": {}, "n_samples": 1}, headers=admin, timeout=30).json()
        cred = group["sessions"][0]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {cred['api_key']}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/weights", json={"version": 1, "model_path": str(tiny_model_dir)}, headers=admin,
                       timeout=120)
        assert r.status_code == 200 and r.json()["failed_backends"] == {}, r.text
    finally:
        proc.kill()
        proc.wait()
        tree.kill_all()
