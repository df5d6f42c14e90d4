"""The routes of the weight sync over torch process groups (`POST /v1/weights/sync/init`, `POST /v1/weights/sync`,
`GET /v1/weights/sync`; admin): the coordination itself is gateway/weight_sync.py's `ProcessGroupSync`, one per
gateway process (`Serving.weight_sync`)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from gateway.auth import admin
from gateway.errors import BadRequest
from gateway.protocol import INT32_MAX, Strict
from gateway.routes.common import json_response, read_body
from gateway.services import serving

router = APIRouter()


class SyncInitBody(Strict):
    version: int = Field(ge=1, le=INT32_MAX)
    master_address: str = Field(min_length=1, max_length=255)
    """The trainer's host as the inference servers reach it (their TCP stores connect there)."""
    backend: Literal["gloo", "nccl"] = "nccl"
    timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """Each collective's and each server call's limit."""
    catch_up: bool = False
    """Send the current `version` again, only to the backends that lack it (`awaiting_backends`)."""


class Manifest(Strict):
    names: list[str] = Field(min_length=1, max_length=100_000)
    dtypes: list[str] = Field(min_length=1, max_length=100_000)
    shapes: list[list[int]] = Field(min_length=1, max_length=100_000)


class SyncBody(Strict):
    sync_id: str = Field(min_length=1, max_length=64)
    version: int = Field(ge=1, le=INT32_MAX)
    ports: dict[str, int] = Field(default_factory=dict)
    """group_name -> the port of the trainer's TCP store for that group."""
    buckets: list[Manifest] = Field(min_length=1, max_length=100_000)
    batch_ids: list[str] = Field(default_factory=list)
    results: dict[str, str] = Field(default_factory=dict)


@router.post("/v1/weights/sync/init")
async def sync_init(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, SyncInitBody)
    await serving(request).registry.reload()  # backends another gateway added take part
    return json_response(await serving(request).weight_sync.init(body.version, body.master_address, body.backend, body.timeout_s,
                                                   body.catch_up))


@router.post("/v1/weights/sync")
async def sync(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, SyncBody)
    for b in body.buckets:
        if not (len(b.names) == len(b.dtypes) == len(b.shapes)):
            raise BadRequest("each bucket needs as many dtypes and shapes as names", param="buckets")
    out = await serving(request).weight_sync.sync(body.sync_id, body.version, body.ports, [b.model_dump() for b in body.buckets],
                                    body.batch_ids, body.results)
    if not out.get("catch_up"):
        serving(request).budget.notify_one()  # a new version widens the staleness budget
    return json_response(out)


@router.get("/v1/weights/sync")
async def sync_progress(request: Request) -> Response:
    await admin(request)
    return json_response(await serving(request).weight_sync.progress())
