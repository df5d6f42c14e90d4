"""The backend pool at run time (admin): add, list, remove SGLang servers. The registry behind them, which keeps
every gateway process's pool in step with the store's backend table, is gateway/registry.py."""

from __future__ import annotations

import contextlib

import sqlalchemy.exc
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from gateway.auth import admin
from gateway.backend_policy import check_registrable, check_resolved
from gateway.errors import BadRequest, NotFound
from gateway.protocol import Strict
from gateway.routes.common import json_response, read_body
from gateway.services import serving
from gateway.settings import backend_url
from gateway.sglang import BackendError
from gateway.weight_sync import AwaitingWeights

router = APIRouter()


class AddBackend(Strict):
    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://")
    """An SGLang server's base URL: http:// or https://, host, port (e.g. http://10.0.0.5:30000); what may be
    registered: gateway.backend_policy."""

    @field_validator("url")
    @classmethod
    def _valid(cls, v: str) -> str:
        return check_registrable(backend_url(v))


def backend_json(b: object) -> dict[str, object]:
    return {"id": b.id, "url": b.url, "healthy": b.healthy, "in_flight": b.in_flight,  # type: ignore[attr-defined]
            "weight_version": b.weight_version, "last_error": b.last_error}  # type: ignore[attr-defined]


@router.get("/v1/backends")
async def list_backends(request: Request) -> Response:
    await admin(request)
    return json_response({"object": "list", "data": [backend_json(b) for b in serving(request).pool.backends()]})


@router.post("/v1/backends")
async def add_backend(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, AddBackend)
    on = serving(request)
    registry = on.registry
    url = body.url.rstrip("/")
    try:
        await check_resolved(url)
    except ValueError as e:
        raise BadRequest(str(e), param="url") from None
    async with registry.adding(url) as stored_id:
        backend = registry.add(url, stored_id)  # no traffic until it serves the current weights (sync_backend)
        try:
            if not await backend.client.health():
                raise BackendError(f"{url}/health does not answer 200")
            await on.publisher.sync_backend(backend)
        except AwaitingWeights as e:  # kept out of rotation: the trainer's catch-up (or next publish) brings it up
            backend.last_error = str(e)
        except BackendError as e:
            with contextlib.suppress(KeyError):  # a DELETE may have taken it out meanwhile
                on.pool.remove(backend.id)
            # The URL given does not lead to a usable server: the request is what is wrong, not the gateway.
            raise BadRequest(f"backend {url} is not usable (it must answer GET /health and take the current "
                             f"weights; add it again once it does): {e}", param="url", code="backend_unusable") from e
        try:
            await registry.record(backend)
        except sqlalchemy.exc.IntegrityError:  # another gateway stored the same URL at the same moment
            pass
        except BaseException:  # not stored: not kept either, or the next read would drop it unannounced
            with contextlib.suppress(KeyError):
                on.pool.remove(backend.id)
            raise
    return json_response(backend_json(backend), status=201)


@router.delete("/v1/backends/{backend_id}")
async def remove_backend(request: Request, backend_id: str) -> Response:
    await admin(request)
    if not await serving(request).registry.remove(backend_id):
        raise NotFound(f"no backend {backend_id}")
    return json_response({"id": backend_id, "removed": True})
