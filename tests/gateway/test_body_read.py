"""`read_raw_body`'s time limit, in-process: a body that does not arrive in time is a 408; a cancellation from
outside (the server's, a client gone) stays a cancellation; a body that arrives in parts within the limit is read
whole; the limit on size still holds. The live 408 over a real socket: test_hostile_input.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import Request

from gateway.errors import PayloadTooLarge, RequestTimeout
from gateway.routes.common import read_raw_body
from gateway.services import SERVICES_ATTRIBUTE


def _request(receive: Any, *, timeout: float = 0.2, limit: int = 1000) -> Request:
    svc = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=limit, body_timeout_s=timeout),
                          loop=asyncio.get_running_loop())
    app = SimpleNamespace(**{SERVICES_ATTRIBUTE: svc})
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "app": app}
    return Request(scope, receive)


def _parts(*parts: bytes, gap: float = 0.0, then_wait: bool = False) -> Any:
    queue = list(parts)

    async def receive() -> dict[str, Any]:
        if not queue:
            await asyncio.Event().wait()  # never: the rest of the body does not come
        await asyncio.sleep(gap)
        part = queue.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(queue) or then_wait}

    return receive


async def test_a_body_in_parts_within_the_limit_is_read_whole() -> None:
    assert await read_raw_body(_request(_parts(b"ab", b"cd", b"e", gap=0.01))) == b"abcde"
    assert await read_raw_body(_request(_parts(b"whole"))) == b"whole"


async def test_a_body_that_stops_arriving_is_a_408() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(RequestTimeout, match=r"did not arrive within 0\.2 s"):
        await read_raw_body(_request(_parts(b"ab", then_wait=True)))
    assert 0.15 < loop.time() - t0 < 2
    # The task that timed out is not left cancelled: it goes on (an answer is written after the 408).
    await asyncio.sleep(0.01)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    reading = asyncio.ensure_future(read_raw_body(_request(_parts(b"ab", then_wait=True), timeout=5)))
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_a_cancellation_from_outside_at_the_deadline_stays_a_cancellation() -> None:
    """Both the timer and the caller cancel: the caller's cancellation wins (asyncio.timeout's rule)."""
    reading = asyncio.ensure_future(read_raw_body(_request(_parts(b"ab", then_wait=True), timeout=0.05)))
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, reading.cancel)
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_the_size_limit_still_holds() -> None:
    with pytest.raises(PayloadTooLarge):
        await read_raw_body(_request(_parts(b"x" * 600, b"y" * 600), limit=1000))
