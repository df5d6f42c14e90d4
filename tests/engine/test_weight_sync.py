"""The engine's process-group path (engine/weight_sync.py) against the trainer's sender (trainer/weight_sync.py):
real gloo groups over loopback TCP, real HTTP, the engine's real model. The trainer's side runs in a child process,
as it does in production (torch names a process's groups once: both ends in one process would collide)."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.server import create_app
from tests.engine.conftest import LiveServer
from trainer.fsdp import free_port
from trainer.weight_sync import Bucket, Sender, init_custom_process_group, plan_buckets

CTX = multiprocessing.get_context("spawn")


def _trainer(port: int, group: str, buckets: list[Bucket] | None, tensors: list[torch.Tensor] | None,
             out: Any) -> None:
    """The trainer's rank 0 of one group: the buckets through `Sender`, or `tensors` one broadcast each, or (both
    None) join and stay silent until told to leave."""
    out.put("up")  # imports done: what follows is timed by the group's timeout
    if buckets is not None:
        sender = Sender({"group_name": group, "world_size": 2}, "127.0.0.1", port, "gloo", 30.0, buckets).start()
        sender.join(60)
        out.put({"sent": sender.sent, "error": sender.error})
        return
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group, timedelta(seconds=30))
    opts = torch.distributed.BroadcastOptions()
    for t in tensors or []:
        pg.broadcast([t], opts).wait()
    out.put({"sent": len(tensors or [])})
    if tensors is None:
        time.sleep(20)
    torch.distributed.destroy_process_group(pg)


def start_trainer(port: int, group: str, buckets: list[Bucket] | None = None,
                  tensors: list[torch.Tensor] | None = None) -> tuple[Any, Any]:
    out = CTX.Queue()
    proc = CTX.Process(target=_trainer, args=(port, group, buckets, tensors, out), daemon=True)
    proc.start()
    assert out.get(timeout=120) == "up"
    return proc, out


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, Any]]:
    app = create_app(tiny_model_dir, max_batch_size=4)
    with LiveServer(app) as server:
        yield server, app.state.engine


@pytest.fixture(scope="module")
def served_pre_session(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, Any]]:
    """An engine serving as SGLang before 0.5.21: no weight-update session, none demanded."""
    app = create_app(tiny_model_dir, max_batch_size=4, weight_update_session=False)
    with LiveServer(app) as server:
        yield server, app.state.engine


def trained_state(model_dir: Path, shift: float) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    state = {k: v + shift for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def buckets_of(state: dict[str, torch.Tensor], nbytes: int) -> list[Bucket]:
    out = []
    for names in plan_buckets(state, nbytes):
        out.append(Bucket(names, [list(state[n].shape) for n in names], state[names[0]].dtype,
                          torch.cat([state[n].reshape(-1) for n in names])))
    return out


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_buckets_arrive_in_place_and_the_version_moves_on_the_last(served: tuple[LiveServer, Any],
                                                                    tiny_model_dir: Path) -> None:
    server, engine = served
    state = trained_state(tiny_model_dir, 0.01)
    buckets = buckets_of(state, 200_000)
    assert len(buckets) >= 3
    port = free_port()
    proc, out = start_trainer(port, "g-publish", buckets=buckets)
    r = post(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                         "rank_offset": 1, "world_size": 2,
                                                         "group_name": "g-publish", "backend": "gloo"})
    assert r.status_code == 200 and r.json()["success"], r.text
    first = {**buckets[0].manifest(), "group_name": "g-publish", "load_format": "flattened_bucket"}
    r = post(server.url, "/update_weights_from_distributed", first)  # SGLang 0.5.21+: only inside a session
    assert r.status_code == 400 and r.json() == {"success": False, "message": (
        "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")}
    assert post(server.url, "/end_weight_update", {}).json() == {
        "success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
    assert post(server.url, "/begin_weight_update", {}).json() == {"success": True, "message": "Success"}
    r = post(server.url, "/begin_weight_update", {})
    assert r.status_code == 400 and "already open" in r.json()["message"]
    for i, b in enumerate(buckets):
        last = i == len(buckets) - 1
        body = {**b.manifest(), "group_name": "g-publish", "load_format": "flattened_bucket", "flush_cache": True,
                "weight_version": "1" if last else None}
        r = post(server.url, "/update_weights_from_distributed", body)
        assert r.status_code == 200 and r.json()["success"], r.text
        version = httpx.get(server.url + "/model_info").json()["weight_version"]
        assert version == ("1" if last else "default")  # a half-received model never claims the new version
    assert post(server.url, "/end_weight_update", {}).json()["success"]
    assert out.get(timeout=60) == {"sent": len(buckets), "error": None}
    proc.join(30)
    served_state = engine.scheduler.model.state_dict()
    for name, t in state.items():
        assert torch.equal(served_state[name], t), name
    r = post(server.url, "/destroy_weights_update_group", {"group_name": "g-publish"})
    assert r.json()["success"]
    out = post(server.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}).json()
    assert out["meta_info"]["weight_version"] == "1"


def test_per_tensor_broadcasts_without_load_format(served_pre_session: tuple[LiveServer, Any],
                                                  tiny_model_dir: Path) -> None:
    """load_format null: one broadcast per tensor, in the manifest's order (SGLang's default); on an engine serving
    as SGLang before 0.5.21, without a weight-update session (it has no such routes)."""
    server, engine = served_pre_session
    assert httpx.post(server.url + "/begin_weight_update", json={}).status_code == 404
    assert httpx.get(server.url + "/server_info").json()["version"].startswith("0.5.20")
    state = trained_state(tiny_model_dir, -0.02)
    names = list(state)[:3]
    port = free_port()
    proc, out = start_trainer(port, "g-tensors", tensors=[state[n].contiguous() for n in names])
    assert post(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                           "rank_offset": 1, "world_size": 2,
                                                           "group_name": "g-tensors", "backend": "gloo"}).json()["success"]
    body = {"names": names, "dtypes": ["float32"] * 3, "shapes": [list(state[n].shape) for n in names],
            "group_name": "g-tensors"}
    assert post(server.url, "/update_weights_from_distributed", body).json()["success"]
    assert out.get(timeout=60) == {"sent": 3}
    proc.join(30)
    for n in names:
        assert torch.equal(engine.scheduler.model.state_dict()[n], state[n])
    post(server.url, "/destroy_weights_update_group", {"group_name": "g-tensors"})


def test_refusals(served: tuple[LiveServer, Any]) -> None:
    server, _ = served
    r = post(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                         "rank_offset": 1, "world_size": 2})
    assert r.status_code == 400 and "gloo" in r.json()["message"]  # SGLang's default backend is nccl
    r = post(server.url, "/update_weights_from_distributed",
             {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"})
    assert r.status_code == 400 and r.json()["success"] is False and "init_weights_update_group" in r.json()["message"]
    r = post(server.url, "/destroy_weights_update_group", {"group_name": "nope"})
    assert r.status_code == 400 and r.json()["success"] is False


def test_a_trainer_that_never_broadcasts_times_out(served: tuple[LiveServer, Any], tiny_model_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server, engine = served
    monkeypatch.setenv("ROLLWAY_WEIGHT_SYNC_TIMEOUT", "2")  # the test server runs in this process
    port = free_port()
    proc, out = start_trainer(port, "g-silent")  # joins, then stays silent
    assert post(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                           "rank_offset": 1, "world_size": 2,
                                                           "group_name": "g-silent", "backend": "gloo"}).json()["success"]
    assert out.get(timeout=60) == {"sent": 0}
    before = engine.scheduler.weight_version
    assert post(server.url, "/begin_weight_update", {}).json()["success"]
    t0 = time.monotonic()
    r = post(server.url, "/update_weights_from_distributed",
             {"names": ["model.norm.weight"], "dtypes": ["float32"],
              "shapes": [list(engine.scheduler.model.state_dict()["model.norm.weight"].shape)],
              "group_name": "g-silent", "load_format": "flattened_bucket", "weight_version": "99"})
    waited = time.monotonic() - t0
    assert r.status_code == 400 and "partially updated" in r.json()["message"]
    assert 1.5 < waited < 30
    assert post(server.url, "/end_weight_update", {}).json()["success"]  # closed after a failed update too
    assert engine.scheduler.weight_version == before != "99"
    post(server.url, "/destroy_weights_update_group", {"group_name": "g-silent"})
    proc.kill()
    proc.join(10)
