"""The whole loop on real architectures and vocabularies: a Qwen3-shaped and a Llama-shaped model.

For each: `rollway init-model --arch ... --tokenizer DIR` on the family's real vocabulary and chat template
(tests/realfiles.py), `rollway engine` and `rollway serve --backend` as processes on a fresh SQLite store, a
group of two sessions each run by an OpenAI-SDK agent (one chat completion, a reward, finish), `rollway train
--steps 1`, and then: version 1 published, loaded by the engine, and the next chat completion served and
recorded with version 1 on each of its tokens.

    pytest -m slow tests/e2e/test_real_arch_loop.py -s      # -s prints the figures (vocabulary, size, times)
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open

from rollway.embedded import engine_process, free_port, stop, wait_healthy
from tests.realfiles import BY_NAME, Unavailable, tokenizer_dir

pytestmark = pytest.mark.slow

PROMPT = "What is 37 + 48? Answer with the number only."
MAX_TOKENS = 8


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollway.cli", *args]


def _agent(cred: dict[str, Any]) -> str:
    """The agent: plain OpenAI SDK, pointed at the session's base URL and key; one chat completion."""
    import openai

    client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=120)
    try:
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=MAX_TOKENS)
    finally:
        client.close()
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls"), reply
    return reply.id


def _reward(gateway: str, cred: dict[str, Any], reward: float) -> None:
    r = httpx.post(f"{gateway}/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True},
                   headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "finished", r.text


def _wait_ready(gateway: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{gateway}/ready", timeout=5).status_code != 200:
        assert proc.poll() is None, "the gateway exited"
        assert time.monotonic() < deadline, f"the gateway was not ready within {timeout:.0f}s"
        time.sleep(0.2)


def _tensor(folder: Path, name: str) -> Any:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("arch", "family"), [("qwen3", "Qwen3"), ("llama", "Llama 3.2")])
def test_agent_gateway_engine_one_training_step_publish_next_turn(
        arch: str, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        tokenizer = tokenizer_dir(BY_NAME[family])
    except Unavailable as e:
        pytest.skip(str(e))
    if "OMP_NUM_THREADS" not in os.environ:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children (engine, gateway, torchrun) share a small machine
    key = "rw-admin-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("ROLLWAY_ADMIN_KEY", key)
    admin = {"Authorization": f"Bearer {key}"}
    times: dict[str, float] = {}
    t0 = time.monotonic()

    # -- init-model on the family's real tokenizer
    model = tmp_path / "model"
    made = subprocess.run(_cli("init-model", "--out", str(model), "--arch", arch, "--tokenizer", str(tokenizer)),
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    times["init-model"] = time.monotonic() - t0
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == arch
    embed_before = _tensor(model, "model.embed_tokens.weight")
    assert embed_before.shape == (config["vocab_size"], 64)

    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    train_out = tmp_path / "train"
    with engine_process(model, log_path=tmp_path / "engine.log") as engine_url:
        with (tmp_path / "gateway.log").open("ab") as gw_log:
            gw = subprocess.Popen(
                _cli("serve", "--backend", engine_url, "--tokenizer", str(model), "--db",
                     f"sqlite:///{tmp_path / 'rollway.db'}", "--port", str(port), "--data-dir", str(tmp_path / "gw")),
                stdout=gw_log, stderr=subprocess.STDOUT)
            try:
                wait_healthy(gateway, gw, timeout=120)
                _wait_ready(gateway, gw)
                times["engine and gateway up"] = time.monotonic() - t0

                # -- a group of two sessions, each run by the agent, rewards that differ (so it is trained)
                r = httpx.post(f"{gateway}/v1/groups", json={"task": {"prompt": PROMPT}, "n_samples": 2},
                               headers=admin, timeout=30)
                assert r.status_code == 201, r.text
                group = r.json()
                for i, cred in enumerate(group["sessions"]):
                    _agent(cred)
                    _reward(gateway, cred, float(i))
                times["group of 2 sessions"] = time.monotonic() - t0

                # -- one training step, published as version 1
                trained = subprocess.run(
                    _cli("train", "--gateway", gateway, "--model", str(model), "--out", str(train_out), "--nproc",
                         "1", "--steps", "1", "--groups-per-step", "1", "--lr", "1e-3", "--wait-seconds", "5"),
                    capture_output=True, text=True, timeout=1200)
                assert trained.returncode == 0, trained.stderr[-3000:]
                times["rollway train --steps 1"] = time.monotonic() - t0

                weights = httpx.get(f"{gateway}/v1/weights", headers=admin, timeout=30).json()
                assert weights["version"] == 1, weights
                published = Path(weights["model_path"])
                assert published.parent.resolve() == (train_out / "weights").resolve()
                info = httpx.get(f"{engine_url}/model_info", timeout=30).json()
                assert info["weight_version"] == "1", info
                g = httpx.get(f"{gateway}/v1/groups/{group['group_id']}", headers=admin, timeout=30).json()
                assert (g["state"], g["trained_version"]) == ("trained", 1), g
                # The step changed the weights, and the published folder is the same model on the same tokenizer.
                assert not _tensor(published, "model.embed_tokens.weight").equal(embed_before)
                assert json.loads((published / "config.json").read_text())["model_type"] == arch
                for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
                    assert (published / name).read_bytes() == (model / name).read_bytes(), name

                # -- the next turn: served by version 1 and recorded so, token by token
                r = httpx.post(f"{gateway}/v1/groups", json={"task": {"prompt": PROMPT}, "n_samples": 1},
                               headers=admin, timeout=30)
                assert r.status_code == 201, r.text
                cred = r.json()["sessions"][0]
                turn_id = _agent(cred)
                session = httpx.get(f"{gateway}/v1/sessions/{cred['session_id']}", headers=admin, timeout=30).json()
                times["next turn"] = time.monotonic() - t0
            finally:
                stop(gw)

    (turn,) = session["turns"]
    assert turn["id"] == turn_id
    assert 1 <= len(turn["completion_ids"]) <= MAX_TOKENS
    assert turn["versions"] == [1] * len(turn["completion_ids"])
    assert all(0 <= t < config["vocab_size"] for t in turn["prompt_ids"] + turn["completion_ids"])

    params = sum(_tensor(model, n).numel() for n in _names(model))
    print(f"\n{arch} on {family}'s vocabulary and template: vocab {config['vocab_size']:,}, hidden "
          f"{config['hidden_size']}, {config['num_hidden_layers']} layers, {params / 1e6:.2f}M parameters "
          f"({(model / 'model.safetensors').stat().st_size / 2**20:.1f} MiB); seconds since start: "
          + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


def _names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())
