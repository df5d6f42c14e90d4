"""The trainer's report of each step (admin): its figures and the advantage of every session it trained.

The trainer posts one report per published version (`POST /v1/training/steps`), off its training thread
(`StepReporter` in trainer/client.py); the store keeps them (`training_steps`, `trained_samples`) so that the
store alone can show loss, KL, entropy and advantages, e.g. in `rollway view` after the run. A report of a
version already reported replaces it: the trainer may retry one whose answer it did not see.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, StringConstraints, field_validator

from gateway.auth import admin
from gateway.protocol import INT32_MAX, Strict
from gateway.routes.common import json_response, read_body
from gateway.services import services

router = APIRouter()

MAX_METRICS = 256
MAX_SAMPLES = 65_536
Id = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class TrainedSampleBody(Strict):
    session_id: Id
    group_id: Id
    advantage: float
    """Token mean of the session's advantages over its loss tokens."""
    reward: float | None = None
    sequences: int = Field(default=1, ge=1, le=INT32_MAX)
    """How many sequences (chains) of the session trained."""
    loss_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    """Stored in a 32-bit column (int4 on PostgreSQL): 2**31 once passed the schema and failed the insert."""


class TrainingStepBody(Strict):
    step: int = Field(ge=0, le=INT32_MAX)
    version: int = Field(ge=0, le=INT32_MAX)
    """The version this step published: one report per version."""
    time: float | None = Field(default=None, ge=0, le=1e11)
    """When the step ended (epoch seconds, the trainer's clock); absent: when the report arrives."""
    metrics: dict[str, float | None] = Field(default_factory=dict)
    """Name -> number (null for one that was not finite)."""
    samples: list[TrainedSampleBody] = Field(default_factory=list, max_length=MAX_SAMPLES)

    @field_validator("metrics")
    @classmethod
    def _names(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        if len(v) > MAX_METRICS:
            raise ValueError(f"at most {MAX_METRICS} metrics")
        if bad := [k for k in v if not 1 <= len(k) <= 64]:
            raise ValueError(f"metric names must be 1 to 64 characters, got {bad[0][:80]!r}")
        return v

    @field_validator("samples")
    @classmethod
    def _once(cls, v: list[TrainedSampleBody]) -> list[TrainedSampleBody]:
        seen: set[str] = set()
        for s in v:
            if s.session_id in seen:
                raise ValueError(f"session {s.session_id} is listed twice")
            seen.add(s.session_id)
        return v


@router.post("/v1/training/steps")
async def report_step(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, TrainingStepBody)
    n = await services(request).store.record_training_step(
        step=body.step, version=body.version, created_at=body.time if body.time is not None else time.time(),
        metrics=body.metrics, samples=[s.model_dump() for s in body.samples])
    return json_response({"step": body.step, "version": body.version, "samples": n})
