"""SGLangClient against the scripted fake SGLang server over real HTTP (tests/fakes/sglang.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.sglang import BackendRejected, BackendUnavailable, GenChunk, SGLangClient
from tests.fakes.sglang import FakeSGLang

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    with FakeSGLang(token_delay=0.005) as f:
        yield f


@pytest.fixture(scope="module")
def by_version() -> Iterator[dict[bool, FakeSGLang]]:
    """A 0.5-style and a 0.4-style (legacy) fake, shared by the tests that only send bad requests."""
    with FakeSGLang() as new, FakeSGLang(legacy=True) as old:
        yield {False: new, True: old}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # As the gateway's (gateway/app.py): no connection limit, no overall deadline (the clients set theirs).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        yield session


def request(max_new: int = 8, **extra: Any) -> dict[str, Any]:
    sp = {"max_new_tokens": max_new, "sampling_seed": 7, "stop_token_ids": [2]}
    return {"input_ids": [1, 5, 9], "sampling_params": sp, "return_logprob": True, **extra}


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_generate_returns_exact_ids_logprobs_and_meta(http: aiohttp.ClientSession) -> None:
    with FakeSGLang(skip_tokenizer_init=True) as fake:
        fake.script([[11, 12, 13, 2, 99]])  # the stop id ends it; 99 is never produced
        client = SGLangClient(http, fake.url)
        result = await client.generate(request(rid="r1", top_logprobs_num=3))
        async with http.post(fake.url + "/generate", json=request(top_logprobs_num=3)) as resp:
            raw = await resp.json()  # same prompt and seed: the same draws, unscripted

    assert result.output_ids == [11, 12, 13, 2]
    assert result.finish_reason == {"type": "stop", "matched": 2}
    assert result.finish_type == "stop"
    assert "text" not in raw  # --skip-tokenizer-init: the client never needs it
    assert result.logprobs == [t[0] for t in raw["meta_info"]["output_token_logprobs"][:4]]
    assert result.top_logprobs is not None
    assert [row[0] for row in result.top_logprobs] == list(zip([11, 12, 13, 2], result.logprobs, strict=True))
    assert all(len(row) == 3 for row in result.top_logprobs)
    assert (result.rid, result.prompt_tokens, result.weight_version) == ("r1", 3, "default")
    sent = fake.requests[0]
    assert sent["input_ids"] == [1, 5, 9] and sent["stream"] is False
    assert sent["sampling_params"] == {"max_new_tokens": 8, "sampling_seed": 7, "stop_token_ids": [2]}


async def test_without_return_logprob_there_are_no_logprobs(
    http: aiohttp.ClientSession, fake: FakeSGLang
) -> None:
    result = await SGLangClient(http, fake.url).generate(request(max_new=3, return_logprob=False))
    assert len(result.output_ids) == 3 and result.logprobs is None and result.top_logprobs is None
    assert result.finish_reason == {"type": "length", "length": 3}


@pytest.mark.parametrize(
    ("incremental", "incremental_logprobs"),
    [(False, False), (True, True), (True, False)],
    ids=["cumulative", "incremental", "incremental-ids-cumulative-logprobs"],
)
async def test_stream_modes_normalize_to_the_same_chunks(
    http: aiohttp.ClientSession, incremental: bool, incremental_logprobs: bool
) -> None:
    with FakeSGLang(
        incremental=incremental, incremental_logprobs=incremental_logprobs, stream_interval=3
    ) as fake:
        client = SGLangClient(http, fake.url)
        whole = await client.generate(request(max_new=10, top_logprobs_num=2))
        chunks = [c async for c in client.generate_stream(request(max_new=10, top_logprobs_num=2))]

    assert all(isinstance(c, GenChunk) for c in chunks)
    assert [len(c.output_ids) for c in chunks] == [3, 3, 3, 1]
    assert [len(c.logprobs or []) for c in chunks] == [3, 3, 3, 1]
    assert [c.finish_reason for c in chunks] == [None, None, None, {"type": "length", "length": 10}]
    assert [t for c in chunks for t in c.output_ids] == whole.output_ids
    assert [lp for c in chunks for lp in c.logprobs or []] == whole.logprobs
    assert [row for c in chunks for row in c.top_logprobs or []] == whole.top_logprobs
    assert {(c.weight_version, c.prompt_tokens, c.rid) for c in chunks} == {("default", 3, chunks[0].rid)}
    assert fake.requests[-1]["stream"] is True


async def test_stream_events_longer_than_aiohttp_line_limit(http: aiohttp.ClientSession) -> None:
    with FakeSGLang(stream_interval=1500) as fake:  # cumulative: the last chunk is ~0.5 MB on one line
        client = SGLangClient(http, fake.url)
        payload = request(max_new=3000, top_logprobs_num=5)
        chunks = [c async for c in client.generate_stream(payload)]
    assert [len(c.output_ids) for c in chunks] == [1500, 1500]
    assert [len(row) for c in chunks for row in c.top_logprobs or []] == [5] * 3000
    assert chunks[-1].finish_reason == {"type": "length", "length": 3000}


@pytest.mark.parametrize(
    ("legacy", "change", "expected"),
    [
        (False, {"input_ids": []}, "non-empty list"),
        (
            False,
            {"sampling_params": {"bogus": 1}},
            "unexpected keyword argument 'bogus'",
        ),  # {"error": "<text>"}
        (
            True,
            {"sampling_params": {"bogus": 1}},
            "unexpected keyword argument 'bogus'",
        ),  # {"object": "error"}
        (False, {"sampling_params": {"temperature": -1}}, "temperature must be non-negative"),
        (False, {"sampling_params": {"max_new_tokens": 5000}}, "maximum context length of 4096"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_bad_requests_are_rejected_with_the_server_message(
    http: aiohttp.ClientSession,
    by_version: dict[bool, FakeSGLang],
    legacy: bool,
    change: dict[str, Any],
    expected: str,
    stream: bool,
) -> None:
    client = SGLangClient(http, by_version[legacy].url)
    with pytest.raises(BackendRejected) as err:
        if stream:
            _ = [c async for c in client.generate_stream({**request(), **change})]
        else:
            await client.generate({**request(), **change})
    assert err.value.status == 400
    assert expected in err.value.message


@pytest.mark.parametrize(
    ("status", "kind"),
    [(503, BackendUnavailable), (500, BackendUnavailable), (429, BackendUnavailable), (404, BackendRejected)],
)
async def test_http_status_decides_retryable(
    http: aiohttp.ClientSession, fake: FakeSGLang, status: int, kind: type[Exception]
) -> None:
    fake.fail_next(1, status=status)
    client = SGLangClient(http, fake.url)
    with pytest.raises(kind) as err:
        await client.generate(request())
    assert getattr(err.value, "status", None) == status
    assert len((await client.generate(request())).output_ids) > 0  # only the next one failed


async def test_dropped_and_refused_connections_are_unavailable(
    http: aiohttp.ClientSession, fake: FakeSGLang
) -> None:
    client = SGLangClient(http, fake.url)
    fake.down = True
    with pytest.raises(BackendUnavailable):
        await client.generate(request())
    with pytest.raises(BackendUnavailable):
        _ = [c async for c in client.generate_stream(request())]
    fake.down = False
    fake.stop()
    with pytest.raises(BackendUnavailable):
        await client.generate(request())
    assert await client.health() is False


async def test_read_timeout_is_unavailable(http: aiohttp.ClientSession, fake: FakeSGLang) -> None:
    fake.token_delay = 0.3
    with pytest.raises(BackendUnavailable):
        await SGLangClient(http, fake.url).generate(request(max_new=2), read_timeout=0.1)


async def test_mid_stream_error_event_raises_after_the_first_chunks(
    http: aiohttp.ClientSession, fake: FakeSGLang
) -> None:
    fake.fail_stream(after_tokens=3, message="boom at token 3")
    got: list[int] = []
    with pytest.raises(BackendRejected, match="boom at token 3"):
        async for chunk in SGLangClient(http, fake.url).generate_stream(request(max_new=20)):
            got += chunk.output_ids
    assert len(got) == 2


async def test_stream_cut_off_mid_way_is_unavailable(http: aiohttp.ClientSession, fake: FakeSGLang) -> None:
    fake.fail_stream(after_tokens=3, message=None)
    with pytest.raises(BackendUnavailable):
        _ = [c async for c in SGLangClient(http, fake.url).generate_stream(request(max_new=20))]


async def test_closing_a_stream_early_aborts_it_on_the_server(
    http: aiohttp.ClientSession, fake: FakeSGLang
) -> None:
    fake.token_delay = 0.02
    stream = SGLangClient(http, fake.url).generate_stream(request(max_new=1000, rid="gone"))
    first = await anext(stream)
    await anext(stream)
    await stream.aclose()  # what the gateway does when its own client disconnects
    await wait_for(lambda: "gone" in fake.disconnected)
    assert first.rid == "gone" and fake.running == 0


async def test_pause_abort_returns_partials_and_holds_new_requests(
    http: aiohttp.ClientSession, fake: FakeSGLang
) -> None:
    client = SGLangClient(http, fake.url)
    plain = asyncio.create_task(client.generate(request(max_new=4000)))
    streamed: list[GenChunk] = []

    async def consume() -> None:
        async for chunk in client.generate_stream(request(max_new=4000)):
            streamed.append(chunk)

    stream_task = asyncio.create_task(consume())
    await wait_for(lambda: len(streamed) >= 3)
    await client.pause("abort")
    partial = await plain
    await stream_task
    assert partial.finish_reason is not None and partial.finish_reason["type"] == "abort"
    assert partial.finish_reason["message"] == "Aborted"
    assert 0 < len(partial.output_ids) == len(partial.logprobs or [])
    assert streamed[-1].finish_type == "abort"

    waiting = asyncio.create_task(client.generate(request(max_new=3)))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # paused: new requests wait, they are not rejected
    await client.continue_()
    assert (await waiting).finish_reason == {"type": "length", "length": 3}
    assert [path for path, _ in fake.calls] == ["/pause_generation", "/continue_generation"]
    assert fake.calls[0][1] == {"mode": "abort"}


async def test_retract_pause_resumes_running_requests(http: aiohttp.ClientSession, fake: FakeSGLang) -> None:
    client = SGLangClient(http, fake.url)
    task = asyncio.create_task(client.generate(request(max_new=30)))
    await wait_for(lambda: fake.running == 1)
    await client.pause("retract")
    await asyncio.sleep(0.1)
    assert not task.done()
    await client.continue_()
    assert (await task).finish_reason == {"type": "length", "length": 30}


async def test_abort_by_the_attempts_rid(http: aiohttp.ClientSession, fake: FakeSGLang) -> None:
    """The gateway aborts the exact rid of an attempt: SGLang 0.5.23 drops an abort of a rid it does not hold."""
    client = SGLangClient(http, fake.url)
    task = asyncio.create_task(client.generate(request(max_new=4000, rid="abc_0")))
    await wait_for(lambda: fake.running == 1)
    await client.abort("abc")  # a prefix only: dropped
    await asyncio.sleep(0.2)
    assert not task.done()
    await client.abort("abc_0")
    result = await task
    assert result.finish_type == "abort" and result.rid == "abc_0" and fake.aborted == ["abc_0"]


async def test_update_weights_from_disk(
    http: aiohttp.ClientSession, fake: FakeSGLang, tmp_path: Path
) -> None:
    client = SGLangClient(http, fake.url)
    await client.update_weights_from_disk(str(tmp_path), "3")
    info = await client.model_info()
    assert (info["model_path"], info["weight_version"]) == (str(tmp_path), "3")
    assert (await client.generate(request(max_new=2))).weight_version == "3"
    with pytest.raises(BackendRejected, match="does not exist") as err:
        await client.update_weights_from_disk(str(tmp_path / "missing"), "4")
    assert err.value.status == 400
    assert (await client.model_info())["weight_version"] == "3"


@pytest.mark.parametrize("legacy", [False, True], ids=["0.5", "0.4-paths"])
async def test_model_and_server_info(http: aiohttp.ClientSession, legacy: bool) -> None:
    with FakeSGLang(legacy=legacy, context_length=2048) as fake:
        client = SGLangClient(http, fake.url)
        assert (await client.model_info())["is_generation"] is True
        info = await client.server_info()
    assert (info["context_length"], info["max_req_input_len"]) == (2048, 2047)


async def test_health_and_flush_cache(http: aiohttp.ClientSession, fake: FakeSGLang) -> None:
    client = SGLangClient(http, fake.url)
    assert await client.health() is True
    fake.healthy = False
    assert await client.health() is False
    task = asyncio.create_task(client.generate(request(max_new=4000)))
    await wait_for(lambda: fake.running == 1)
    assert await client.flush_cache() is False  # refused while requests run
    await client.abort("", abort_all=True)
    await task
    assert await client.flush_cache() is True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process(module: str, *args: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=REPO)  # its output lands in pytest's capture
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_fakes_run_as_processes(http: aiohttp.ClientSession) -> None:
    with (
        process("tests.fakes.sglang", "--incremental") as fake_url,
        process("tests.fakes.fast_backend") as fast_url,
    ):
        fake, fast = SGLangClient(http, fake_url), SGLangClient(http, fast_url)
        for client in (fake, fast):
            deadline = time.monotonic() + 30
            while not await client.health():
                assert time.monotonic() < deadline, f"{client.url} did not start"
                await asyncio.sleep(0.05)
        streamed = [c async for c in fake.generate_stream(request(max_new=5))]
        assert sum(len(c.output_ids) for c in streamed) == 5
        reply = await fast.generate(request(rid="x"))
        chunks = [c async for c in fast.generate_stream(request())]
    assert len(reply.output_ids) == 30 and reply.rid == "x" and reply.finish_type == "stop"
    assert [t for c in chunks for t in c.output_ids] == reply.output_ids
    assert [lp for c in chunks for lp in c.logprobs or []] == reply.logprobs
