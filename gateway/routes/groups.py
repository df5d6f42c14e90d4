"""Groups and sessions REST: create a group of n sessions, read them, reward, finish, abandon."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import admin, admin_or_session
from gateway.errors import BadRequest, TooManyRequests
from gateway.protocol import (
    AbandonRequest,
    CreateGroupRequest,
    GroupRewardsRequest,
    RewardRequest,
    SamplingPolicy,
)
from gateway.records import session_record
from gateway.routes.common import json_response, read_body
from gateway.services import services, serving
from gateway.store.idempotency import check_key
from gateway.store.store import Store

router = APIRouter()


def public_base(request: Request) -> str:
    configured: str = services(request).settings.public_url
    return configured.rstrip("/") if configured else str(request.base_url).rstrip("/")


@router.post("/v1/groups")
async def create_group(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, CreateGroupRequest)
    admission = None if body.eval else serving(request).admission  # eval: outside the budget
    sampling = (body.sampling or SamplingPolicy()).model_dump()
    store: Store = services(request).store
    key = request.headers.get("idempotency-key")
    ids = None if key is None else await store.keyed_ids(check_key(key), body.n_samples)
    deadline = time.monotonic() + body.wait_seconds
    while True:
        if ids is not None and await store.created_before(ids[0], body.task, body.n_samples, body.eval):
            return _created(request, *ids, replayed=True)  # a retry: the first one's answer again
        try:
            async with admission.admit() if admission is not None else contextlib.nullcontext():
                gid, creds = await store.create_group(
                    body.task, body.n_samples, sampling=sampling, metadata=body.metadata, is_eval=body.eval, ids=ids
                )
            if admission is not None and body.wait_seconds:
                serving(request).budget.notify_one()  # there may be room for the next waiting one too
            break
        except TooManyRequests:  # the staleness budget is full: wait for room (a publish, a group dropped)
            if time.monotonic() >= deadline or await request.is_disconnected():
                serving(request).metrics.admission_refused.inc()
                raise
            await serving(request).budget.wait(deadline - time.monotonic())
        except Exception:
            # a keyed creation racing its own retry: the other one's insert won, answer as it did
            if ids is not None and await store.created_before(ids[0], body.task, body.n_samples, body.eval):
                return _created(request, *ids, replayed=True)
            raise
    return _created(request, gid, creds)


def _created(request: Request, gid: str, creds: list[tuple[str, str]], replayed: bool = False) -> Response:
    base = public_base(request)
    response = json_response({
        "group_id": gid,
        "sessions": [
            {"session_id": sid, "api_key": key, "base_url": f"{base}/v1",
             "session_base_url": f"{base}/sessions/{sid}/v1",
             # the Anthropic SDK appends /v1/messages to its base_url itself
             "anthropic_base_url": base, "anthropic_session_base_url": f"{base}/sessions/{sid}"}
            for sid, key in creds
        ],
    }, status=201)
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


@router.get("/v1/groups/{group_id}")
async def get_group(request: Request, group_id: str) -> Response:
    await admin(request)
    return json_response(await services(request).store.group(group_id))


@router.post("/v1/groups/{group_id}/rewards")
async def group_rewards(request: Request, group_id: str) -> Response:
    """Several sessions of a group rewarded (and with `finish`, finished) in one request and one transaction: what
    a runner sends once its group's sessions are done, instead of a request per session."""
    await admin(request)
    body = await read_body(request, GroupRewardsRequest)
    store: Store = services(request).store
    state, states = await store.set_group_rewards(group_id, [(r.session_id, r.reward) for r in body.rewards],
                                                  finish=body.finish)
    return json_response({"group_id": group_id, "ok": True, "state": state,
                          "sessions": [{"session_id": r.session_id, "state": st}
                                       for r, st in zip(body.rewards, states, strict=True)]})


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> Response:
    await admin(request)
    q = request.query_params
    try:
        since = float(q["since"]) if "since" in q else None
        limit = int(q.get("limit", "100"))
    except ValueError:
        raise BadRequest("since must be a number (epoch seconds) and limit an integer") from None
    store: Store = services(request).store
    rows = await store.list_sessions(state=q.get("state"), since=since, limit=limit, after=q.get("after"))
    full = q.get("include_turns", "false").lower() in ("1", "true", "yes")
    data: list[dict[str, Any]] = []
    for row in rows:
        if full:
            session, turns = await store.session(row["id"])
            data.append(session_record(session, turns))
        else:
            data.append(row)
    return json_response({"object": "list", "data": data, "next_after": rows[-1]["id"] if len(rows) == limit else None})


@router.get("/v1/sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> Response:
    await admin_or_session(request, session_id)
    session, turns = await services(request).store.session(session_id)
    return json_response(session_record(session, turns))


@router.post("/v1/sessions/{session_id}/reward")
async def reward(request: Request, session_id: str) -> Response:
    await admin_or_session(request, session_id)
    body = await read_body(request, RewardRequest)
    if body.reward is None and not body.turn_rewards:
        raise BadRequest("send {'reward': x} or {'turn_rewards': [{'turn_id', 'reward'}]}")
    store: Store = services(request).store
    state = await store.set_reward(
        session_id, body.reward, [(t.turn_id, t.reward) for t in body.turn_rewards or []] or None,
        finish=body.finish,
    )
    return json_response({"session_id": session_id, "ok": True, "state": state})


@router.post("/v1/sessions/{session_id}/finish")
async def finish(request: Request, session_id: str) -> Response:
    await admin_or_session(request, session_id)
    state = await services(request).store.end_session(session_id, "finished", None)
    return json_response({"session_id": session_id, "state": state})


@router.post("/v1/sessions/{session_id}/abandon")
async def abandon(request: Request, session_id: str) -> Response:
    await admin_or_session(request, session_id)
    body = await read_body(request, AbandonRequest)
    state = await services(request).store.end_session(session_id, "abandoned", body.reason)
    return json_response({"session_id": session_id, "state": state})
