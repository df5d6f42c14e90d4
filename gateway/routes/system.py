"""Liveness and Prometheus metrics (no auth: they carry no secrets)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.routes.common import json_response

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    pool = request.app.state.pool
    healthy = sum(1 for b in pool.backends() if b.healthy)
    return json_response({"status": "ok", "backends_healthy": healthy, "backends": len(pool.backends())})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = request.app.state.metrics
    m.set_counts(await request.app.state.store.counts())
    m.set_eval(await request.app.state.store.eval_summary())
    return Response(m.render(), media_type="text/plain; version=0.0.4")
