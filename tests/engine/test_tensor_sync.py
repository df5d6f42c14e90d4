"""The engine's tensor path (engine/tensor_sync.py) against the trainer's serializer (trainer/tensor_sync.py), and
its memory release (engine/memory.py): real HTTP, the engine's real model. The payload is made in a child process,
as the trainer makes it, so the engine opens another process's shared memory by name; the child keeps it until told
to go, as the trainer keeps its buckets until the server answers."""

from __future__ import annotations

import base64
import multiprocessing
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.server import create_app
from tests.engine.conftest import LiveServer
from tests.engine.test_weight_sync import buckets_of, trained_state
from trainer.tensor_sync import serialize_bucket, serialize_named

CTX = multiprocessing.get_context("spawn")


def _trainer(model_dir: str, shift: float, nbytes: int, out: Any, done: Any) -> None:
    state = trained_state(Path(model_dir), shift)
    buckets = buckets_of(state, nbytes)
    out.put([serialize_bucket(b.flat, b.names, b.shapes) for b in buckets])
    done.wait(120)  # the buckets' shared memory lives as long as this process


def _trainer_named(model_dir: str, shift: float, nbytes: int, out: Any, done: Any) -> None:
    state = trained_state(Path(model_dir), shift)
    out.put([serialize_named(b.names, [state[n] for n in b.names]) for b in buckets_of(state, nbytes)])
    done.wait(120)


def _trainer_live(model_dir: str, nbytes: int, out: Any, step: Any, done: Any) -> None:
    """The trainer with one CPU rank: its parameters moved into one shared-memory file, handed out as they are, then
    changed in place by "a step" and handed out again."""
    from transformers import AutoModelForCausalLM

    from trainer.tensor_sync import plain_state, share_in_one
    from trainer.weight_sync import plan_buckets

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = plain_state(model)
    assert state is not None
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = share_in_one(model, state)
    for shift in (0.25, -0.5):
        with torch.no_grad():
            for t in state.values():
                t.add_(shift)
        out.put([serialize_named(names, [state[n] for n in names]) for names in plan_buckets(state, nbytes)])
        step.wait(120)
        step.clear()
    done.wait(120)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, Any]]:
    app = create_app(tiny_model_dir, max_batch_size=4)
    with LiveServer(app) as server:
        yield server, app.state.engine


def post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def payloads(model_dir: Path, shift: float, nbytes: int, named: bool = False) -> tuple[list[str], Any, Any]:
    out, done = CTX.Queue(), CTX.Event()
    proc = CTX.Process(target=_trainer_named if named else _trainer, args=(str(model_dir), shift, nbytes, out, done),
                       daemon=True)
    proc.start()
    return out.get(timeout=120), proc, done


def test_buckets_from_another_process_land_in_the_model(served: tuple[LiveServer, Any], tiny_model_dir: Path) -> None:
    server, engine = served
    entries, proc, done = payloads(tiny_model_dir, 0.25, 40_000)
    try:
        assert len(entries) > 1
        r = post(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [entries[0]],
                                                              "load_format": "flattened_bucket"})
        assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]  # outside a session
        assert post(server.url, "/begin_weight_update", {}).json()["success"]
        for i, entry in enumerate(entries):
            body: dict[str, Any] = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket",
                                    "flush_cache": i == len(entries) - 1, "abort_all_requests": False}
            if i == len(entries) - 1:
                body["weight_version"] = "7"
            r = post(server.url, "/update_weights_from_tensor", body)
            assert r.status_code == 200 and r.json() == {"success": True, "message": "Success"}, r.text
        assert post(server.url, "/end_weight_update", {}).json()["success"]
    finally:
        done.set()
        proc.join(30)
    want = trained_state(tiny_model_dir, 0.25)
    got = engine.scheduler.model.state_dict()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "7"}


def test_named_tensors_from_another_process_land_in_the_model(served: tuple[LiveServer, Any],
                                                              tiny_model_dir: Path) -> None:
    """`load_format` unset: each entry a list of (name, tensor) pairs, each tensor its own shared memory (what the
    trainer sends when it hands out its parameters as they are)."""
    server, engine = served
    entries, proc, done = payloads(tiny_model_dir, -0.125, 40_000, named=True)
    try:
        assert len(entries) > 1
        assert post(server.url, "/begin_weight_update", {}).json()["success"]
        for i, entry in enumerate(entries):
            body: dict[str, Any] = {"serialized_named_tensors": [entry], "load_format": None,
                                    "flush_cache": i == len(entries) - 1, "abort_all_requests": False}
            if i == len(entries) - 1:
                body["weight_version"] = "8"
            r = post(server.url, "/update_weights_from_tensor", body)
            assert r.status_code == 200 and r.json()["success"], r.text
        assert post(server.url, "/end_weight_update", {}).json()["success"]
    finally:
        done.set()
        proc.join(30)
    want = trained_state(tiny_model_dir, -0.125)
    got = engine.scheduler.model.state_dict()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "8"}


def test_the_parameters_mapped_once_are_read_again_at_their_new_values(served: tuple[LiveServer, Any],
                                                                      tiny_model_dir: Path) -> None:
    """The trainer's parameters in one shared-memory file, handed out twice with a step between: the engine keeps
    that file mapped after the first update (`_KEPT`, read by no one between updates), the second finds it mapped,
    and the model holds exactly what each update handed out."""
    from engine import tensor_sync

    server, engine = served
    out, step, done = CTX.Queue(), CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_trainer_live, args=(str(tiny_model_dir), 40_000, out, step, done), daemon=True)
    proc.start()
    kept = []
    try:
        for version, shift in (("11", 0.25), ("12", -0.25)):
            entries = out.get(timeout=120)
            assert len(entries) > 1
            assert post(server.url, "/begin_weight_update", {}).json()["success"]
            for entry in entries:
                r = post(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [entry],
                                                                      "load_format": None})
                assert r.status_code == 200 and r.json()["success"], r.text
            assert post(server.url, "/end_weight_update", {}).json()["success"]
            assert len(tensor_sync._KEPT) == 1  # one file for every parameter
            kept.append(tensor_sync._KEPT[0].data_ptr())
            want = trained_state(tiny_model_dir, 0.25)
            if shift < 0:
                want = {k: v + -0.5 for k, v in want.items()}
            got = engine.scheduler.model.state_dict()
            for name, t in want.items():
                assert torch.equal(got[name], t), (version, name)
            step.set()
    finally:
        step.set()
        done.set()
        proc.join(30)
    assert kept[0] == kept[1]  # the same mapping: not opened afresh


def test_refusals(served: tuple[LiveServer, Any]) -> None:
    server, _ = served
    assert post(server.url, "/begin_weight_update", {}).json()["success"]
    try:
        evil = base64.b64encode(pickle.dumps(print)).decode()  # a global outside the allowed rebuilders
        cases = [
            ({"serialized_named_tensors": []}, "non-empty list"),
            ({"serialized_named_tensors": ["!!"], "load_format": "flattened_bucket"}, "Failed"),
            ({"serialized_named_tensors": [evil], "load_format": "flattened_bucket"}, "blocked global builtins.print"),
            ({"serialized_named_tensors": ["eA=="], "load_format": "weird"}, "unknown load_format"),
        ]
        for body, message in cases:
            r = post(server.url, "/update_weights_from_tensor", body)
            assert r.status_code == 400 and not r.json()["success"] and message in r.json()["message"], r.text
        # a handle to memory this machine does not have (a payload from elsewhere): refused, said why
        flat = torch.zeros(4)
        entry = serialize_bucket(flat, ["model.norm.weight"], [[4]])
        raw = base64.b64decode(entry).replace(b"/torch_", b"/nothere")
        r = post(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(raw).decode()],
                                                              "load_format": "flattened_bucket"})
        assert r.status_code == 400 and "only on the machine that made it" in r.json()["message"], r.text
    finally:
        assert post(server.url, "/end_weight_update", {}).json()["success"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"rollway_engine_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(name)


def test_released_kv_cache_is_freed_and_generation_waits_for_the_resume(served: tuple[LiveServer, Any]) -> None:
    server, engine = served
    r = post(server.url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 400 and "not released" in r.json()["error"]["message"]
    r = post(server.url, "/release_memory_occupation", {"tags": ["kv_cache", "bogus"]})
    assert r.status_code == 400 and "unknown tags" in r.json()["error"]["message"]
    result: dict[str, Any] = {}

    def generate() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 64, "temperature": 0,
                                                            "ignore_eos": True}}
        result.update(httpx.post(server.url + "/generate", json=body, timeout=120).json())

    before = _metric(server.url, "released_kv_bytes")
    worker = threading.Thread(target=generate)
    worker.start()
    deadline = time.monotonic() + 30
    while not engine.scheduler._rows:  # running, with a cache
        assert time.monotonic() < deadline
        time.sleep(0.005)
    r = post(server.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 400 and "idle" in r.json()["error"]["message"]  # running and not paused: refused
    assert post(server.url, "/pause_generation", {"mode": "retract"}).status_code == 200
    r = post(server.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json() is None, r.text
    assert _metric(server.url, "released_kv_bytes") > before  # the running row's cache was freed
    assert post(server.url, "/continue_generation", {}).status_code == 200
    worker.join(1.0)
    assert worker.is_alive() and not result  # released: nothing generates, even unpaused
    assert post(server.url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).json() is None
    worker.join(60)
    assert len(result["output_ids"]) == 64 and result["meta_info"]["finish_reason"]["type"] == "length"
