"""`/health`, `/health_generate`, `/ping` and `/ready` as SGLang 0.5.23 answers them (srt/entrypoints/http_server.py
`health_generate`, `ready`, `sagemaker_health`; srt/managers/tokenizer_manager.py `is_healthy`, `is_ready`):

- `/health` runs a one-token generation; a pause or a weight load holds it back, for at most
  SGLANG_HEALTH_CHECK_TIMEOUT seconds (20), after which it answers 503 and marks the server unhealthy. A passing
  one marks it up again.
- `/ping` is a flag check: 200 while the server is up (paused included), 503 once marked unhealthy.
- `/ready` is 200 while up and not paused.

Who probes what (docs/architecture.md "Liveness"): the gateway's pool and `rollway serve`'s supervisor judge
liveness by `/ping` (and by the process), never by `/health` on a server the gateway paused.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from engine.protocol import parse_generate

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


def health_check_timeout() -> float:
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


class Liveness:
    """The flags SGLang's tokenizer manager keeps: up or unhealthy, paused, loading weights."""

    def __init__(self) -> None:
        self.unhealthy = False
        self.paused = False
        self.loading = 0

    def loads(self) -> _Loading:
        """`with liveness.loads():` around a weight load (holds `/health` back, as SGLang's model-update lock)."""
        return _Loading(self)


class _Loading:
    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness

    def __enter__(self) -> None:
        self.liveness.loading += 1

    def __exit__(self, *exc: object) -> None:
        self.liveness.loading -= 1


def add_liveness_routes(app: FastAPI, engine: Any) -> None:
    live: Liveness = engine.liveness
    scheduler = engine.scheduler

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        scheduler.start()
        if not scheduler.alive:
            return Response(status_code=503)
        deadline = time.monotonic() + health_check_timeout()
        while live.paused or live.loading:  # SGLang's request waits in the tokenizer manager
            if time.monotonic() >= deadline:
                live.unhealthy = True
                return Response(status_code=503)
            await asyncio.sleep(0.05)
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "rid": f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"}
        spec = parse_generate(body, engine.tokenizer, engine.context_length, engine.vocab_size).specs[0]
        try:
            await asyncio.wait_for(engine.collect(spec), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            live.unhealthy = True
            return Response(status_code=503)
        live.unhealthy = False
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200 if scheduler.alive and not live.unhealthy else 503)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if scheduler.alive and not live.unhealthy and not live.paused else 503)
