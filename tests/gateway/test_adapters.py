"""LoRA adapter publishes through the gateway against the fake SGLang (its LoRA contract): loaded without a pause,
routed with `lora_path`, versions per token, pinned sessions, the cap's eviction, unloading what nothing uses."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.adapters import Adapters
from gateway.services import app_serving
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


@pytest.fixture(scope="module")
def fake(db_url: str) -> Iterator[FakeSGLang]:
    """One per store the module runs on: adapter names (v1, v2, ...) restart with each store."""
    with FakeSGLang(vocab=range(100, 1000), enable_lora=True, max_loaded_loras=8) as f:
        yield f


@pytest.fixture(scope="module")
def gateway(fake: FakeSGLang, tiny_model_dir: Path, db_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as gw:
        yield gw


def _adapters(gw: LiveGateway) -> Adapters:
    return app_serving(gw.app).publisher.adapters  # type: ignore[no-any-return]


def _folder(root: Path, version: int) -> Path:
    path = root / f"v{version:06d}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return path


def _publish(gw: LiveGateway, version: int, path: Path) -> dict[str, Any]:
    r = gw.admin.post("/v1/weights", json={"version": version, "model_path": f"lora:{path}"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _turn(gw: LiveGateway, fake: FakeSGLang, cred: dict[str, Any], messages: list[dict[str, Any]]) -> str | None:
    """One chat turn; returns the lora_path the gateway sent."""
    r = gw.openai(cred).chat.completions.create(model="m", messages=messages, max_tokens=3)
    messages.append({"role": "assistant", "content": r.choices[0].message.content})
    messages.append({"role": "user", "content": "more"})
    return next(p for p in reversed(fake.requests) if p.get("rid")).get("lora_path")


def _versions(gw: LiveGateway, session_id: str) -> list[set[int]]:
    return [set(t["versions"]) for t in gw.session(session_id)["turns"]]


def _wait(condition: Any, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_pinned_sessions_eviction_and_unloading(gateway: LiveGateway, fake: FakeSGLang, tmp_path: Path) -> None:
    adapters = _adapters(gateway)
    adapters.pin_sessions, adapters.max_versions = True, 2
    v0 = gateway.admin.get("/v1/weights").json()["version"]
    first = _publish(gateway, v0 + 1, _folder(tmp_path, v0 + 1))
    assert first["kind"] == "lora" and first["paused"] is False
    assert "/pause_generation" not in [p for p, _ in fake.calls]  # adding an adapter pauses nothing
    assert fake.loras == {f"v{v0 + 1}": str(tmp_path / f"v{v0 + 1:06d}")}

    g = gateway.group(2)
    old, fresh = g["sessions"]
    old_msgs: list[dict[str, Any]] = [{"role": "user", "content": "37+48="}]
    assert _turn(gateway, fake, old, old_msgs) == f"v{v0 + 1}"
    _publish(gateway, v0 + 2, _folder(tmp_path, v0 + 2))
    # the pinned session stays on the version it started with; a new session takes the newest
    assert _turn(gateway, fake, old, old_msgs) == f"v{v0 + 1}"
    fresh_msgs: list[dict[str, Any]] = [{"role": "user", "content": "1+1="}]
    assert _turn(gateway, fake, fresh, fresh_msgs) == f"v{v0 + 2}"
    assert _versions(gateway, old["session_id"]) == [{v0 + 1}, {v0 + 1}]  # one policy across the publish
    assert _versions(gateway, fresh["session_id"]) == [{v0 + 2}]

    # a third version: at most 2 stay loaded, so the oldest is evicted; its pinned session moves to the newest
    evicted = _publish(gateway, v0 + 3, _folder(tmp_path, v0 + 3))["evicted_versions"]
    assert evicted == [v0 + 1]
    _wait(lambda: f"v{v0 + 1}" not in fake.loras)
    assert _turn(gateway, fake, old, old_msgs) == f"v{v0 + 3}"
    assert adapters.repins == 1
    assert _versions(gateway, old["session_id"])[-1] == {v0 + 3}
    assert _turn(gateway, fake, fresh, fresh_msgs) == f"v{v0 + 2}"  # still pinned, still loaded

    # once the session pinned to v0+2 ends, nothing uses that version: the sweep unloads it
    assert gateway.admin.post(f"/v1/sessions/{fresh['session_id']}/reward", json={"reward": 1.0, "finish": True}
                              ).status_code == 200
    _wait(lambda: f"v{v0 + 2}" not in fake.loras)
    assert set(fake.loras) == {f"v{v0 + 3}"}
    assert ("/unload_lora_adapter", {"lora_name": f"v{v0 + 2}"}) in fake.calls


def test_unpinned_sessions_follow_the_newest_and_old_versions_go(gateway: LiveGateway, fake: FakeSGLang,
                                                                  tmp_path: Path) -> None:
    adapters = _adapters(gateway)
    adapters.pin_sessions, adapters.max_versions = False, 4
    v = gateway.admin.get("/v1/weights").json()["version"] + 1
    _publish(gateway, v, _folder(tmp_path, v))
    cred = gateway.group(2)["sessions"][0]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "2+2="}]
    assert _turn(gateway, fake, cred, msgs) == f"v{v}"
    _publish(gateway, v + 1, _folder(tmp_path, v + 1))
    assert _turn(gateway, fake, cred, msgs) == f"v{v + 1}"
    assert _versions(gateway, cred["session_id"]) == [{v}, {v + 1}]
    _wait(lambda: set(fake.loras) == {f"v{v + 1}"})


def test_an_adapter_no_backend_can_load_is_refused(gateway: LiveGateway, fake: FakeSGLang, tmp_path: Path) -> None:
    v = gateway.admin.get("/v1/weights").json()["version"]
    r = gateway.admin.post("/v1/weights", json={"version": v + 1, "model_path": f"lora:{tmp_path / 'nothing'}"})
    assert r.status_code == 503
    assert gateway.admin.get("/v1/weights").json()["version"] == v
    assert f"v{v + 1}" not in fake.loras


def test_a_recovered_backend_gets_the_adapters_before_traffic(gateway: LiveGateway, fake: FakeSGLang,
                                                               tmp_path: Path) -> None:
    adapters = _adapters(gateway)
    adapters.pin_sessions, adapters.max_versions = False, 4
    v = gateway.admin.get("/v1/weights").json()["version"] + 1
    _publish(gateway, v, _folder(tmp_path, v))
    fake.loras.clear()  # the server restarted: its adapters are gone
    fake.lora_refs.clear()
    pool = app_serving(gateway.app).pool
    backend = pool.backends()[0]
    pool.mark_failed(backend, "test: restarted")
    _wait(lambda: backend.healthy)  # the health loop brings it back only after loading what the gateway serves
    assert fake.loras[f"v{v}"] == str(tmp_path / f"v{v:06d}")
    _wait(lambda: set(fake.loras) == {f"v{v}"})  # the previous version, if it was still loaded, goes again
    cred = gateway.group(2)["sessions"][0]
    assert _turn(gateway, fake, cred, [{"role": "user", "content": "3+3="}]) == f"v{v}"


def test_a_restarted_backend_that_never_loaded_the_adapter_is_resynced(gateway: LiveGateway, fake: FakeSGLang,
                                                                        tmp_path: Path) -> None:
    """SGLang 0.5.23 answers "Got LoRA adapter that has never been loaded" for a name it never loaded (a restart
    lost them all): not the agent's error; the backend leaves rotation and comes back with the adapters loaded."""
    import openai

    adapters = _adapters(gateway)
    adapters.pin_sessions, adapters.max_versions = False, 4
    v = gateway.admin.get("/v1/weights").json()["version"] + 1
    _publish(gateway, v, _folder(tmp_path, v))
    fake.loras.clear()  # restarted faster than the health loop noticed
    fake.lora_refs.clear()
    cred = gateway.group(2)["sessions"][0]
    try:
        _turn(gateway, fake, cred, [{"role": "user", "content": "4+4="}])
    except openai.APIStatusError as e:
        assert e.status_code == 503, e  # one backend, out of rotation for a moment: retry later, not a 400
    backend = app_serving(gateway.app).pool.backends()[0]
    _wait(lambda: backend.healthy and f"v{v}" in fake.loras)
    assert _turn(gateway, fake, cred, [{"role": "user", "content": "5+5="}]) == f"v{v}"


def test_the_fake_reloads_a_name_it_loaded_before(fake: FakeSGLang, tmp_path: Path) -> None:
    """As SGLang's `_resolve_lora_path`: a /generate naming an unloaded (once loaded) adapter loads it again."""
    import httpx

    path = _folder(tmp_path, 99)
    assert httpx.post(f"{fake.url}/load_lora_adapter", json={"lora_name": "x99", "lora_path": str(path)}).json()[
        "success"]
    assert httpx.post(f"{fake.url}/unload_lora_adapter", json={"lora_name": "x99"}).json()["success"]
    r = httpx.post(f"{fake.url}/generate", json={"input_ids": [1, 2], "lora_path": "x99",
                                                 "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and "x99" in fake.loras and fake.reloaded[-1] == "x99"
    r = httpx.post(f"{fake.url}/generate", json={"input_ids": [1, 2], "lora_path": "never",
                                                 "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "Got LoRA adapter that has never been loaded: never" in r.json()["error"]["message"]
    assert httpx.post(f"{fake.url}/unload_lora_adapter", json={"lora_name": "x99"}).json()["success"]
