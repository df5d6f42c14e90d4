"""The routes of the weight sync over torch process groups (`POST /v1/weights/sync/init`, `POST /v1/weights/sync`,
`GET /v1/weights/sync`; admin): the coordination itself is gateway/weight_sync.py's `ProcessGroupSync`, one per
gateway process (`Serving.weight_sync`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from gateway.auth import admin
from gateway.errors import BadRequest
from gateway.pool import Backend
from gateway.protocol import INT32_MAX, Strict
from gateway.routes.common import json_response, read_body
from gateway.services import serving
from gateway.sglang import BackendError
from gateway.store.leases import check_results

log = logging.getLogger("rollway.gateway")
router = APIRouter()


class SyncInitBody(Strict):
    version: int = Field(ge=1, le=INT32_MAX)
    master_address: str = Field(min_length=1, max_length=255)
    """The trainer's host as the inference servers reach it (their TCP stores connect there)."""
    backend: Literal["gloo", "nccl", "tensor"] = "nccl"
    """The process group's backend, or `tensor`: memory handles on this machine, no group (the trainer's host_id)."""
    host_id: str | None = Field(default=None, max_length=256)
    """The trainer's machine (its kernel boot id): the tensor path needs it to be this gateway's."""
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
    tensors: dict[str, list[list[str]]] = Field(default_factory=dict)
    """The tensor path: group_name -> per bucket, one `/update_weights_from_tensor` payload per TP rank."""
    load_format: Literal["flattened_bucket"] | None = "flattened_bucket"
    """The tensor path: the servers' `load_format` for those payloads (SGLang's): `flattened_bucket` (each a bucket's
    bytes and their metadata), or null (each a list of named tensors, loaded by the model's `load_weights`)."""
    batch_ids: list[str] = Field(default_factory=list)
    results: dict[str, str | int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _results(self) -> SyncBody:  # before the servers are paused for it
        check_results(self.results, self.version)
        return self


@router.post("/v1/weights/sync/init")
async def sync_init(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, SyncInitBody)
    await serving(request).registry.reload()  # backends another gateway added take part
    return json_response(await serving(request).weight_sync.init(body.version, body.master_address, body.backend,
                                                                  body.timeout_s, body.catch_up, body.host_id))


@router.post("/v1/weights/sync")
async def sync(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, SyncBody)
    for b in body.buckets:
        if not (len(b.names) == len(b.dtypes) == len(b.shapes)):
            raise BadRequest("each bucket needs as many dtypes and shapes as names", param="buckets")
    out = await serving(request).weight_sync.sync(body.sync_id, body.version, body.ports,
                                                  [b.model_dump() for b in body.buckets], body.batch_ids, body.results,
                                                  body.tensors, body.load_format)
    if not out.get("catch_up"):
        serving(request).budget.notify_one()  # a new version widens the staleness budget
    return json_response(out)


@router.get("/v1/weights/sync")
async def sync_progress(request: Request) -> Response:
    await admin(request)
    return json_response(await serving(request).weight_sync.progress())


# -- colocated: the servers give memory back for the trainer's step --------------------------------------------


class MemoryBody(Strict):
    tags: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = None
    """SGLang's tags (null: all three). `kv_cache` is what a colocated trainer's step usually needs."""
    timeout_s: float = Field(default=120.0, gt=0, le=3600)


async def _memory(request: Request, action: Literal["release", "resume"]) -> Response:
    """Release: pause every backend (`retract`: running requests go back to its queue, none is lost), then
    `/release_memory_occupation`. Resume: `/resume_memory_occupation`, then continue. Generation stalls in between."""
    await admin(request)
    body = await read_body(request, MemoryBody)
    backends = serving(request).pool.backends()
    t0 = time.perf_counter()
    failed: dict[str, str] = {}
    tags: list[str] | None = None if body.tags is None else list(body.tags)

    async def one(b: Backend) -> None:
        try:
            if action == "release":
                await b.client.pause("retract")
                try:
                    await b.client.memory_occupation("release", tags, body.timeout_s)
                except BackendError:
                    await b.client.continue_()  # nothing was released: generation goes on, as before the call
                    raise
            else:
                await b.client.memory_occupation("resume", tags, body.timeout_s)
                await b.client.continue_()
        except BackendError as e:
            failed[b.id] = str(e)
            log.warning("%s memory on backend %s: %s", action, b.id, e)

    await asyncio.gather(*(one(b) for b in backends))
    return json_response({"action": action, "tags": body.tags, "seconds": round(time.perf_counter() - t0, 4),
                          "backends": [b.id for b in backends if b.id not in failed], "failed_backends": failed})


@router.post("/v1/weights/memory/release")
async def release_memory(request: Request) -> Response:
    return await _memory(request, "release")


@router.post("/v1/weights/memory/resume")
async def resume_memory(request: Request) -> Response:
    return await _memory(request, "resume")
