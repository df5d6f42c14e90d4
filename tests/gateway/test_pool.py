"""BackendPool: routing (pure, no servers), then failover, health and fan-out against fake SGLang servers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.pool import Backend, BackendPool, NoBackendAvailable
from gateway.sglang import BackendRejected, BackendUnavailable, GenResult
from tests.fakes.sglang import FakeSGLang

PAYLOAD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # As the gateway's (gateway/app.py): no connection limit, no overall deadline (the clients set theirs).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        yield session


@pytest.fixture
def fakes() -> Iterator[list[FakeSGLang]]:
    with FakeSGLang() as a, FakeSGLang() as b:
        yield [a, b]


def routing_pool(http: aiohttp.ClientSession, n: int, **options: Any) -> tuple[BackendPool, list[Backend]]:
    """Routing needs no server: these URLs are never called."""
    pool = BackendPool(http, **options)
    return pool, [pool.add(f"http://127.0.0.1:{9 + i}", backend_id=f"b{i}") for i in range(n)]


async def generate(backend: Backend) -> GenResult:
    return await backend.client.generate(PAYLOAD)


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# -- routing ---------------------------------------------------------------------------------------


async def test_new_sessions_spread_and_then_stick(http: aiohttp.ClientSession) -> None:
    pool, (b0, b1, b2) = routing_pool(http, 3)
    first = {s: pool.pick(s, None) for s in ["s1", "s2", "s3", "s4", "s5", "s6"]}
    assert sorted(b.sessions for b in (b0, b1, b2)) == [2, 2, 2]  # ties go to the fewest sessions
    b0.in_flight, b1.in_flight, b2.in_flight = 50, 0, 0
    assert all(pool.pick(s, None) is b for s, b in first.items())  # load does not move a session


async def test_least_loaded_wins_for_a_new_session(http: aiohttp.ClientSession) -> None:
    pool, (b0, b1, b2) = routing_pool(http, 3)
    b0.in_flight, b1.in_flight, b2.in_flight = 5, 0, 3
    assert pool.pick("new", None) is b1


async def test_a_failed_backend_loses_its_sessions_for_good(http: aiohttp.ClientSession) -> None:
    pool, _ = routing_pool(http, 2)
    home = pool.pick("s", None)
    pool.mark_failed(home)
    moved = pool.pick("s", None)
    assert moved is not home
    pool.mark_healthy(home)
    assert pool.pick("s", None) is moved  # its cache is warm on the new backend now
    assert (home.sessions, moved.sessions) == (0, 1)


async def test_group_siblings_share_a_backend_within_the_slack(http: aiohttp.ClientSession) -> None:
    pool, _ = routing_pool(http, 3, affinity_slack=2)
    home = pool.pick("g-0", "g")
    home.in_flight = 2  # least-loaded + slack: still home
    assert pool.pick("g-1", "g") is home
    home.in_flight = 3  # above the slack: the least-loaded one
    other = pool.pick("g-2", "g")
    assert other is not home and other.in_flight == 0
    assert pool.pick("h-0", "h") is not home  # another group starts elsewhere


async def test_no_backend_available(http: aiohttp.ClientSession) -> None:
    pool, _ = routing_pool(http, 0)
    with pytest.raises(NoBackendAvailable):
        pool.pick("s", None)
    pool, backends = routing_pool(http, 2)
    for b in backends:
        pool.mark_failed(b)
    with pytest.raises(NoBackendAvailable):
        await pool.run_with_failover("s", None, generate)


async def test_add_and_remove_at_run_time(http: aiohttp.ClientSession) -> None:
    pool, (b0,) = routing_pool(http, 1)
    assert pool.pick("s", None) is b0
    b1 = pool.add("http://127.0.0.1:7/")
    assert pool.add("http://127.0.0.1:7") is b1  # same URL: the same entry
    assert [b.id for b in pool.backends()] == ["b0", b1.id]
    assert pool.remove("b0") is b0
    assert pool.pick("s", None) is b1 and pool.backends() == [b1]
    with pytest.raises(KeyError):
        pool.remove("b0")
    b2 = pool.add("http://127.0.0.1:8", healthy=False)  # waits for the health loop
    b1.in_flight = 10
    assert pool.pick("t", None) is b1 and b2.sessions == 0


# -- failover --------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["refused", "dropped", "503"])
async def test_failover_loses_no_call_when_one_backend_is_down(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang], failure: str
) -> None:
    down, up = fakes
    pool = BackendPool(http)
    bad, good = pool.add(down.url), pool.add(up.url)
    if failure == "refused":
        down.stop()
    elif failure == "dropped":
        down.down = True
    else:
        down.fail_next(100, status=503)

    results = await asyncio.gather(*(pool.run_with_failover(f"s{i}", None, generate) for i in range(20)))

    assert all(len(r.output_ids) == 4 for r in results)  # zero failed calls
    assert not bad.healthy and good.healthy and "/generate" in (bad.last_error or "")
    assert len(up.requests) == 20
    assert (bad.in_flight, good.in_flight) == (0, 0)
    assert pool.pick("s0", None) is good


async def test_rejected_requests_are_not_retried(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang]
) -> None:
    pool = BackendPool(http)
    backends = [pool.add(f.url) for f in fakes]

    async def bad_request(b: Backend) -> GenResult:
        return await b.client.generate({**PAYLOAD, "input_ids": []})

    with pytest.raises(BackendRejected):
        await pool.run_with_failover("s", None, bad_request)
    assert sum(len(f.requests) for f in fakes) == 1 and all(b.healthy for b in backends)


async def test_stream_fails_over_before_the_first_chunk(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang]
) -> None:
    down, up = fakes
    pool = BackendPool(http)
    bad, good = pool.add(down.url), pool.add(up.url)
    down.down = True
    stream = pool.stream_with_failover("s", None, PAYLOAD)
    first = await anext(stream)
    assert good.in_flight == 1  # counted while the stream is open
    rest = [c async for c in stream]
    assert sum(len(c.output_ids) for c in [first, *rest]) == 4 and rest[-1].finish_type == "length"
    assert not bad.healthy and good.in_flight == 0


# -- health ----------------------------------------------------------------------------------------


async def test_health_loop_fails_and_brings_back_backends(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang]
) -> None:
    recovered: list[str] = []

    async def on_recover(backend: Backend) -> None:
        if len(recovered) == 0:
            recovered.append("refused")
            raise BackendUnavailable("not ready yet")  # stays out; the next round tries again
        recovered.append(backend.id)
        backend.weight_version = (await backend.client.model_info())["weight_version"]

    pool = BackendPool(http, health_interval=0.05, on_recover=on_recover)
    a, b = pool.add(fakes[0].url, backend_id="a"), pool.add(fakes[1].url, backend_id="b")
    await pool.start()
    try:
        fakes[0].stop()
        await wait_for(lambda: not a.healthy)
        assert b.healthy and pool.pick("s", None) is b
        fakes[0].start()  # same port
        await wait_for(lambda: a.healthy)
        assert recovered == ["refused", "a"] and a.weight_version == "default"
        fakes[1].healthy = False  # /health answers 503
        await wait_for(lambda: not b.healthy)
    finally:
        await pool.stop()
    assert b.last_error == "3 health checks failed in a row"


async def test_a_paused_backend_is_probed_by_ping_and_resumed_even_out_of_rotation(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang]
) -> None:
    """SGLang's /health blocks while paused (then 503, and the server is marked unhealthy): a backend the pool paused
    is probed with /ping, kept out of rotation while paused if it was out, and `continue_all` resumes it too."""
    fakes[0].health_check_timeout = 0.3
    pool = BackendPool(http, health_interval=3600)
    a, b = pool.add(fakes[0].url, backend_id="a"), pool.add(fakes[1].url, backend_id="b")
    await pool.pause_all()
    pool.mark_failed(a, "a load failed")  # out of rotation while paused
    for _ in range(4):
        await pool.check_health()
    assert fakes[0].health_while_busy == 0 and not fakes[0].unhealthy and "/ping" in fakes[0].health_probes
    assert not a.healthy and b.healthy and a.health_misses == 0  # alive, but not admitted while paused
    errors = await pool.continue_all()
    assert errors == {"a": None, "b": None} and fakes[0].paused is None and fakes[1].paused is None
    await pool.check_health()  # unpaused: /health, which passes, and a is back
    assert a.healthy and fakes[0].health_probes[-1] == "/health"


async def test_one_missed_probe_does_not_take_a_busy_backend_out(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang]
) -> None:
    """A probe that fails now and then (a server too busy to answer in time) keeps the backend in rotation;
    `health_misses` failures in a row take it out."""
    pool = BackendPool(http, health_misses=3)
    a = pool.add(fakes[0].url, backend_id="a")
    fakes[0].healthy = False
    for _ in range(2):
        await pool.check_health()
        assert a.healthy
    fakes[0].healthy = True
    await pool.check_health()
    assert a.healthy and a.health_misses == 0
    fakes[0].healthy = False
    for _ in range(3):
        await pool.check_health()
    assert not a.healthy
    fakes[0].healthy = True


async def test_a_backend_added_unhealthy_joins_after_a_health_check(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang]
) -> None:
    pool = BackendPool(http)
    late = pool.add(fakes[0].url, healthy=False)
    with pytest.raises(NoBackendAvailable):
        pool.pick("s", None)
    await pool.check_health()
    assert late.healthy and pool.pick("s", None) is late


# -- weight-update fan-out -------------------------------------------------------------------------


async def test_pause_update_continue_fan_out(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang], tmp_path: Path
) -> None:
    pool = BackendPool(http)
    a, b = pool.add(fakes[0].url, backend_id="a"), pool.add(fakes[1].url, backend_id="b")
    for f in fakes:
        f.token_delay = 0.01
    running = [asyncio.create_task(x.client.generate({**PAYLOAD, "sampling_params": {}})) for x in (a, b)]
    await wait_for(lambda: all(f.running == 1 for f in fakes))

    assert await pool.pause_all("abort") == {"a": None, "b": None}
    partials = await asyncio.gather(*running)
    assert [p.finish_type for p in partials] == ["abort", "abort"]
    assert await pool.update_all(str(tmp_path), "1") == {"a": None, "b": None}
    assert await pool.continue_all() == {"a": None, "b": None}

    assert (a.weight_version, b.weight_version) == ("1", "1")
    assert [f.weight_version for f in fakes] == ["1", "1"]
    for f in fakes:
        assert [path for path, _ in f.calls] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert f.calls[1][1]["weight_version"] == "1" and f.calls[1][1]["model_path"] == str(tmp_path)


async def test_update_all_reports_each_backend_error(
    http: aiohttp.ClientSession, fakes: list[FakeSGLang], tmp_path: Path
) -> None:
    pool = BackendPool(http)
    a, b = pool.add(fakes[0].url, backend_id="a"), pool.add(fakes[1].url, backend_id="b")
    fakes[1].down = True
    errors = await pool.update_all(str(tmp_path), "2")
    assert errors["a"] is None and isinstance(errors["b"], BackendUnavailable)
    assert (a.weight_version, b.weight_version) == ("2", None)
    errors = await pool.update_all(str(tmp_path / "missing"), "3")
    assert isinstance(errors["a"], BackendRejected) and a.weight_version == "2"
