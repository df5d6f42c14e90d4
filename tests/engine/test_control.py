"""Control endpoints over real HTTP (uvicorn): pause/continue, weight updates, aborts, disconnects."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.server import build_server, create_app
from tests.engine.conftest import LiveServer, perturbed

PROMPT = [5, 6, 7, 8, 9]
LONG = {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def other_weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with perturbed weights, same tokenizer: a checkpoint the trainer might publish."""
    return perturbed(tiny_model_dir, tmp_path_factory.mktemp("other-weights"), 1, tokenizer=True)


@pytest.fixture(scope="module")
def third_weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed(tiny_model_dir, tmp_path_factory.mktemp("third-weights"), 2)


@pytest.fixture
async def http(live_engine: LiveServer) -> Any:
    async with httpx.AsyncClient(base_url=live_engine.url, timeout=60) as c:
        yield c
        await c.post("/continue_generation", json={})


async def generate(http: httpx.AsyncClient, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    r = await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": params, **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def wait_busy(http: httpx.AsyncClient, busy: bool = True, timeout: float = 10) -> None:
    """/flush_cache answers 400 exactly while requests are running."""
    deadline = time.monotonic() + timeout
    while ((await http.post("/flush_cache")).status_code == 400) != busy:
        assert time.monotonic() < deadline, f"engine never became {'busy' if busy else 'idle'}"
        await asyncio.sleep(0.02)


async def read_stream(
    http: httpx.AsyncClient, body: dict[str, Any], into: list[Any], first: asyncio.Event
) -> None:
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                into.append(json.loads(line[6:]))
                first.set()


async def test_pause_abort_returns_partials_and_new_requests_wait(http: httpx.AsyncClient) -> None:
    running = [asyncio.create_task(generate(http, LONG, rid=f"pa{i}")) for i in range(2)]
    await wait_busy(http)
    await asyncio.sleep(0.2)
    r = await http.post("/pause_generation", json={"mode": "abort"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    for out in await asyncio.gather(*running):
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["finish_reason"]["message"] == "Aborted"
        assert 0 < len(out["output_ids"]) < 3000 == 3000  # a partial
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])

    waiting = asyncio.create_task(generate(http, {"temperature": 0, "max_new_tokens": 5}))
    await asyncio.sleep(0.4)
    assert not waiting.done()  # held, not rejected
    await http.post("/continue_generation", json={})
    out = await asyncio.wait_for(waiting, 10)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_pause_retract_waits_then_finishes_with_new_weights(
    http: httpx.AsyncClient, tiny_model_dir: Path, other_weights: Path
) -> None:
    chunks: list[Any] = []
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }
    started = asyncio.Event()
    reader = asyncio.create_task(read_stream(http, body, chunks, started))
    await asyncio.wait_for(started.wait(), 10)
    await http.post("/pause_generation", json={"mode": "retract"})
    await asyncio.sleep(0.05)
    seen = len(chunks)
    await asyncio.sleep(0.4)
    assert len(chunks) == seen and not reader.done()  # no progress while paused
    r = await http.post(
        "/update_weights_from_disk", json={"model_path": str(other_weights), "weight_version": "r1"}
    )
    assert r.json()["success"] is True and r.json()["num_paused_requests"] == 1
    await http.post("/continue_generation", json={})
    await asyncio.wait_for(reader, 30)
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert len(final["output_ids"]) == 400 and final["meta_info"]["weight_version"] == "r1"
    r = await http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "default"}
    )
    assert r.json()["success"] is True


async def test_update_weights_from_disk(
    http: httpx.AsyncClient, tiny_model_dir: Path, other_weights: Path
) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    before = await generate(http, greedy)
    in_flight = asyncio.create_task(generate(http, {**greedy, "max_new_tokens": 200}))
    await wait_busy(http)
    r = await http.post(
        "/update_weights_from_disk", json={"model_path": str(other_weights), "weight_version": "7"}
    )
    assert r.status_code == 200 and r.json()["success"] is True
    old = await in_flight  # it was allowed to finish on the old weights first
    assert old["meta_info"]["weight_version"] == "default" and len(old["output_ids"]) == 200
    info = (await http.get("/model_info")).json()
    assert (
        info["weight_version"] == "7"
        and info["model_path"] == str(other_weights)
        and info["is_generation"] is True
    )
    after = await generate(http, greedy)
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "7"

    r = await http.post(
        "/update_weights_from_disk",
        json={"model_path": str(other_weights / "missing"), "weight_version": "8"},
    )
    assert r.status_code == 400 and r.json()["success"] is False
    assert (await http.get("/get_model_info")).json()["weight_version"] == "7"
    assert (await generate(http, greedy))["output_ids"] == after["output_ids"]  # old weights keep serving

    r = await http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "default"}
    )
    assert r.json()["success"] is True
    assert (await generate(http, greedy))["output_ids"] == before["output_ids"]


async def test_successive_updates_serve_each_checkpoint(
    http: httpx.AsyncClient, tiny_model_dir: Path, other_weights: Path, third_weights: Path
) -> None:
    """From the second update on, the engine copies the new tensors into the model the last update retired: three
    checkpoints in turn, each answer is that checkpoint's own (a copy that did not happen would serve the retired
    model's old weights)."""
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    expected: dict[str, list[int]] = {}
    for name, path in (("tiny", tiny_model_dir), ("other", other_weights), ("third", third_weights),
                       ("tiny", tiny_model_dir), ("other", other_weights)):
        r = await http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": name})
        assert r.json()["success"] is True
        out = (await generate(http, greedy))["output_ids"]
        assert expected.setdefault(name, out) == out, name
    assert len({tuple(v) for v in expected.values()}) == 3


async def test_abort_request_needs_a_held_rid_then_matches_its_prefix(http: httpx.AsyncClient) -> None:
    """SGLang 0.5.23 with one tokenizer worker (`TokenizerManager.abort_request`): an abort whose rid no request
    has exactly is dropped; one that a request has aborts every rid starting with it (the scheduler's
    `startswith`)."""
    group = [asyncio.create_task(generate(http, LONG, rid=rid)) for rid in ("grp", "grp_1")]
    bystander = asyncio.create_task(generate(http, {"temperature": 0, "max_new_tokens": 150}, rid="other"))
    await wait_busy(http)
    await asyncio.sleep(0.1)
    assert (await http.post("/abort_request", json={"rid": "gr"})).status_code == 200  # held by none
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in group)
    r = await http.post("/abort_request", json={"rid": "grp"})
    assert r.status_code == 200
    for out in await asyncio.gather(*group):
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await bystander)["meta_info"]["finish_reason"]["type"] == "length"


async def test_client_disconnect_aborts(http: httpx.AsyncClient, live_engine: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live_engine.url, timeout=60) as gone:
        async with gone.stream(
            "POST", "/generate", json={"input_ids": PROMPT, "sampling_params": LONG, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
    await wait_busy(http, busy=False)

    async with httpx.AsyncClient(base_url=live_engine.url, timeout=60) as gone:
        task = asyncio.create_task(
            gone.post("/generate", json={"input_ids": PROMPT, "sampling_params": LONG})
        )
        await wait_busy(http)
        task.cancel()
    await wait_busy(http, busy=False)


async def test_info_endpoints(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).status_code == 200
    info = (await http.get("/server_info")).json()
    assert info["context_length"] == 4096 and info["max_req_input_len"] == 4095
    assert {"max_total_num_tokens", "version"} <= set(info)
    assert (await http.get("/get_server_info")).json()["context_length"] == 4096


def test_shutdown_signal_aborts_in_flight_work(tiny_model_dir: Path) -> None:
    """What `serve()` does on SIGINT/SIGTERM (uvicorn calls `handle_exit` from its signal handler)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = build_server(create_app(tiny_model_dir), host="127.0.0.1", port=port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.02)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"input_ids": PROMPT, "sampling_params": LONG}
        pending = pool.submit(httpx.post, f"{url}/generate", json=body, timeout=60)
        while httpx.post(f"{url}/flush_cache").status_code != 400:
            time.sleep(0.02)
        start = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        thread.join(timeout=30)
        assert not thread.is_alive() and time.monotonic() - start < 5
        out = pending.result().json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 3000


async def engine_metrics(http: httpx.AsyncClient) -> dict[str, float]:
    r = await http.get("/metrics")
    assert r.status_code == 200
    return {name: float(value) for name, value in (line.split(" ") for line in r.text.splitlines())}


async def test_metrics_count_steps_rows_and_paused_time(http: httpx.AsyncClient) -> None:
    before = await engine_metrics(http)
    # two identical prompts and one other, sent together: one prefill computes 2 rows for 3
    bodies = [{"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
              for p in (PROMPT, PROMPT, [11, 12, 13])]
    replies = await asyncio.gather(*(http.post("/generate", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in replies)
    await http.post("/pause_generation", json={"mode": "abort"})
    await asyncio.sleep(0.3)
    paused = await engine_metrics(http)  # a pause in progress counts up to now
    await http.post("/continue_generation", json={})
    after = await engine_metrics(http)

    def delta(name: str) -> float:
        return after[f"rollway_engine_{name}_total"] - before[f"rollway_engine_{name}_total"]

    assert delta("prefill_rows") == 3 and delta("prefill_computed_rows") <= delta("prefill_rows")
    # each reply's first token comes from its prefill, the other 3 from decode steps of up to 3 rows
    assert delta("decode_steps") >= 3 and delta("decode_rows") == 9
    assert paused["rollway_engine_paused_s_total"] - before["rollway_engine_paused_s_total"] >= 0.3
    assert delta("paused_s") >= 0.3 and delta("busy_s") > 0
