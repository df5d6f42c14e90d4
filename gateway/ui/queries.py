"""The groups list behind /ui/groups and search: filters, keyset pagination, one query per page.

Keyset, not OFFSET: a page is "the n groups before (created_at, id)" in the index `ix_groups_created_at_id`
(migration 0004), so the last page of 100k sessions costs what the first does. The reward filter is on a
group's mean session reward, a correlated aggregate that reads only the covering index
`ix_sessions_group_id_reward`; task text is a case-insensitive substring of the task's JSON (a scan, which
stops as soon as a page is full). `benchmarks/viewer.py` measures every filter combination.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Select, Table, Text, and_, func, literal, select, tuple_
from sqlalchemy import cast as sql_cast

from gateway.errors import BadRequest
from gateway.store.db import DbEngine
from gateway.store.models import Batch, Group, Session
from gateway.store.views import in_version, mean_std, safe_avg

G = cast(Table, Group.__table__)
S = cast(Table, Session.__table__)
B = cast(Table, Batch.__table__)

STATES = ("open", "complete", "leased", "trained", "dropped")
PAGE_SIZES = (10, 25, 50, 100, 200)
MAX_TEXT = 200


@dataclass(frozen=True, slots=True)
class GroupFilter:
    state: str | None = None
    text: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = None
    reason: str | None = None
    kind: str | None = None
    """"eval", "train", or "all" / None (both). The groups page opens on "train" (no `kind` given); the JSON
    list on both."""

    def query_string(self) -> dict[str, str]:
        """The filter as URL parameters (for the page links)."""
        out = {"state": self.state, "q": self.text, "reward_min": self.reward_min, "reward_max": self.reward_max,
               "version": self.version, "reason": self.reason, "kind": self.kind}
        return {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in out.items() if v is not None}


def _number(params: Any, name: str, kind: type) -> Any:
    raw = (params.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, not {raw[:40]!r}",
                         param=name) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number", param=name)
    return value


def parse_filter(params: Any) -> GroupFilter:
    """A `GroupFilter` from query parameters; a bad value is a 400 that names it."""
    state = (params.get("state") or "").strip() or None
    if state is not None and state not in STATES:
        raise BadRequest(f"state must be one of {', '.join(STATES)}", param="state")
    kind = (params.get("kind") or "").strip() or None
    if kind is not None and kind not in ("eval", "train", "all"):
        raise BadRequest("kind must be eval, train or all", param="kind")
    text = (params.get("q") or "").strip() or None
    if text is not None and (len(text) > MAX_TEXT or "\x00" in text):
        raise BadRequest(f"q must be at most {MAX_TEXT} characters, without NUL", param="q")
    reason = (params.get("reason") or "").strip() or None
    if reason is not None and len(reason) > 64:
        raise BadRequest("reason must be at most 64 characters", param="reason")
    version = _number(params, "version", int)
    if version is not None and not 0 <= version < 2**31:
        raise BadRequest("version must be a non-negative 32-bit integer", param="version")
    return GroupFilter(state=state, text=text, reward_min=_number(params, "reward_min", float),
                       reward_max=_number(params, "reward_max", float), version=version, reason=reason, kind=kind)


@dataclass(frozen=True, slots=True)
class Cursor:
    created_at: float
    id: str

    def encode(self) -> str:
        return f"{self.created_at!r}~{self.id}"

    @classmethod
    def decode(cls, raw: str, param: str) -> Cursor:
        at, sep, gid = raw.partition("~")
        try:
            value = float(at)
        except ValueError:
            value = math.nan
        if not sep or not gid or len(gid) > 64 or not math.isfinite(value):
            raise BadRequest(f"{param} is not a page cursor of this list", param=param)
        return cls(value, gid)


@dataclass(slots=True)
class GroupPage:
    rows: list[dict[str, Any]]
    next: str | None = None
    """Cursor of the next (older) page; None on the last page."""
    prev: str | None = None
    """Cursor of the previous (newer) page; None on the first page."""
    filter: GroupFilter = field(default_factory=GroupFilter)


def escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def mean_reward() -> Any:
    """A group's mean session reward (rewarded sessions only): read from ix_sessions_group_id_reward alone."""
    return select(safe_avg(S.c.reward)).where(and_(S.c.group_id == G.c.id, S.c.reward.is_not(None))) \
        .scalar_subquery()


def _where(f: GroupFilter, engine: DbEngine, mean: bool = True) -> list[Any]:
    """The filter's conditions on groups; the reward range (with `mean`) as the correlated aggregate, which a
    page that stops at its 50th match evaluates for few groups."""
    conds: list[Any] = []
    if f.state:
        conds.append(G.c.state == f.state)
    if f.kind in ("eval", "train"):
        conds.append(G.c.is_eval.is_(f.kind == "eval"))
    if f.reason:
        conds.append(G.c.drop_reason == f.reason)
    if f.text:
        conds.append(func.lower(sql_cast(G.c.task, Text)).like(f"%{escape_like(f.text.lower())}%", escape="\\"))
    if f.version is not None:
        conds.append(in_version(engine, f.version))
    if mean and (f.reward_min is not None or f.reward_max is not None):
        avg = mean_reward()  # one reference: each reference is one more evaluation per group (0.14 -> 0.05 s)
        if f.reward_min is not None and f.reward_max is not None:
            conds.append(avg.between(f.reward_min, f.reward_max))
        elif f.reward_min is not None:
            conds.append(avg >= f.reward_min)
        else:
            conds.append(avg <= f.reward_max)
    return conds


COLUMNS = (G.c.id, G.c.task, G.c.n_samples, G.c.state, G.c.drop_reason, G.c.is_eval, G.c.created_at,
           G.c.completed_at, G.c.trained_version)


async def list_groups(engine: DbEngine, f: GroupFilter, *, limit: int = 50, after: str | None = None,
                      before: str | None = None, last: bool = False) -> GroupPage:
    """One page of groups, newest first, with each group's sessions (id, replica, state, reward, turns)."""
    if limit not in PAGE_SIZES:
        raise BadRequest(f"limit must be one of {', '.join(map(str, PAGE_SIZES))}", param="limit")
    if sum(x is not None and x is not False for x in (after, before, last or None)) > 1:
        raise BadRequest("give at most one of after, before and last", param="after")
    key = tuple_(G.c.created_at, G.c.id)
    q: Select[Any] = select(*COLUMNS).where(*_where(f, engine))
    backwards = False
    if after:
        c = Cursor.decode(after, "after")
        q = q.where(key < tuple_(literal(c.created_at), literal(c.id)))
    elif before:
        c = Cursor.decode(before, "before")
        q = q.where(key > tuple_(literal(c.created_at), literal(c.id)))
        backwards = True
    elif last:
        backwards = True
    order = (G.c.created_at.asc(), G.c.id.asc()) if backwards else (G.c.created_at.desc(), G.c.id.desc())
    async with engine.connect() as conn:
        rows = [dict(r) for r in (await conn.execute(q.order_by(*order).limit(limit + 1))).mappings().all()]
        more = len(rows) > limit
        rows = rows[:limit]
        if backwards:
            rows.reverse()
        ids = [r["id"] for r in rows]
        sessions = (await conn.execute(
            select(S.c.id, S.c.group_id, S.c.replica, S.c.state, S.c.reward, S.c.turn_count)
            .where(S.c.group_id.in_(ids)).order_by(S.c.group_id, S.c.replica))).mappings().all() if ids else []
        await mark_lapsed(conn, rows)
    by_group: dict[str, list[dict[str, Any]]] = {}
    for s in sessions:
        by_group.setdefault(s["group_id"], []).append(dict(s))
    for r in rows:
        r["sessions"] = by_group.get(r["id"], [])
        r.update(reward_stats(r["sessions"]))
    page = GroupPage(rows, filter=f)
    first_cursor = Cursor(rows[0]["created_at"], rows[0]["id"]).encode() if rows else None
    last_cursor = Cursor(rows[-1]["created_at"], rows[-1]["id"]).encode() if rows else None
    if backwards:
        page.prev = first_cursor if more else None
        page.next = last_cursor if (before and rows) else None
    else:
        page.next = last_cursor if more else None
        page.prev = first_cursor if (after and rows) else None
    return page


async def mark_lapsed(conn: Any, groups: list[dict[str, Any]]) -> None:
    """`lease` on each leased group: "held" while its batch's lease runs, "lapsed" once it expired or closed
    (the trainer is gone or late; the gateway returns the group to the queue at the next lease, a viewer never
    writes), with the lease's `lease_expires_at`."""
    leased = [g for g in groups if g.get("state") == "leased"]
    if not leased:
        return
    ids = {g["id"] for g in leased}
    found = (await conn.execute(select(G.c.id, B.c.expires_at, B.c.state)
                                .select_from(G.join(B, B.c.id == G.c.batch_id)).where(G.c.id.in_(ids)))).all()
    expiry = {str(gid): (float(at), str(state)) for gid, at, state in found}
    now = time.time()
    for g in leased:
        at, state = expiry.get(g["id"], (None, None))
        g["lease"] = "held" if state == "leased" and at is not None and at > now else "lapsed"
        g["lease_expires_at"] = at


def reward_stats(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread of the rewarded sessions; `zero_variance` when two or more share one reward (no
    GRPO signal: every advantage is 0). Overflow-safe (`mean_std`)."""
    rewards = [float(s["reward"]) for s in sessions if s.get("reward") is not None]
    stats = mean_std(rewards)
    if stats is None:
        return {"reward_mean": None, "reward_std": None, "zero_variance": False}
    mean, std = stats
    return {"reward_mean": mean, "reward_std": std, "zero_variance": len(rewards) >= 2 and len(set(rewards)) == 1}


async def count_groups(engine: DbEngine, f: GroupFilter) -> int:
    """How many groups match. With a reward filter every group's mean is needed: the matching group ids come
    from one grouped pass over ix_sessions_group_id_reward, checked as a hashed set (`IN (...) IS TRUE` keeps
    PostgreSQL from turning it into a join it misplans: the correlated aggregate took 0.9 s there, a join
    after a misestimated task filter 2.3 s, this 0.08 s)."""
    conds = _where(f, engine, mean=False)
    if f.reward_min is not None or f.reward_max is not None:
        lo = f.reward_min if f.reward_min is not None else -math.inf
        hi = f.reward_max if f.reward_max is not None else math.inf
        mean = safe_avg(S.c.reward)
        having = mean.between(lo, hi) if math.isfinite(lo) and math.isfinite(hi) else (mean >= lo if math.isfinite(lo)
                                                                                       else mean <= hi)
        ids = select(S.c.group_id).where(S.c.reward.is_not(None)).group_by(S.c.group_id).having(having)
        conds.append(G.c.id.in_(ids).is_(True))
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(G).where(*conds))).scalar_one())


async def drop_reasons(engine: DbEngine) -> list[str]:
    """The drop reasons present (for the filter's choices)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(G.c.drop_reason).where(G.c.drop_reason.is_not(None))
                                   .group_by(G.c.drop_reason))).all()
    return sorted(str(r[0]) for r in rows)


async def find_ids(engine: DbEngine, text: str, limit: int = 20) -> dict[str, list[dict[str, Any]]]:
    """Sessions and groups whose id starts with `text` (a range on the primary key, so a prefix is cheap)."""
    hi = text + "\U0010ffff"
    async with engine.connect() as conn:
        sessions = (await conn.execute(
            select(S.c.id, S.c.group_id, S.c.state, S.c.reward, S.c.turn_count)
            .where(and_(S.c.id >= text, S.c.id < hi)).order_by(S.c.id).limit(limit))).mappings().all()
        groups = (await conn.execute(
            select(G.c.id, G.c.state, G.c.n_samples, G.c.task).where(and_(G.c.id >= text, G.c.id < hi))
            .order_by(G.c.id).limit(limit))).mappings().all()
    return {"sessions": [dict(s) for s in sessions], "groups": [dict(g) for g in groups]}

