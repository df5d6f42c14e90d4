"""A non-streaming call whose client gives up (a read timeout) while the backend generates, on each route:
the backend request is aborted by its rid and the partial turn is stored with exactly the backend's tokens.
The scripted fake backend makes it fast and exact; tests/e2e/test_disconnect.py does it with the CPU engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

MAX = 400  # tokens asked; at 0.02 s a token the fake would take 8 s


@pytest.fixture(scope="module")
def slow_fake() -> Iterator[FakeSGLang]:
    with FakeSGLang(vocab=range(100, 1000), token_delay=0.02) as f:
        yield f


@pytest.fixture(scope="module")
def gw(slow_fake: FakeSGLang, tiny_model_dir: Path, sqlite_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[slow_fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as g:
        yield g


def wait_turn(gw: LiveGateway, session_id: str, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        turns = gw.session(session_id)["turns"]
        if turns:
            return turns[-1]  # type: ignore[no-any-return]
        time.sleep(0.02)
    raise AssertionError("no turn was stored")


ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "write a lot"}], "max_tokens": MAX}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": MAX}),
    ("/v1/responses", {"input": "write a lot", "max_output_tokens": MAX}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
def test_client_gone_aborts_backend_and_records_partial(gw: LiveGateway, slow_fake: FakeSGLang, path: str,
                                                        body: dict[str, Any]) -> None:
    cred = gw.group(2)["sessions"][0]
    sent = len(slow_fake.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.url}{path}", json={"model": "m", **body},
                   headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=httpx.Timeout(30, read=0.5))
    gone = time.monotonic()
    turn = wait_turn(gw, cred["session_id"])
    stored_after = time.monotonic() - gone
    (payload,) = slow_fake.requests[sent:]  # one attempt: the abort was not resubmitted
    assert payload["rid"] in slow_fake.aborted
    assert stored_after < 1.0, f"the partial turn was stored {stored_after:.2f} s after the client left"
    assert turn["finish_reason"] == "abort" and turn["client_disconnected"] is True
    backend_ids = next(h for h in reversed(slow_fake._history) if h[: len(payload["input_ids"])] == payload["input_ids"])
    assert turn["completion_ids"] == backend_ids[len(payload["input_ids"]):]
    assert 0 < len(turn["completion_ids"]) < MAX
    assert len(turn["logprobs"]) == len(turn["versions"]) == len(turn["completion_ids"])
    assert turn["prompt_ids"] == payload["input_ids"]


def test_openai_sdk_timeout(gw: LiveGateway, slow_fake: FakeSGLang) -> None:
    """The openai SDK giving up (its own timeout, no retries) is a client gone like any other."""
    import openai

    cred = gw.group(2)["sessions"][0]
    client = gw.openai(cred, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], max_tokens=MAX)
    turn = wait_turn(gw, cred["session_id"])
    assert turn["client_disconnected"] is True and 0 < len(turn["completion_ids"]) < MAX
    assert slow_fake.requests[-1]["rid"] in slow_fake.aborted


def test_client_that_waits_gets_the_whole_reply(gw: LiveGateway, slow_fake: FakeSGLang) -> None:
    """The watcher changes nothing for a client that stays: the reply runs to max_tokens, nothing is aborted."""
    cred = gw.group(2)["sessions"][0]
    r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {cred['api_key']}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "short"}], "max_tokens": 10},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    turn = gw.session(cred["session_id"])["turns"][-1]
    assert turn["client_disconnected"] is False and len(turn["completion_ids"]) == 10
    assert slow_fake.requests[-1]["rid"] not in slow_fake.aborted
