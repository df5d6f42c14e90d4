"""Groups and sessions REST: create a group of n sessions, read them, reward, finish, abandon."""

from __future__ import annotations

import contextlib
import logging
import math
import re
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
from gateway.routes.common import json_response, parse_body, read_body, read_raw_body
from gateway.services import services, serving
from gateway.store.idempotency import check_key
from gateway.store.store import Store

router = APIRouter()
log = logging.getLogger("rollway.gateway")


def public_base(request: Request) -> str:
    configured: str = services(request).settings.public_url
    return configured.rstrip("/") if configured else str(request.base_url).rstrip("/")


_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|(?<![\d.eE+-])-?\d{19,}(?![\d.eE])')
"""A JSON string (skipped whole), or an integer literal of 19 digits or more."""


def refuse_wide_integers(raw: bytes) -> None:
    """A group's task and metadata are kept as sent, but an integer outside 64 bits was not: the JSON parser made
    it a float (2**64 came back as 1.8446744073709552e+19), and SQLite a REAL at the top level. Refused instead."""
    for m in _TOKENS.finditer(raw):
        token = m.group()
        if token[:1] == b'"':
            continue
        digits = len(token) - (token[:1] == b"-")  # a valid body's integers have no leading zeros
        if digits > 19 or not -(2**63) <= int(token) < 2**63:  # int() only on 19 digits: no int_max_str_digits
            raise BadRequest(f"the integer {token[:40].decode()}{'...' if len(token) > 40 else ''} is outside 64 "
                             "bits and would not be kept exactly; send it as a string")


@router.post("/v1/groups")
async def create_group(request: Request) -> Response:
    await admin(request)
    raw = await read_raw_body(request)
    body = parse_body(raw, CreateGroupRequest)
    refuse_wide_integers(raw)
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
    if body.finish:
        await _settle(request, [r.session_id for r in body.rewards])
    state, states = await store.set_group_rewards(group_id, [(r.session_id, r.reward) for r in body.rewards],
                                                  finish=body.finish)
    return json_response({"group_id": group_id, "ok": True, "state": state,
                          "sessions": [{"session_id": r.session_id, "state": st}
                                       for r, st in zip(body.rewards, states, strict=True)]})


SETTLE_S = 30.0
"""How long ending a session waits for its calls still generating on this gateway to be stored."""


async def _settle(request: Request, session_ids: list[str]) -> None:
    """Before sessions end: their turns in flight here stored first, so the group, once complete and leased, carries
    them. Past SETTLE_S the end goes ahead, and a turn stored later is kept but not leased (docs/http-api.md,
    "Lifecycle")."""
    if not await serving(request).turns.settled(session_ids, SETTLE_S):
        log.warning("ending session(s) %s with a call still generating after %.0f s: its turn will be stored but "
                    "not leased with the group", ", ".join(session_ids), SETTLE_S)


SESSION_STATES = ("active", "finished", "abandoned")
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> Response:
    await admin(request)
    q = request.query_params
    try:
        since = float(q["since"]) if "since" in q else None
        limit = int(q.get("limit", "100"))
    except ValueError:
        raise BadRequest("since must be a number (epoch seconds) and limit an integer") from None
    if since is not None and not math.isfinite(since):  # nan matched nothing, silently
        raise BadRequest(f"since must be a finite number of epoch seconds, got {q['since']!r}", param="since")
    state = q.get("state")
    if state and state not in SESSION_STATES:  # a typo would list nothing, as if there were no such sessions
        raise BadRequest(f"state must be one of {', '.join(SESSION_STATES)}, got {state!r}", param="state")
    flag = q.get("include_turns", "false").lower()
    if flag not in _TRUE + _FALSE:
        raise BadRequest(f"include_turns must be true or false, got {q['include_turns']!r}", param="include_turns")
    full = flag in _TRUE
    store: Store = services(request).store
    rows = await store.list_sessions(state=state, since=since, limit=limit, after=q.get("after"))
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
    if body.finish:
        await _settle(request, [session_id])
    state = await store.set_reward(
        session_id, body.reward, [(t.turn_id, t.reward) for t in body.turn_rewards or []] or None,
        finish=body.finish,
    )
    return json_response({"session_id": session_id, "ok": True, "state": state})


@router.post("/v1/sessions/{session_id}/finish")
async def finish(request: Request, session_id: str) -> Response:
    await admin_or_session(request, session_id)
    await _settle(request, [session_id])
    state = await services(request).store.end_session(session_id, "finished", None)
    return json_response({"session_id": session_id, "state": state})


@router.post("/v1/sessions/{session_id}/abandon")
async def abandon(request: Request, session_id: str) -> Response:
    await admin_or_session(request, session_id)
    body = await read_body(request, AbandonRequest)
    await _settle(request, [session_id])
    state = await services(request).store.end_session(session_id, "abandoned", body.reason)
    return json_response({"session_id": session_id, "state": state})
