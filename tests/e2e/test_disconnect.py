"""A client that gives up on a long non-streaming call, against the real CPU engine (`rollway engine` in its
own process) behind the gateway: the engine's request is aborted within a second (its decode counter stops),
and the partial turn is stored with exactly the ids the engine produced (a greedy replay of the same prompt
for that many tokens gives them back)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.services import app_serving
from rollway.embedded import engine_process
from tests.harness import LiveGateway

pytestmark = pytest.mark.slow  # ~35 s on 2 busy cores, most of it the engine's start

MAX_TOKENS = 3500  # the tiny model's context is 4096; seconds of decoding on a CPU


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_process(tiny_model_dir, log_path=tmp_path_factory.mktemp("engine") / "engine.log") as url:
        yield url


def decode_steps(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    m = re.search(r"^rollway_engine_decode_steps_total (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def test_client_gone_aborts_engine_and_stores_partial(engine_url: str, tiny_model_dir: Path, sqlite_url: str) -> None:
    with LiveGateway(backends=[engine_url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        cred = gw.group(2, sampling={"temperature": 0.0})["sessions"][0]  # greedy: the replay below is exact
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a very long story."}],
                "max_tokens": MAX_TOKENS}
        steps_before = decode_steps(engine_url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gw.url}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=httpx.Timeout(60, read=1.5))
        gone = time.monotonic()
        turns: list[dict[str, Any]] = []
        while not turns and time.monotonic() < gone + 30:
            turns = gw.session(cred["session_id"])["turns"]
            time.sleep(0.01)
        stored_after = time.monotonic() - gone
        (turn,) = turns
        # the engine answered the abort (the turn is stored from that answer) and decodes nothing more
        steps_at_store = decode_steps(engine_url)
        time.sleep(0.5)
        assert decode_steps(engine_url) == steps_at_store, "the engine is still decoding"
        assert steps_at_store > steps_before
        assert stored_after < 1.0, f"aborted and stored {stored_after:.2f} s after the client left"
        assert turn["finish_reason"] == "abort" and turn["client_disconnected"] is True
        partial = turn["completion_ids"]
        assert 0 < len(partial) < MAX_TOKENS
        assert len(turn["logprobs"]) == len(partial)
        # the stored ids are the engine's: the same prompt, greedy, for that many tokens
        stops = sorted(app_serving(gw.app).turns.stop_ids)
        replay = httpx.post(f"{engine_url}/generate", timeout=120, json={
            "input_ids": turn["prompt_ids"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": len(partial), "temperature": 0.0, "stop_token_ids": stops,
                                "skip_special_tokens": False}}).json()
        assert replay["output_ids"] == partial
        print(f"\nclient gone after 1.5 s: {len(partial)} tokens generated, engine aborted and turn stored "
              f"{stored_after * 1000:.0f} ms later")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stop_string_never_streamed(engine_url: str, tiny_model_dir: Path, sqlite_url: str, path: str) -> None:
    """The other end of a stream that must not leak: the engine stops after a stop string, the stored reply ends
    before it, and the streamed text (held back while it could be the string's start) equals the stored one."""
    import openai

    with LiveGateway(backends=[engine_url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        cred = gw.group(2, sampling={"temperature": 0.0})["sessions"][0]
        client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0)
        chat = path == "/v1/chat/completions"
        ask: dict[str, Any] = ({"messages": [{"role": "user", "content": "Say something."}]} if chat
                               else {"prompt": "Say something:"})
        create = client.chat.completions.create if chat else client.completions.create
        whole = create(model="m", max_tokens=60, **ask)
        text = whole.choices[0].message.content if chat else whole.choices[0].text
        assert text and len(text) > 12, text
        stop = text[8:12]  # greedy: the same prompt produces this again, and stops at it
        streamed = "".join(
            (c.choices[0].delta.content or "") if chat else c.choices[0].text
            for c in create(model="m", max_tokens=60, stop=[stop], stream=True, **ask) if c.choices
        )
        stored = gw.session(cred["session_id"])["turns"][-1]["reply"]["content"]
        assert stop not in streamed and streamed == stored == text[: text.index(stop)]
