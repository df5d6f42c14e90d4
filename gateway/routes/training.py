"""Trainer-facing REST (admin): leases of complete groups, renew, ack; weight publish and read."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, field_validator, model_validator

from gateway.auth import admin
from gateway.protocol import INT32_MAX, Strict
from gateway.routes.common import json_response, read_body
from gateway.routes.weight_sync import router as sync_router
from gateway.services import services, serving
from gateway.store.leases import LeaseRequest, LeaseResult, check_results
from rollway_common.wire import LEASE_FORMATS

router = APIRouter()
router.include_router(sync_router)  # publishing over process groups: /v1/weights/sync/init, /v1/weights/sync


class LeaseBody(Strict):
    max_groups: int = Field(default=8, ge=1, le=4096)
    min_groups: int = Field(default=1, ge=1, le=4096)
    """Wait (up to wait_seconds) until this many groups are complete before leasing any; after the wait, whatever
    is complete. A trainer that needs k more groups for its step asks for k at once: one lease (one batch, one
    ack of its filtered groups) where each group completing on its own would have made one each."""
    lease_seconds: float = Field(default=600.0, gt=0, le=86400)
    wait_seconds: float = Field(default=0.0, ge=0, le=600)
    groups_per_step: int | None = Field(default=None, ge=1, le=1_000_000)
    max_head_offpolicyness: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    trainer_version: int | None = Field(default=None, ge=0, le=INT32_MAX)
    train_constrained_turns: bool = False
    """Give the completions of constrained turns (decoded under a grammar) loss mask 1 too (gateway/samples.py)."""
    lease_format: int = 1
    """The samples' shape: 1 (absent: what a trainer written before format 2 gets) carries per-token `returns`
    discounted with the gateway's deprecated gamma; 2 carries the turns (`turn_ends`, `completion_starts`,
    `turn_rewards`) and the trainer computes returns (docs/http-api.md "POST /v1/batches")."""

    @field_validator("lease_format")
    @classmethod
    def _known_format(cls, v: int) -> int:
        if v not in LEASE_FORMATS:
            raise ValueError(f"lease_format {v} is not one this gateway speaks: {', '.join(map(str, LEASE_FORMATS))}")
        return v

    @model_validator(mode="after")
    def _min_within_max(self) -> LeaseBody:
        if self.min_groups > self.max_groups:
            raise ValueError(f"min_groups ({self.min_groups}) must not exceed max_groups ({self.max_groups})")
        return self


class RenewBody(Strict):
    lease_seconds: float = Field(default=600.0, gt=0, le=86400)


class AckBody(Strict):
    results: dict[str, str | int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _results(self) -> AckBody:
        check_results(self.results, None)
        return self


class PublishBody(Strict):
    version: int = Field(ge=1, le=INT32_MAX)
    """Stored per token as int32: a larger one would make every later turn unstorable (and, versions only
    rising, could not be undone), so it is refused before anything is paused."""
    model_path: str = Field(min_length=1, max_length=4096)
    batch_id: str | None = None
    batch_ids: list[str] = Field(default_factory=list)
    """Several leases trained in one step (refills after dynamic filtering): all acked with the publish."""
    results: dict[str, str | int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _results(self) -> PublishBody:  # before any backend is paused for a load the ack would then refuse
        check_results(self.results, self.version)
        return self

    @field_validator("model_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # Each backend resolves the path on its own machine: only an absolute path means the same folder to
        # all of them. Checked here, before every backend is paused for a load that can only fail.
        if not v.removeprefix("lora:").startswith("/"):  # lora:/abs/folder: a LoRA adapter (gateway/adapters.py)
            raise ValueError(f"must be an absolute path on the inference servers, got {v!r}")
        return v


@router.post("/v1/batches")
async def lease(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, LeaseBody)
    leases = serving(request).leases
    req = LeaseRequest(body.max_groups, body.lease_seconds, body.groups_per_step, body.max_head_offpolicyness,
                       body.trainer_version, body.train_constrained_turns, body.lease_format)
    deadline = time.monotonic() + body.wait_seconds
    stale_total = 0
    await leases.remember_params(req)  # admission uses them now, not only once a wait for min_groups ends
    completions = serving(request).completions
    count, mark, missing = True, 0, 0
    while True:
        waited_out = time.monotonic() >= deadline
        ready = body.min_groups <= 1 or waited_out
        if not ready and count:
            queued = await leases.queued(body.min_groups)
            ready = queued >= body.min_groups
            mark, missing = completions.count, body.min_groups - queued
        if ready:
            got = await leases.lease(req)
            stale_total += got.dropped_stale
            if got.dropped_stale:
                serving(request).metrics.stale_dropped.inc(got.dropped_stale)
            if got.groups or waited_out:
                break
        if await request.is_disconnected():
            got = LeaseResult(None, 0.0, [], 0)
            break
        woken = await completions.wait(deadline - time.monotonic())
        # Count again after a poll interval (changes through another gateway, lapsed leases) or once this gateway
        # saw as many completions as were missing: a count per completed group was ~5% of the gateway's CPU.
        count = not woken or completions.count - mark >= missing
    out = {"batch_id": got.batch_id, "expires_at": got.expires_at, "groups": got.groups, "dropped_stale": stale_total}
    if body.lease_format >= 2:
        settings = services(request).settings
        out["lease_format"] = body.lease_format
        if "gamma" in settings.model_fields_set:  # the deprecated gateway gamma, for a trainer without its own
            out["gamma"] = settings.gamma
    return json_response(out)


@router.post("/v1/batches/{batch_id}/renew")
async def renew(request: Request, batch_id: str) -> Response:
    await admin(request)
    body = await read_body(request, RenewBody)
    expires = await serving(request).leases.renew(batch_id, body.lease_seconds)
    return json_response({"batch_id": batch_id, "expires_at": expires})


@router.post("/v1/batches/{batch_id}/ack")
async def ack(request: Request, batch_id: str) -> Response:
    await admin(request)
    body = await read_body(request, AckBody)
    await serving(request).leases.ack(batch_id, body.results)
    serving(request).budget.notify_one()  # filtered groups leave the staleness budget: room for new ones
    return json_response({"batch_id": batch_id, "state": "acked"})


@router.post("/v1/weights")
async def publish(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, PublishBody)
    batch_ids = [*([body.batch_id] if body.batch_id else []), *body.batch_ids]
    await serving(request).registry.reload()  # backends another gateway added take part (or are brought up)
    out = await serving(request).publisher.publish(body.version, body.model_path, batch_ids, body.results)
    serving(request).budget.notify_one()  # a new version widens the staleness budget
    return json_response(out)


@router.get("/v1/weights")
async def current(request: Request) -> Response:
    await admin(request)
    version, path = await serving(request).leases.current_weights()
    return json_response({"version": version, "model_path": path})
