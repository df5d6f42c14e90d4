"""A publish over torch process groups end to end, with no filesystem shared between the trainer and the engines:
two `rollway engine` processes (each in a mount namespace where the trainer's folder is an empty tmpfs: it cannot
read a file of the trainer's), `rollway serve`, agents talking the whole time, and `rollway train --weight-sync
distributed`. Engine B is SIGKILLed in the middle of the first publish: no agent sees an error, A serves the new
version, B is out; B started again is kept out (its weights are not current) until the next publish sends it every
bucket, after which A and B generate the same greedy tokens (the same weights)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rollway.embedded import free_port, wait_healthy
from tests.e2e.procs import child_env

pytestmark = pytest.mark.slow
ADMIN = "rw-admin-weight-sync"
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return child_env(ROLLWAY_ADMIN_KEY=ADMIN, PYTHONPATH=str(REPO))


def _engine(home: Path, hidden: Path, port: int) -> subprocess.Popen[bytes]:
    """`rollway engine` on its own copy of the model, with `hidden` (the trainer's folder) covered by a tmpfs."""
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"',
           str(hidden), sys.executable, "-m", "rollway.cli", "engine", "--model", str(home / "model"), "--port", str(port)]
    return subprocess.Popen(cmd, cwd=home, env={**_env(), "TMPDIR": str(home)},
                            stdout=(home / "engine.log").open("ab"), stderr=subprocess.STDOUT)


def _train(home: Path, gateway: str, steps: int) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "rollway.cli", "train", "--gateway", gateway, "--model", str(home / "model"),
           "--out", str(home / "out"), "--nproc", "1", "--groups-per-step", "2", "--steps", str(steps), "--lr", "1e-3",
           "--wait-seconds", "5", "--max-head-offpolicyness", "100", "--weight-sync", "distributed",
           "--weight-sync-bucket-mb", "0.02", "--weight-sync-timeout", "20"]
    return subprocess.run(cmd, cwd=home, env={**_env(), "TMPDIR": str(home)}, timeout=600,
                          stdout=(home / "train.log").open("ab"), stderr=subprocess.STDOUT)


def _groups(admin: httpx.Client, n: int) -> None:
    for i in range(n):
        g = admin.post("/v1/groups", json={"task": {"i": i}, "n_samples": 4}).json()
        for j, cred in enumerate(g["sessions"]):
            client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=120)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}+{j}"}], max_tokens=4)
            admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": float(j % 2), "finish": True})


def _greedy(url: str) -> Any:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    return out["output_ids"], out["meta_info"]["weight_version"]


def _logged_errors(log: Path) -> str:
    """The gateway's logged tracebacks ("unexpected error" and what follows), for a failure's message."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    starts = [i for i, line in enumerate(lines) if "unexpected error" in line or "Traceback" in line]
    return "\n".join("\n".join(lines[i:i + 40]) for i in starts[:3]) or "(no traceback in the gateway's log)"


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_publish_over_process_groups_survives_a_killed_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs mount namespaces (unshare --mount) to hide the trainer's folder from the engines")
    homes = {name: tmp_path / name for name in ("trainer", "a", "b", "gateway")}
    for home in homes.values():
        shutil.copytree(tiny_model_dir, home / "model")
    ports = {"a": free_port(), "b": free_port()}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    engines = {k: _engine(homes[k], homes["trainer"], ports[k]) for k in ports}
    gw_port = free_port()
    gw_url = f"http://127.0.0.1:{gw_port}"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "serve", "--backend", urls["a"], "--backend", urls["b"], "--tokenizer",
         str(homes["gateway"] / "model"), "--port", str(gw_port), "--db", f"sqlite:///{homes['gateway'] / 'gw.db'}",
         "--data-dir", str(homes["gateway"] / "data")],
        cwd=homes["gateway"], env={**_env(), "ROLLWAY_HEALTH_INTERVAL_S": "1"},
        stdout=(homes["gateway"] / "gateway.log").open("ab"), stderr=subprocess.STDOUT)
    stop = threading.Event()
    errors: list[str] = []
    try:
        for k in ports:
            wait_healthy(urls[k], engines[k], timeout=180)
            mounts = Path(f"/proc/{engines[k].pid}/mountinfo").read_text()
            assert f" {homes['trainer']} " in mounts  # the trainer's folder is an empty tmpfs for this engine
        wait_healthy(gw_url, gateway, timeout=180)
        admin = httpx.Client(base_url=gw_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        _groups(admin, 2)
        talkers = admin.post("/v1/groups", json={"task": {"q": "talk"}, "n_samples": 6}).json()["sessions"]

        def agent(cred: dict[str, Any]) -> None:
            client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=120)
            while not stop.is_set():
                try:
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=16)
                except Exception as e:  # an agent-visible error: what this test counts
                    errors.append(f"{type(e).__name__}: {e}"[:300])

        agents = [threading.Thread(target=agent, args=(c,), daemon=True) for c in talkers]
        for t in agents:
            t.start()

        killed: dict[str, Any] = {}

        def killer() -> None:  # SIGKILL B once it has taken some buckets of the first publish and not all
            while not stop.is_set() and not killed:
                sync = admin.get("/v1/weights/sync").json()["sync"]
                for target in (sync or {}).get("targets", []):
                    b_id = next(x["id"] for x in admin.get("/v1/backends").json()["data"] if x["url"] == urls["b"])
                    if target["backend_id"] == b_id and target["stage"] == "buckets" and target["buckets_done"] >= 2:
                        engines["b"].send_signal(signal.SIGKILL)
                        killed.update(target)
                time.sleep(0.01)

        watcher = threading.Thread(target=killer, daemon=True)
        watcher.start()
        assert _train(homes["trainer"], gw_url, steps=1).returncode == 0, (homes["trainer"] / "train.log").read_text()
        watcher.join(5)
        assert killed, "engine B was not caught mid-update"
        engines["b"].wait(30)
        weights = admin.get("/v1/weights").json()
        assert weights == {"version": 1, "model_path": "distributed:v1"}
        assert not (homes["trainer"] / "out" / "weights").exists()  # nothing was written for a server to read
        backends = {b["url"]: b for b in admin.get("/v1/backends").json()["data"]}
        assert backends[urls["a"]]["healthy"] and backends[urls["a"]]["weight_version"] == "1"
        assert not backends[urls["b"]]["healthy"]
        assert _greedy(urls["a"])[1] == "1"
        time.sleep(2)
        assert errors == [], (errors[:5], _logged_errors(homes["gateway"] / "gateway.log"))

        # B again, on its starting weights: kept out of rotation until the next publish brings it a whole version.
        engines["b"] = _engine(homes["b"], homes["trainer"], ports["b"])
        wait_healthy(urls["b"], engines["b"], timeout=180)
        time.sleep(4)  # health rounds: it answers, but lacks version 1
        backends = {b["url"]: b for b in admin.get("/v1/backends").json()["data"]}
        assert not backends[urls["b"]]["healthy"] and "next catch-up or publish" in (backends[urls["b"]]["last_error"] or "")
        _groups(admin, 2)
        assert _train(homes["trainer"], gw_url, steps=2).returncode == 0, (homes["trainer"] / "train.log").read_text()
        assert admin.get("/v1/weights").json() == {"version": 2, "model_path": "distributed:v2"}
        _wait(lambda: all(b["healthy"] for b in admin.get("/v1/backends").json()["data"]), 30, "B back in rotation")
        out_a, out_b = _greedy(urls["a"]), _greedy(urls["b"])
        assert out_a == out_b and out_a[1] == "2"  # same weights on both: B got every bucket
        stop.set()
        for t in agents:
            t.join(120)
        assert errors == [], (errors[:5], _logged_errors(homes["gateway"] / "gateway.log"))
        turns = [t for c in talkers for t in admin.get(f"/v1/sessions/{c['session_id']}").json()["turns"]]
        versions = {v for t in turns for v in t["versions"]}
        assert versions <= {0, 1, 2} and {1, 2} <= versions
        print(f"\nkilled B after {killed['buckets_done']} buckets; {len(turns)} agent turns, 0 errors")
    finally:
        stop.set()
        for p in [gateway, *engines.values()]:
            if p.poll() is None:
                p.kill()
                p.wait()
