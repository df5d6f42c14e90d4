"""Liveness, readiness and Prometheus metrics (no auth: they carry no secrets); and GET /v1/models/{id} for
the OpenAI and Anthropic SDKs (session auth, as /v1/models)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.anthropic.api import retrieve_model
from gateway.routes.common import json_response
from gateway.services import services, serving

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """Liveness: the process serves HTTP. 200 whatever the backends do (see /ready)."""
    pool = serving(request).pool
    healthy = sum(1 for b in pool.backends() if b.healthy)
    return json_response({"status": "ok", "backends_healthy": healthy, "backends": len(pool.backends())})


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness, for a load balancer or a compose healthcheck: 200 `{"ready": true, ...}` while at least one
    backend takes traffic, 503 `{"ready": false, "reason": ...}` otherwise.

    A backend counts when the pool routes to it and it has answered GET /health since it joined. The pool
    routes to the backends given at start before its first health round, so one not yet seen answering is
    probed here; after that the pool's health loop is the judge. Backend URLs stay out of the answer (it is
    served without a key); GET /v1/backends lists them with their last error."""
    pool = serving(request).pool
    backends = pool.backends()
    seen = serving(request).ready_backends_seen
    routed = [b for b in backends if b.healthy]
    unseen = [b for b in routed if b.id not in seen]
    for backend, ok in zip(unseen, await asyncio.gather(*(b.client.probe() for b in unseen)), strict=True):
        if ok:
            seen.add(backend.id)
    healthy = sum(1 for b in routed if b.id in seen)
    body: dict[str, object] = {"ready": healthy > 0, "backends_healthy": healthy, "backends": len(backends)}
    supervisor = serving(request).engine_supervisor
    if supervisor is not None:  # `rollway serve`'s embedded engine: restarted when it dies (rollway/embedded.py)
        body["engine"] = supervisor.status()
    if healthy:
        return json_response(body)
    if supervisor is not None and supervisor.state != "running":
        body["reason"] = (f"the embedded engine {supervisor.last_death}: it is being restarted (restarts so far: "
                          f"{supervisor.restarts})")
        return json_response(body, 503)
    if not backends:
        body["reason"] = "no backend: start with --backend URL (or ROLLWAY_BACKENDS), or add one with POST /v1/backends"
    else:
        body["reason"] = (f"no healthy backend: none of {len(backends)} answers GET /health "
                          "(GET /v1/backends lists them with their last error)")
    return json_response(body, 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = serving(request).metrics
    m.set_counts(await services(request).store.counts())
    m.set_eval(await services(request).store.eval_summary())
    return Response(m.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models/{model_id:path}")  # a served name may hold a slash (org/model)
async def model(request: Request, model_id: str) -> Response:
    """The served model, in the OpenAI or (with `anthropic-version`) Anthropic shape; session auth."""
    return await retrieve_model(request, None, model_id)


@router.get("/sessions/{session_id}/v1/models/{model_id:path}")
async def session_model(request: Request, session_id: str, model_id: str) -> Response:
    return await retrieve_model(request, session_id, model_id)
