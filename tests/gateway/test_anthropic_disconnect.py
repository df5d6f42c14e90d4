"""A Messages client that leaves mid-reply, whole or streamed: the backend request is aborted and the partial
turn is stored (finish reason `abort`, `client_disconnected`), through the chat route's own handling."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

BODY = {"model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "write a long story"}]}


@pytest.fixture(scope="module")
def slow() -> Iterator[FakeSGLang]:
    with FakeSGLang(token_delay=0.02) as f:  # 400 tokens: 8 s, far longer than the client waits
        yield f


@pytest.fixture(scope="module")
def gw(slow: FakeSGLang, tiny_model_dir: Path, sqlite_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[slow.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as g:
        yield g


def stored_turn(gw: LiveGateway, session_id: str, within: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = gw.session(session_id)["turns"]
        if got:
            return got[0]  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError("no turn stored")


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_aborts_and_stores_partial(gw: LiveGateway, slow: FakeSGLang, stream: bool) -> None:
    cred = gw.group(1)["sessions"][0]
    headers = {"x-api-key": cred["api_key"], "anthropic-version": "2023-06-01"}
    left = time.monotonic()
    if stream:
        with httpx.stream("POST", f"{gw.url}/v1/messages", json={**BODY, "stream": True}, headers=headers,
                          timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if "text_delta" in line:
                    break  # a few tokens in, the client closes the connection
        left = time.monotonic()
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gw.url}/v1/messages", json=BODY, headers=headers, timeout=httpx.Timeout(30, read=1.0))
        left = time.monotonic()
    turn = stored_turn(gw, cred["session_id"])
    assert time.monotonic() - left < 3.0
    assert turn["finish_reason"] == "abort" and turn["client_disconnected"] is True
    assert turn["id"].startswith("msg_") and 0 < len(turn["completion_ids"]) < BODY["max_tokens"]
    assert len(turn["logprobs"]) == len(turn["completion_ids"])
    deadline = time.monotonic() + 2
    while slow.running and time.monotonic() < deadline:  # the backend stops generating for nobody
        time.sleep(0.05)
    assert slow.running == 0
