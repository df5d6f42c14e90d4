"""A server that joins after a publish over process groups gets the current weights from the trainer's catch-up,
without a new version: real `rollway engine` and `rollway serve` processes, the trainer's side here (rank 0 of a
gloo group per server, the `CatchUp` thread as `rollway train --weight-sync distributed` runs it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from rollway.embedded import free_port, wait_healthy
from tests.e2e.procs import child_env
from trainer.client import GatewayClient
from trainer.weight_sync import CatchUp, SyncOptions, SyncPayload

ADMIN = "rw-admin-catch-up"
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return child_env(ROLLWAY_ADMIN_KEY=ADMIN, PYTHONPATH=str(REPO))


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rollway.cli", *cmd], env={**_env(), **env},
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _greedy(url: str) -> tuple[list[int], str]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    return out["output_ids"], out["meta_info"]["weight_version"]


def test_a_server_added_after_a_publish_gets_the_current_weights_by_catch_up(tmp_path: Path,
                                                                              tiny_model_dir: Path) -> None:
    ports = {"a": free_port(), "b": free_port(), "gw": free_port()}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    watch: CatchUp | None = None
    try:
        procs["a"] = _start(["engine", "--model", str(tiny_model_dir), "--port", str(ports["a"])], tmp_path / "a.log")
        procs["b"] = _start(["engine", "--model", str(tiny_model_dir), "--port", str(ports["b"])], tmp_path / "b.log")
        procs["gw"] = _start(["serve", "--backend", urls["a"], "--tokenizer", str(tiny_model_dir), "--port",
                              str(ports["gw"]), "--db", f"sqlite:///{tmp_path / 'gw.db'}", "--data-dir",
                              str(tmp_path / "data")], tmp_path / "gw.log", ROLLWAY_HEALTH_INTERVAL_S="0.5")
        for k in ("a", "b", "gw"):
            wait_healthy(urls[k], procs[k], timeout=180)
        start_b = _greedy(urls["b"])

        # A step's weights (changed so that the greedy tokens change), published over a gloo group to A.
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        client = GatewayClient(urls["gw"], ADMIN, timeout=60)
        watch = CatchUp(client, 0.5)
        payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="gloo", bucket_bytes=50_000,
                                                                        timeout=30, catch_up=watch))
        assert payload.publish(client, 1, [], {}) == 1
        on_a = _greedy(urls["a"])
        assert on_a[1] == "1" and on_a[0] != start_b[0]

        # B joins now: no folder to load version 1 from, so it is kept out and listed as awaiting it...
        admin = httpx.Client(base_url=urls["gw"], headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        added = admin.post("/v1/backends", json={"url": urls["b"]})
        assert added.status_code == 201 and added.json()["healthy"] is False, added.text
        assert admin.get("/v1/weights/sync").json()["awaiting_backends"] == [added.json()["id"]]
        # ...until the trainer's catch-up thread sends it the version it published.
        t0 = time.monotonic()
        watch.start()
        while not all(b["healthy"] for b in admin.get("/v1/backends").json()["data"]):
            assert time.monotonic() - t0 < 60, (tmp_path / "gw.log").read_text()[-3000:]
            time.sleep(0.2)
        assert watch.caught_up == 1
        assert _greedy(urls["b"]) == on_a  # the same weights as A, and it says version 1
        assert admin.get("/v1/weights").json() == {"version": 1, "model_path": "distributed:v1"}
        assert admin.get("/v1/weights/sync").json()["awaiting_backends"] == []
        print(f"\nB served version 1 {time.monotonic() - t0:.2f} s after the catch-up thread started")
    finally:
        if watch is not None:
            watch.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
