"""A constrained reply interrupted by a weight publish: SGLang cannot resume a grammar from part of a reply,
so a non-streamed one restarts from its prompt, and a streamed one that already sent tokens ends in an error
(docs/sglang-contract.md "Constrained decoding")."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

JSON = {"type": "json_object"}


@pytest.fixture(scope="module")
def slow_fake() -> Iterator[FakeSGLang]:
    with FakeSGLang(vocab=range(100, 1000), token_delay=0.02) as f:
        yield f


@pytest.fixture(scope="module")
def gw(slow_fake: FakeSGLang, tiny_model_dir: Path, sqlite_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[slow_fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as g:
        yield g


def publish_mid_reply(gw: LiveGateway, fake: FakeSGLang, tmp_path: Path, agent: Any) -> int:
    before = len(fake.requests)
    t = threading.Thread(target=agent)
    t.start()
    deadline = time.monotonic() + 10
    while (len(fake.requests) == before or not fake.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # ~15 tokens in
    version = gw.admin.get("/v1/weights").json()["version"] + 1
    r = gw.admin.post("/v1/weights", json={"version": version, "model_path": str(tmp_path)})
    assert r.status_code == 200, r.text
    t.join(30)
    return int(version)


def test_a_non_streamed_constrained_reply_restarts(gw: LiveGateway, slow_fake: FakeSGLang, tmp_path: Path) -> None:
    cred = gw.group(2)["sessions"][0]
    result: dict[str, Any] = {}

    def agent() -> None:
        result["r"] = gw.openai(cred).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "json"}], max_tokens=40, response_format=JSON)

    version = publish_mid_reply(gw, slow_fake, tmp_path, agent)
    assert result["r"].choices[0].finish_reason == "length"
    turn = gw.session(cred["session_id"])["turns"][-1]
    assert len(turn["completion_ids"]) == 40 and turn["versions"] == [version] * 40  # nothing of the old reply
    mine = [p for p in slow_fake.requests if p["input_ids"][: len(turn["prompt_ids"])] == turn["prompt_ids"]]
    assert len(mine) == 2
    assert mine[1]["input_ids"] == turn["prompt_ids"]  # the prompt alone, not prompt + partial
    assert mine[1]["sampling_params"]["max_new_tokens"] == 40
    assert mine[1]["sampling_params"]["json_schema"] == '{"type": "object"}'


def test_a_streamed_constrained_reply_that_sent_tokens_fails(
    gw: LiveGateway, slow_fake: FakeSGLang, tmp_path: Path
) -> None:
    cred = gw.group(2)["sessions"][0]
    result: dict[str, Any] = {}

    def agent() -> None:
        stream = gw.openai(cred).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "json"}], max_tokens=40, response_format=JSON,
            stream=True)
        try:
            result["chunks"] = list(stream)
        except openai.APIError as e:
            result["error"] = str(e)

    publish_mid_reply(gw, slow_fake, tmp_path, agent)
    assert "cannot be resumed" in result.get("error", ""), result
