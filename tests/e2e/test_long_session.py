"""A long multi-turn agent session trains end to end: the long-trajectory path of the trainer.

A Qwen3-shaped model (`rollway init-model --arch qwen3`, a 32,768-token context) on Qwen2.5's real vocabulary and
ChatML template (Qwen3's own template rewrites history, drops earlier turns' reasoning, so every turn would start a
new chain: docs/models.md), `rollway engine` and `rollway serve` as processes, an OpenAI-SDK agent that runs one
session of 42 turns, each turn's tool observation ~600 tokens, to more than 24k tokens of context, all one chain:
every call extends the last. With a short second session and rewards 1 and 0 the group is trained: `rollway train --steps 1
--activation-checkpointing on`, one row of 24k+ tokens in a pass of its own (unpacked: causal attention, no
dense mask), its layers recomputed in the backward. Then version 1 is published, loaded by the engine, and the
next turn is recorded at version 1.

    pytest -m slow tests/e2e/test_long_session.py -s      # -s prints the figures
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.embedded import engine_process, free_port, stop, wait_healthy
from tests.realfiles import BY_NAME, Unavailable, tokenizer_dir

pytestmark = pytest.mark.slow

TURNS = 42
MIN_TOKENS = 24_000
WORDS = ("build", "test", "file", "error", "line", "module", "import", "return", "value", "config", "path",
         "request", "status", "output", "trace", "commit", "branch", "patch", "diff", "result")  # fmt: skip


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollway.cli", *args]


def _observation(rng: random.Random, turn: int, tokens: int, tokenizer: Any) -> str:
    """A tool's output of about `tokens` tokens (measured with the model's tokenizer)."""
    text = f"$ step {turn}\n"
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(40)) + f" [{rng.randrange(10**6)}]\n"
    return text


def _run_session(cred: dict[str, Any], turns: int, tokenizer: Any, rng: random.Random) -> int:
    """The agent: plain OpenAI SDK; each turn a reply, then the tool's output as the next user message."""
    import openai

    client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=300)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Read each tool output and say what to run next."},
        {"role": "user", "content": "Fix the failing build. Start by running the tests."},
    ]
    try:
        for turn in range(turns):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=1.0)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            if turn < turns - 1:
                messages.append({"role": "user", "content": _observation(rng, turn, 600, tokenizer)})
    finally:
        client.close()
    return turns


def _finish(gateway: str, cred: dict[str, Any], reward: float) -> None:
    r = httpx.post(f"{gateway}/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True},
                   headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "finished", r.text


@pytest.mark.timeout(2400)
def test_a_24k_token_session_of_42_turns_trains_one_step_and_the_next_turn_is_version_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        tok_dir = tokenizer_dir(BY_NAME["Qwen2.5"])
    except Unavailable as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    if "OMP_NUM_THREADS" not in os.environ:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children (engine, gateway, torchrun) share a small machine
    key = "rw-admin-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("ROLLWAY_ADMIN_KEY", key)
    admin = {"Authorization": f"Bearer {key}"}
    times: dict[str, float] = {}
    t0 = time.monotonic()

    model = tmp_path / "model"
    made = subprocess.run(_cli("init-model", "--out", str(model), "--arch", "qwen3", "--tokenizer", str(tok_dir)),
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    config = json.loads((model / "config.json").read_text())
    assert config["max_position_embeddings"] >= 32_768
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)

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
                deadline = time.monotonic() + 120
                while httpx.get(f"{gateway}/ready", timeout=5).status_code != 200:
                    assert time.monotonic() < deadline and gw.poll() is None, "the gateway never became ready"
                    time.sleep(0.2)
                times["up"] = time.monotonic() - t0

                r = httpx.post(f"{gateway}/v1/groups", json={"task": {"prompt": "fix the build"}, "n_samples": 2},
                               headers=admin, timeout=30)
                assert r.status_code == 201, r.text
                group = r.json()
                long_cred, short_cred = group["sessions"]
                rng = random.Random(0)
                _run_session(long_cred, TURNS, tokenizer, rng)
                times[f"{TURNS}-turn session"] = time.monotonic() - t0
                _run_session(short_cred, 2, tokenizer, rng)
                _finish(gateway, long_cred, 1.0)
                _finish(gateway, short_cred, 0.0)

                session = httpx.get(f"{gateway}/v1/sessions/{long_cred['session_id']}", headers=admin,
                                    timeout=120).json()
                turns = session["turns"]
                last = turns[-1]
                context = len(last["prompt_ids"]) + len(last["completion_ids"])
                assert len(turns) == TURNS and context >= MIN_TOKENS, (len(turns), context)
                assert [t["continuity"] for t in turns[1:]] == ["extends"] * (TURNS - 1)  # one chain

                trained = subprocess.run(
                    _cli("train", "--gateway", gateway, "--model", str(model), "--out", str(train_out), "--nproc",
                         "1", "--steps", "1", "--groups-per-step", "1", "--lr", "1e-3", "--wait-seconds", "5",
                         "--activation-checkpointing", "on"),
                    capture_output=True, text=True, timeout=1800)
                assert trained.returncode == 0, trained.stderr[-3000:]
                times["rollway train --steps 1"] = time.monotonic() - t0
                metrics = [json.loads(line) for line in (train_out / "metrics.jsonl").read_text().splitlines()]
                step = next(m for m in metrics if m.get("step") == 1 and "loss_tokens" in m)
                assert step["recomputed_passes"] >= 1, step
                # the long chain is one row, whole, in a pass of its own (and the short session's row)
                assert MIN_TOKENS <= step["padded_tokens"] < context + 4_000, step

                weights = httpx.get(f"{gateway}/v1/weights", headers=admin, timeout=30).json()
                assert weights["version"] == 1, weights
                info = httpx.get(f"{engine_url}/model_info", timeout=30).json()
                assert info["weight_version"] == "1", info

                r = httpx.post(f"{gateway}/v1/groups", json={"task": {"prompt": "next"}, "n_samples": 1},
                               headers=admin, timeout=30)
                cred = r.json()["sessions"][0]
                _run_session(cred, 1, tokenizer, rng)
                nxt = httpx.get(f"{gateway}/v1/sessions/{cred['session_id']}", headers=admin, timeout=30).json()
            finally:
                stop(gw)
    (turn,) = nxt["turns"]
    assert turn["versions"] == [1] * len(turn["completion_ids"])
    print(f"\nlong session: {TURNS} turns, {context:,} tokens of context, loss tokens {step['loss_tokens']:.0f}, "
          f"padded {step['padded_tokens']:.0f}; seconds since start: "
          + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
