"""The backend pool at run time (admin): add, list, remove SGLang servers.

The registry is a store table, so every gateway process sees the same servers (each reloads it on its
health interval); a new backend is brought to the current weight version before it takes traffic.
"""

from __future__ import annotations

import time
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, field_validator
from sqlalchemy import Table, delete, select

from gateway.auth import admin
from gateway.errors import BadRequest, NotFound
from gateway.protocol import Strict
from gateway.routes.common import json_response, read_body
from gateway.settings import backend_url
from gateway.sglang import BackendError
from gateway.store.models import BackendRow

router = APIRouter()
BR = cast(Table, BackendRow.__table__)


class AddBackend(Strict):
    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://")
    """An SGLang server's base URL: http:// or https://, host, port (e.g. http://10.0.0.5:30000)."""

    @field_validator("url")
    @classmethod
    def _valid(cls, v: str) -> str:
        return backend_url(v)


def backend_json(b: object) -> dict[str, object]:
    return {"id": b.id, "url": b.url, "healthy": b.healthy, "in_flight": b.in_flight,  # type: ignore[attr-defined]
            "weight_version": b.weight_version, "last_error": b.last_error}  # type: ignore[attr-defined]


@router.get("/v1/backends")
async def list_backends(request: Request) -> Response:
    await admin(request)
    return json_response({"object": "list", "data": [backend_json(b) for b in request.app.state.pool.backends()]})


@router.post("/v1/backends")
async def add_backend(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, AddBackend)
    state = request.app.state
    url = body.url.rstrip("/")
    backend = state.pool.add(url, healthy=False)  # no traffic until it serves the current weights
    try:
        if not await backend.client.health():
            raise BackendError(f"{url}/health does not answer 200")
        await state.publisher.sync_backend(backend)
    except BackendError as e:
        state.pool.remove(backend.id)
        # The URL given does not lead to a usable server: the request is what is wrong, not the gateway.
        raise BadRequest(f"backend {url} is not usable (it must answer GET /health and take the current "
                         f"weights; add it again once it does): {e}", param="url", code="backend_unusable") from e
    state.pool.mark_healthy(backend)
    async with state.store.begin() as conn:
        if (await conn.execute(select(BR.c.id).where(BR.c.url == url))).first() is None:
            await conn.execute(BR.insert().values(id=backend.id, url=url, created_at=time.time(), enabled=True))
    return json_response(backend_json(backend), status=201)


@router.delete("/v1/backends/{backend_id}")
async def remove_backend(request: Request, backend_id: str) -> Response:
    await admin(request)
    state = request.app.state
    try:
        backend = state.pool.remove(backend_id)
    except KeyError:
        raise NotFound(f"no backend {backend_id}") from None
    async with state.store.begin() as conn:
        await conn.execute(delete(BR).where(BR.c.url == backend.url))
    return json_response({"id": backend_id, "removed": True})
