"""The LoRA loop end to end: `rollway engine --enable-lora`, `rollway serve` with pinned sessions, and three
`rollway train --lora-rank 4 --steps 1` runs (the second and third resume from the first's checkpoint).

Shows: each publish is the adapter only (`lora:<folder>`, a few hundred KB here), loaded without pausing the
engine; every token is recorded with the adapter version that generated it; a session pinned to v1 keeps
generating with v1 across the v2 publish (one policy per trajectory) while a new session starts on v2; once
nothing uses them, v1 and v2 are unloaded from the engine (its /generate refuses them) and v3 serves.

    pytest -m slow tests/e2e/test_lora_loop.py -s
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.embedded import engine_process, free_port, wait_healthy

pytestmark = pytest.mark.slow

PROMPT = "37+48="


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollway.cli", *args]


class Chat:
    """One agent session through the plain OpenAI SDK, turn after turn."""

    def __init__(self, cred: dict[str, Any]) -> None:
        import openai

        self.cred = cred
        self.client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=120)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]

    def turn(self) -> None:
        reply = self.client.chat.completions.create(model="m", messages=self.messages, max_tokens=6)
        self.messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                          {"role": "user", "content": "again"}]

    def finish(self, gateway: str, reward: float) -> None:
        r = httpx.post(f"{gateway}/v1/sessions/{self.cred['session_id']}/reward",
                       json={"reward": reward, "finish": True},
                       headers={"Authorization": f"Bearer {self.cred['api_key']}"}, timeout=30)
        assert r.status_code == 200, r.text
        self.client.close()


def _group(gateway: str, admin: dict[str, str], n: int = 2) -> list[Chat]:
    r = httpx.post(f"{gateway}/v1/groups", json={"task": {"prompt": PROMPT}, "n_samples": n}, headers=admin, timeout=30)
    assert r.status_code == 201, r.text
    return [Chat(c) for c in r.json()["sessions"]]


def _versions(gateway: str, admin: dict[str, str], chat: Chat) -> list[set[int]]:
    s = httpx.get(f"{gateway}/v1/sessions/{chat.cred['session_id']}", headers=admin, timeout=30).json()
    return [set(t["versions"]) for t in s["turns"]]


def _train(gateway: str, model: Path, out: Path, steps: int) -> None:
    """`--steps` counts the steps of the run: a resumed run starts at its checkpoint's."""
    done = subprocess.run(
        _cli("train", "--gateway", gateway, "--model", str(model), "--out", str(out), "--nproc", "1", "--steps", str(steps),
             "--groups-per-step", "1", "--lr", "1e-2", "--wait-seconds", "10", "--lora-rank", "4",
             "--max-head-offpolicyness", "4"),  # room for the pinned group beside the trained ones
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def _loaded(engine: str) -> set[str]:
    """The engine's loaded adapters, without loading any: an unload of a name it never had answers 400 with its
    `loaded_adapters` (SGLang's LoRAUpdateOutput). A /generate naming an unloaded adapter would load it again, as
    SGLang does (docs/sglang-contract.md), so it cannot tell."""
    r = httpx.post(f"{engine}/unload_lora_adapter", json={"lora_name": "__probe__"}, timeout=60)
    assert r.status_code == 400, r.text
    return set(r.json()["loaded_adapters"])


def _served(engine: str, name: str) -> int:
    r = httpx.post(f"{engine}/generate", json={"input_ids": [5, 6, 7], "lora_path": name,
                                               "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    return r.status_code


@pytest.mark.timeout(1800)
def test_lora_training_pinned_sessions_and_unloading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    key = "rw-admin-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("ROLLWAY_ADMIN_KEY", key)
    admin = {"Authorization": f"Bearer {key}"}
    model = tmp_path / "model"
    assert subprocess.run(_cli("init-model", "--out", str(model)), capture_output=True, timeout=600).returncode == 0
    out = tmp_path / "train"
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    lora_flags = ["--enable-lora", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
                  "--max-lora-rank", "8", "--max-loaded-loras", "4"]
    env = {**os.environ, "ROLLWAY_LORA_PIN_SESSIONS": "1", "ROLLWAY_LORA_MAX_VERSIONS": "2"}
    with engine_process(model, log_path=tmp_path / "engine.log", extra=lora_flags) as engine, \
            (tmp_path / "gateway.log").open("ab") as gw_log:
        gw = subprocess.Popen(
            _cli("serve", "--backend", engine, "--tokenizer", str(model), "--db", f"sqlite:///{tmp_path / 'r.db'}",
                 "--port", str(port), "--data-dir", str(tmp_path / "gw")),
            stdout=gw_log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(gateway, gw, timeout=120)
            t0 = time.monotonic()
            # -- v1: a group generated by the base model, one LoRA step
            first = _group(gateway, admin)
            for i, chat in enumerate(first):
                chat.turn()
                chat.finish(gateway, float(i))
            _train(gateway, model, out, 1)
            weights = httpx.get(f"{gateway}/v1/weights", headers=admin, timeout=30).json()
            assert weights["version"] == 1 and weights["model_path"] == f"lora:{(out / 'adapters' / 'v000001').resolve()}"
            folder = Path(weights["model_path"].removeprefix("lora:"))
            assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
            adapter_bytes = sum(p.stat().st_size for p in folder.iterdir())
            print(f"\nv1 published after {time.monotonic() - t0:.0f}s; adapter folder {adapter_bytes} bytes")

            # -- a pinned session starts on v1; the training group of v2 is generated on v1 too
            pinned, other = _group(gateway, admin)
            pinned.turn()
            second = _group(gateway, admin)
            for i, chat in enumerate(second):
                chat.turn()
                chat.finish(gateway, float(i))
            _train(gateway, model, out, 2)  # resumes from the v1 checkpoint
            assert httpx.get(f"{gateway}/v1/weights", headers=admin, timeout=30).json()["version"] == 2

            # -- across the publish: the pinned session stays on v1, a new session starts on v2
            pinned.turn()
            other.turn()
            assert _versions(gateway, admin, first[0]) == [{0}]
            assert _versions(gateway, admin, second[0]) == [{1}]
            assert _versions(gateway, admin, pinned) == [{1}, {1}]  # one policy for the whole trajectory
            assert _versions(gateway, admin, other) == [{2}]
            assert _served(engine, "v1") == 200 and _served(engine, "v2") == 200

            # -- v3: the pinned sessions end; v1 and v2 are used by nothing and are unloaded
            pinned.finish(gateway, 1.0)
            other.finish(gateway, 0.0)
            _train(gateway, model, out, 3)
            assert httpx.get(f"{gateway}/v1/weights", headers=admin, timeout=30).json()["version"] == 3
            deadline = time.monotonic() + 60
            while _loaded(engine) & {"v1", "v2"}:
                assert time.monotonic() < deadline, f"old adapters still loaded: {_loaded(engine)}"
                time.sleep(1)
            assert _served(engine, "v3") == 200
            last = _group(gateway, admin, 1)[0]
            last.turn()
            assert _versions(gateway, admin, last) == [{3}]
            metrics = httpx.get(f"{engine}/metrics", timeout=30).text
            assert "rollway_engine_paused_s_total 0.0" in metrics  # no publish paused generation
            assert "rollway_engine_swaps_total 0.0" in metrics  # and the base weights were never reloaded
            print(f"loop done in {time.monotonic() - t0:.0f}s")
        finally:
            gw.terminate()
            gw.wait(30)
