"""The tensor path end to end (`--weight-sync tensor`, trainer/tensor_sync.py, gateway/weight_sync.py,
engine/tensor_sync.py): real `rollway engine` and `rollway serve` processes on this machine.

- A publish by `SyncPayload` with `backend="tensor"` (what `rollway train` sends), both ways: copied into
  flattened buckets, then the model's own parameters handed out as named tensors (`LiveWeights`): each time both
  engines serve the new version with exactly the trainer's weights (the same greedy tokens as an engine that loads
  those weights from an HF folder), and nothing is written to disk.
- A trainer that says it runs on another machine (its `host_id`) is refused with a clear 400, nothing published;
  `is_local` tells this host's addresses from others.
- `rollway train --weight-sync tensor --release-kv-cache` trains and publishes two steps (one rank: its parameters
  handed out as they are, the second step's optimizer waiting for the first publish); the servers' KV cache is
  released for each step and taken back (the step's `kv_cache_released_s`), and generation goes on after."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from rollway.embedded import free_port, wait_healthy
from tests.e2e.procs import child_env

pytestmark = pytest.mark.slow
ADMIN = "rw-admin-tensor-sync"
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return child_env(ROLLWAY_ADMIN_KEY=ADMIN, PYTHONPATH=str(REPO))


def _engine(home: Path, model: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rollway.cli", "engine", "--model", str(model), "--port", str(port)],
                            cwd=home, env=_env(), stdout=(home / f"engine{port}.log").open("ab"),
                            stderr=subprocess.STDOUT)


def _greedy(url: str) -> Any:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    return out["output_ids"], out["meta_info"]["weight_version"]


@pytest.fixture
def stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    ports = [free_port(), free_port(), free_port()]  # a, b behind the gateway; c alone (loads from disk)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [_engine(tmp_path, tiny_model_dir, p) for p in ports]
    gw_port = free_port()
    gw_url = f"http://127.0.0.1:{gw_port}"
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "serve", "--backend", urls[0], "--backend", urls[1], "--tokenizer",
         str(tiny_model_dir), "--port", str(gw_port), "--db", f"sqlite:///{tmp_path / 'gw.db'}", "--data-dir",
         str(tmp_path / "data")],
        cwd=tmp_path, env={**_env(), "ROLLWAY_HEALTH_INTERVAL_S": "1"},
        stdout=(tmp_path / "gateway.log").open("ab"), stderr=subprocess.STDOUT))
    try:
        for url, proc in zip([*urls, gw_url], procs, strict=True):
            wait_healthy(url, proc, timeout=180)
        yield {"urls": urls, "gateway": gw_url, "home": tmp_path, "model": tiny_model_dir}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_tensor_publish_serves_the_trainers_weights_and_other_machines_are_refused(stack: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from gateway.weight_sync import is_local
    from trainer import checkpoint
    from trainer.client import GatewayClient
    from trainer.weight_sync import SyncOptions, SyncPayload

    a, b, c = stack["urls"]
    client = GatewayClient(stack["gateway"], ADMIN, timeout=120)
    before = _greedy(a)
    model = AutoModelForCausalLM.from_pretrained(str(stack["model"]), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # "a step": new values everywhere
    payload = SyncPayload.gather(model, stack["model"], SyncOptions(backend="tensor", bucket_bytes=60_000, timeout=60))
    assert len(payload.buckets) > 2
    assert payload.publish(client, 1, [], {}) == 1
    assert payload.last["answer"]["failed_backends"] == {} and len(payload.last["answer"]["backends"]) == 2
    assert client.current_weights() == (1, "distributed:v1")
    folder = checkpoint.export_hf(model, stack["model"], stack["home"] / "reference")  # the same weights, by disk
    r = httpx.post(c + "/update_weights_from_disk", json={"model_path": str(folder), "weight_version": "1"}, timeout=60)
    assert r.json()["success"], r.text
    after = _greedy(c)
    assert after[0] != before[0]
    assert _greedy(a) == _greedy(b) == after

    # a trainer on another machine: refused before anything is paused or published
    admin = httpx.Client(base_url=stack["gateway"], headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    r = admin.post("/v1/weights/sync/init", json={"version": 2, "master_address": "127.0.0.1", "backend": "tensor",
                                                  "host_id": "another-machine"})
    assert r.status_code == 400 and "needs the trainer on the servers' machine" in r.text, r.text
    r = admin.post("/v1/weights/sync/init", json={"version": 2, "master_address": "127.0.0.1", "backend": "tensor"})
    assert r.status_code == 400 and "(none)" in r.text
    assert client.current_weights() == (1, "distributed:v1")
    assert asyncio.run(is_local("http://127.0.0.1:1")) and asyncio.run(is_local("http://localhost:1"))
    assert not asyncio.run(is_local("http://192.0.2.1:1"))  # TEST-NET-1: no host's own address

    # one trainer rank on CPU: the parameters themselves, no copy; the servers read them before the next step
    from trainer.tensor_sync import LiveWeights

    live = LiveWeights()
    live.before_step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    opts = SyncOptions(backend="tensor", bucket_bytes=60_000, timeout=60, live=live)
    payload = SyncPayload.gather(model, stack["model"], opts)
    assert payload.live is live and payload.load_format is None
    assert payload.publish(client, 2, [], {}) == 2 and live.readers == 0
    assert payload.last["answer"]["failed_backends"] == {} and len(payload.last["answer"]["backends"]) == 2
    folder = checkpoint.export_hf(model, stack["model"], stack["home"] / "reference2")
    r = httpx.post(c + "/update_weights_from_disk", json={"model_path": str(folder), "weight_version": "2"}, timeout=60)
    assert r.json()["success"], r.text
    again = _greedy(c)
    assert again[0] != after[0] and again[1] == "2"
    assert _greedy(a) == _greedy(b) == again


def test_rollway_train_tensor_with_the_kv_cache_released_for_the_step(stack: dict[str, Any]) -> None:
    home, gw = stack["home"], stack["gateway"]
    admin = httpx.Client(base_url=gw, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    for i in range(4):
        g = admin.post("/v1/groups", json={"task": {"i": i}, "n_samples": 4}).json()
        for j, cred in enumerate(g["sessions"]):
            agent = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=120)
            agent.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}+{j}"}], max_tokens=4)
            admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": float(j % 2), "finish": True})
    cmd = [sys.executable, "-m", "rollway.cli", "train", "--gateway", gw, "--model", str(stack["model"]), "--out",
           str(home / "out"), "--nproc", "1", "--groups-per-step", "2", "--steps", "2", "--lr", "1e-3",
           "--wait-seconds", "5", "--max-head-offpolicyness", "1",  # the second step trains groups of version 0
           "--weight-sync", "tensor", "--release-kv-cache", "--weight-sync-bucket-mb", "0.05"]
    done = subprocess.run(cmd, cwd=home, env=_env(), timeout=600, stdout=(home / "train.log").open("ab"),
                          stderr=subprocess.STDOUT)
    assert done.returncode == 0, (home / "train.log").read_text()[-3000:]
    assert admin.get("/v1/weights").json() == {"version": 2, "model_path": "distributed:v2"}
    assert not (home / "out" / "weights").exists()  # nothing written for a server to read
    steps = [json.loads(line) for line in (home / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len([s for s in steps if s.get("kv_cache_released_s", 0) > 0]) == 2, steps
    assert "handed to the servers as they are" in (home / "train.log").read_text()  # one rank: no gather copy
    for url in stack["urls"][:2]:
        assert _greedy(url)[1] == "2"  # released and resumed: generating again, at the new version
