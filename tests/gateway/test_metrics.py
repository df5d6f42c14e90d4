"""The gateway's per-process counters: the label children `Metrics` keeps count as `labels()` did."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.metrics import Metrics, RequestMetrics
from gateway.routes.dispatch import RouteLabel


def test_kept_children_count_every_call() -> None:
    m = Metrics()
    for _ in range(3):
        m.turn_stored(continuity="new-chain", prompt_tokens=10, completion_tokens=4, disconnected=False,
                      chain_reason="first_turn")
    m.turn_stored(continuity="extends", prompt_tokens=20, completion_tokens=5, disconnected=True, chain_reason=None,
                  resubmits=2)
    text = m.render().decode()
    assert 'rollway_turns_total{continuity="new-chain"} 3.0' in text
    assert 'rollway_turns_total{continuity="extends"} 1.0' in text
    assert 'rollway_chain_breaks_total{reason="first_turn"} 3.0' in text
    assert 'rollway_tokens_total{kind="prompt"} 50.0' in text
    assert 'rollway_tokens_total{kind="completion"} 17.0' in text
    assert "rollway_resubmits_total 2.0" in text and "rollway_client_disconnects_total 1.0" in text
    assert m.child(m.turns, "extends") is m.turns.labels("extends")


def test_request_metrics_count_by_route_and_status() -> None:
    m = Metrics()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["route"] = RouteLabel("/v1/chat/completions")
        await send({"type": "http.response.start", "status": scope["status"], "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def sent(message: Any) -> None:
        pass

    async def run() -> None:
        mw = RequestMetrics(app, lambda scope: m)
        for status in (200, 200, 400):
            await mw({"type": "http", "status": status}, None, sent)

    asyncio.run(run())
    text = m.render().decode()
    assert 'rollway_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text
    assert 'rollway_requests_total{route="/v1/chat/completions",status="400"} 1.0' in text
    assert 'rollway_request_seconds_count{route="/v1/chat/completions"} 3.0' in text
