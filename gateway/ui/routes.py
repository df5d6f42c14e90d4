"""The /ui pages and the JSON they poll. Every handler asks `ui_caller` first: the admin and viewers see
everything, a session key only its own session (403 elsewhere, as on the REST API)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import urllib.parse
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

import gateway.ui.overview as overview_data
import gateway.ui.queries as queries
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.records import session_record
from gateway.routes.common import json_response
from gateway.services import services
from gateway.store.store import Store
from gateway.store.views import light_turns, off_loop
from gateway.ui.conversation import token_turns, turn_views
from gateway.ui.tokens import (
    MAX_PAGE_TOKENS,
    PAGE_TOKENS,
    Chain,
    ChainCache,
    Entry,
    TokenText,
    build_chains,
    page,
)
from gateway.viewer_auth import UiCaller, UiSignInRequired, ui_caller

HERE = Path(__file__).parent
STATIC_VERSION = str(max(int(p.stat().st_mtime) for p in (HERE / "static").iterdir()))
HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # No inline script and nothing from elsewhere: every asset ships in the package.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                               "form-action 'self'; base-uri 'none'",
}

router = APIRouter(include_in_schema=False)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "–"
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}" if abs(value) < 1e15 else f"{value:.6g}"
    return str(value)


def _when(epoch: float | None) -> str:
    return "–" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + " UTC"


def _task_text(task: Any, limit: int = 160) -> str:
    text = task if isinstance(task, str) else json.dumps(task, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                         trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
def _plural(n: Any, word: str, words: str | None = None) -> str:
    """"1 turn", "2 turns" ("–" for none)."""
    if n is None:
        return "–"
    return f"{n} {word if n == 1 else (words or word + 's')}"


ENV.filters.update(fmt=_fmt, when=_when, task_text=_task_text, plural=_plural,
                   urlq=lambda d: urllib.parse.urlencode(d), tojson_attr=lambda v: json.dumps(v))
ENV.globals["static_version"] = STATIC_VERSION


def render(name: str, caller: UiCaller | None, http_status: int = 200, **ctx: Any) -> HTMLResponse:
    html = ENV.get_template(name).render(caller=caller, **ctx)
    return HTMLResponse(html, http_status, headers=HEADERS)


async def _caller(request: Request) -> UiCaller:
    return await ui_caller(request)


def _error_page(e: GatewayError, caller: UiCaller | None) -> HTMLResponse:
    return render("error.html", caller, e.status, page="error", status=e.status, message=e.message)


def _json(data: Any, status: int = 200) -> Response:
    return json_response(data, status, headers={"Cache-Control": "no-store"})


def _chain_cache(request: Request) -> ChainCache:
    return services(request).ui_chains


def _token_text(request: Request) -> TokenText:
    svc = services(request)
    text = svc.ui_token_text
    if text is None:
        text = svc.ui_token_text = TokenText(svc.serving.template.tokenizer if svc.serving is not None else None)
    return text


async def _chains(request: Request, session_id: str, session: dict[str, Any] | None = None) -> Entry:
    """The session's chains (from the cache while its turn count holds) and its turn ids in order. One build
    per key at a time: the session page starts it, and the token view's first request waits for that one."""
    store: Store = services(request).store
    if session is None:
        session = await _session_row(store, session_id)
    cache = _chain_cache(request)
    key = (session_id, int(session["turn_count"]))
    hit = cache.get(key)
    if hit is not None:
        return hit
    task = cache.pending.get(key)
    if task is None:
        task = cache.pending[key] = asyncio.create_task(_build(request, session_id, session, key))
    return await asyncio.shield(task)


async def _build(request: Request, session_id: str, session: dict[str, Any], key: tuple[str, int]) -> Entry:
    cache = _chain_cache(request)
    try:
        store: Store = services(request).store
        rows = await off_loop(store.engine, lambda: token_turns(store.engine, session_id))  # ~10 MB for 200 turns
        # A walk over the turns, not the tokens (~10 ms for 200 turns of 4k tokens); off the loop all the same,
        # for the drift report's compare of a broken chain against the earlier ones.
        group = await store.group(session["group_id"])
        chains = await asyncio.to_thread(build_chains, rows, bool(group.get("is_eval")))
        hit = (chains, [r.id for r in rows])
        cache.put(key, hit)
        return hit
    finally:
        cache.pending.pop(key, None)


# --- pages -----------------------------------------------------------------------------------------


@router.get("/favicon.ico")
async def favicon() -> Response:
    """The browser asks every page's origin for it: an answer, not a 404 in the console."""
    return Response((HERE / "static" / "favicon.ico").read_bytes(), media_type="image/x-icon",
                    headers={"Cache-Control": "public, max-age=86400"})


@router.get("/ui")
async def overview_page(request: Request) -> Response:
    caller = await _caller(request)
    try:
        caller.require_run_wide()
    except GatewayError as e:
        return _error_page(e, caller)
    return render("overview.html", caller, page="overview")


@router.get("/ui/groups")
async def groups_page(request: Request) -> Response:
    caller = await _caller(request)
    try:
        caller.require_run_wide()
        f, pg, limit = await _group_page(request, default_kind="train")
        total = await queries.count_groups(services(request).store.engine, f)
        reasons = await queries.drop_reasons(services(request).store.engine)
    except UiSignInRequired:
        raise
    except GatewayError as e:
        return _error_page(e, caller)
    name = "groups_rows.html" if request.query_params.get("fragment") == "1" else "groups.html"
    return render(name, caller, page="groups", f=f, pg=pg, limit=limit, total=total, reasons=reasons,
                  states=queries.STATES, sizes=queries.PAGE_SIZES, query=f.query_string())


async def _group_page(request: Request, *, default_kind: str | None = None) -> tuple[queries.GroupFilter, queries.GroupPage, int]:
    q = request.query_params
    f = queries.parse_filter(q)
    if default_kind and "kind" not in q:  # the page opens on training groups; eval ones behind the Kind filter
        f = dataclasses.replace(f, kind=default_kind)
    try:
        limit = int(q.get("limit") or 50)
    except ValueError:
        raise BadRequest("limit must be an integer", param="limit") from None
    pg = await queries.list_groups(services(request).store.engine, f, limit=limit, after=q.get("after") or None,
                                   before=q.get("before") or None, last=q.get("last") == "1")
    return f, pg, limit


@router.get("/ui/groups/{group_id}")
async def group_page(request: Request, group_id: str) -> Response:
    caller = await _caller(request)
    try:
        caller.require_run_wide()
        data = await group_data(request, group_id)
    except UiSignInRequired:
        raise
    except GatewayError as e:
        return _error_page(e, caller)
    name = "group_cards.html" if request.query_params.get("fragment") == "1" else "group.html"
    return render(name, caller, page="group", g=data)


@router.get("/ui/sessions/{session_id}")
async def session_page(request: Request, session_id: str) -> Response:
    caller = await _caller(request)
    try:
        caller.require_session(session_id)
        store: Store = services(request).store
        session = await _session_row(store, session_id)
        rows = await light_turns(store.engine, session_id)
        group = await store.group(session["group_id"])
        advantage = (await store.session_advantages([session_id])).get(session_id)
    except UiSignInRequired:
        raise
    except GatewayError as e:
        return _error_page(e, caller)
    turns = turn_views(rows)
    if rows:  # the token view's first request will want the chains: start building them now
        cache = _chain_cache(request)
        if cache.get((session_id, int(session["turn_count"]))) is None:
            warm = asyncio.create_task(_chains(request, session_id, session))
            warm.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is the token request's to report
    fragment = request.query_params.get("fragment") == "1"
    return render("session_turns.html" if fragment else "session.html", caller, page="session", s=session,
                  group=group, advantage=advantage, turns=turns)


async def _session_row(store: Store, session_id: str) -> dict[str, Any]:
    """The session's own row (no turns)."""
    from sqlalchemy import select

    from gateway.store.store import S

    async with store.engine.connect() as conn:
        row = (await conn.execute(select(S).where(S.c.id == session_id))).mappings().first()
    if row is None:
        raise NotFound(f"no session {session_id}")
    return {str(k): v for k, v in row.items() if k != "key_hash"}


@router.get("/ui/search")
async def search_page(request: Request) -> Response:
    caller = await _caller(request)
    text = (request.query_params.get("q") or "").strip()
    try:
        caller.require_run_wide()
        if len(text) > queries.MAX_TEXT or "\x00" in text:
            raise BadRequest(f"search text must be at most {queries.MAX_TEXT} characters, without NUL", param="q")
        engine = services(request).store.engine
        found = await queries.find_ids(engine, text) if text else {"sessions": [], "groups": []}
        exact = [x for x in found["sessions"] if x["id"] == text] or [x for x in found["groups"] if x["id"] == text]
        if exact:
            kind = "sessions" if exact[0]["id"] in {x["id"] for x in found["sessions"]} else "groups"
            return RedirectResponse(f"/ui/{kind}/{urllib.parse.quote(text)}", 303)
        f = queries.GroupFilter(text=text) if text else None
        pg = await queries.list_groups(engine, f, limit=25) if f else None
    except UiSignInRequired:
        raise
    except GatewayError as e:
        return _error_page(e, caller)
    return render("search.html", caller, page="search", q=text, found=found, pg=pg)


# --- JSON ------------------------------------------------------------------------------------------


OVERVIEW_TTL_S = 4.0
"""Every open overview polls; they share one computation this old at most."""


@router.get("/ui/api/overview")
async def overview_json(request: Request) -> Response:
    (await _caller(request)).require_run_wide()
    svc = services(request)
    cached = svc.ui_overview
    if cached is None or time.monotonic() - cached[0] > OVERVIEW_TTL_S:
        cached = svc.ui_overview = (time.monotonic(), await off_loop(svc.store.engine, lambda: overview_data.overview(svc)))
    return _json(cached[1])


@router.get("/ui/api/leases")
async def leases_json(request: Request) -> Response:
    """The leases still marked leased, newest first, `offset` and `limit` (1..100, default 10): each held or
    lapsed; the overview shows the first page."""
    (await _caller(request)).require_run_wide()
    q = request.query_params
    try:
        offset, limit = int(q.get("offset") or 0), int(q.get("limit") or overview_data.LEASES_SHOWN)
    except ValueError:
        raise BadRequest("offset and limit must be integers", param="offset") from None
    if not 0 <= offset < 2**31 or not 1 <= limit <= 100:
        raise BadRequest("offset must be >= 0 and limit 1..100", param="limit")
    now = time.time()
    async with services(request).store.engine.connect() as conn:
        out = await overview_data.leases(conn, now, offset=offset, limit=limit)
    return _json({**out, "now": now})


@router.get("/ui/api/groups")
async def groups_json(request: Request) -> Response:
    (await _caller(request)).require_run_wide()
    f, pg, _ = await _group_page(request)
    return _json({"object": "list", "data": pg.rows, "next": pg.next, "prev": pg.prev,
                  "total": await queries.count_groups(services(request).store.engine, f)})


@router.get("/ui/api/groups/{group_id}")
async def group_json(request: Request, group_id: str) -> Response:
    (await _caller(request)).require_run_wide()
    return _json(await group_data(request, group_id))


@router.get("/ui/api/sessions/{session_id}")
async def session_json(request: Request, session_id: str) -> Response:
    """The whole session as GET /v1/sessions/{id} gives it (the page's copy and export)."""
    (await _caller(request)).require_session(session_id)
    session, rows = await services(request).store.session(session_id)
    response = _json(session_record(session, rows))
    if request.query_params.get("download") == "1":
        response.headers["Content-Disposition"] = f'attachment; filename="{session_id}.json"'
    return response


@router.get("/ui/api/sessions/{session_id}/chains")
async def chains_json(request: Request, session_id: str) -> Response:
    """Each chain of the session: its turns, token and trained counts, version changes, why it started."""
    (await _caller(request)).require_session(session_id)
    chains, _ = await _chains(request, session_id)
    return _json({"object": "list", "data": [c.summary() for c in chains]})


@router.get("/ui/api/sessions/{session_id}/summary")
async def session_summary(request: Request, session_id: str) -> Response:
    """What the session page polls: it reloads its turns when `turn_count` moved."""
    (await _caller(request)).require_session(session_id)
    session = await _session_row(services(request).store, session_id)
    return _json({k: session[k] for k in ("id", "state", "reward", "turn_count", "end_reason", "ended_at")})


@router.get("/ui/api/sessions/{session_id}/turns/{turn_id}")
async def turn_json(request: Request, session_id: str, turn_id: str) -> Response:
    """One turn's messages and reply in full (the page shows long texts cut; this fills them in)."""
    (await _caller(request)).require_session(session_id)
    _, rows = await services(request).store.session(session_id)
    for r in rows:
        if r.id == turn_id:
            return _json({"id": r.id, "seq": r.seq, "request": r.request, "reply": r.reply})
    raise NotFound(f"no turn {turn_id} in session {session_id}")


@router.get("/ui/api/sessions/{session_id}/tokens")
async def tokens_json(request: Request, session_id: str) -> Response:
    """One page of one chain's tokens: `chain=<leaf turn id>` or `turn=<turn id>` (the chain holding it, from
    that turn's reply, or `turn=last`), `offset`, `limit` (default 2048, at most 8192)."""
    (await _caller(request)).require_session(session_id)
    q = request.query_params
    try:
        limit = int(q.get("limit") or PAGE_TOKENS)
        offset = int(q["offset"]) if q.get("offset") else None
    except ValueError:
        raise BadRequest("offset and limit must be integers", param="offset") from None
    if not 1 <= limit <= MAX_PAGE_TOKENS or (offset is not None and offset < 0):
        raise BadRequest(f"limit must be 1..{MAX_PAGE_TOKENS} and offset >= 0", param="limit")
    chains, turn_ids = await _chains(request, session_id)
    if not chains:
        raise NotFound(f"session {session_id} has no turns yet")
    chain, start = _locate(chains, turn_ids, q.get("chain"), q.get("turn"), limit)
    if offset is None:
        offset = start
    if offset > chain.total:
        raise BadRequest(f"offset is past the chain's {chain.total} tokens", param="offset")
    return _json(page(chain, _token_text(request), offset, limit))


def _locate(chains: list[Chain], turn_ids: list[str], leaf: str | None, turn: str | None,
            limit: int) -> tuple[Chain, int]:
    """The chain asked for and where its page starts: at a turn's reply (a little of its prompt before it)."""
    if leaf:
        for c in chains:
            if c.leaf_id == leaf:
                return c, 0
        raise NotFound(f"no chain ending at turn {leaf}")
    if turn:
        turn_id = turn_ids[-1] if turn == "last" and turn_ids else turn
        for c in reversed(chains):
            for sp in c.spans:
                if sp.turn_id == turn_id:
                    return c, max(0, min(sp.completion_start - 64, sp.end - limit))
        raise NotFound(f"no turn {turn}")
    return chains[0], 0


async def group_data(request: Request, group_id: str) -> dict[str, Any]:
    """A group with, per session: reward, advantage, turns, tokens, versions, tool calls, outcome."""
    from gateway.ui.conversation import session_stats

    store: Store = services(request).store
    group = await store.group(group_id)
    advantages = await store.group_advantages(group_id)
    stats = await session_stats(store.engine, [s["id"] for s in group["sessions"]])
    for s in group["sessions"]:
        s["advantage"] = (advantages.get(s["id"]) or {}).get("advantage")
        s.update(stats.get(s["id"], {}))
    group.update(queries.reward_stats(group["sessions"]))
    async with store.engine.connect() as conn:
        await queries.mark_lapsed(conn, [group])
    return group
