"""The viewer's reads (gateway/ui) where SQLite and PostgreSQL differ, behind typed functions: the store is the
one place that tells the dialects apart, so a page asks for a turn list or a time series, never for SQL.

    await light_turns(engine, "sess_...")        # list[LightTurn]: a session's turns without token arrays
    await reward_by_clock(conn)                  # list[RewardBucket]: training reward per wall-clock bucket
    await finished_by_clock(conn)                # list[RateBucket]: finished sessions per second, per bucket
    in_version(engine, 3)                        # the groups list's version filter, as a condition
    await off_loop(engine, lambda: read(...))    # a read off the event loop where the driver runs on it

and the aggregates that stay finite on both stores whatever the rewards (`safe_avg` in SQL, `mean_std` and
`finite` in Python), which the store's own figures (`Store.eval_summary`) use too.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, cast

import orjson
from sqlalchemy import Float, Integer, Table, Text, and_, case, func, literal, or_, select, text
from sqlalchemy import cast as sql_cast

from gateway.store.db import DbConnection, DbEngine, InLoopEngine
from gateway.store.models import Group, Session, Turn

G = cast(Table, Group.__table__)
S = cast(Table, Session.__table__)
T = cast(Table, Turn.__table__)
BUCKETS = 60
"""Wall-clock series: about this many buckets between the first and the last event."""
R = TypeVar("R")


async def off_loop(engine: DbEngine, work: Callable[[], Coroutine[Any, Any, R]]) -> R:
    """Run a read-only store coroutine off the event loop when the store is SQLite. Its driver runs on the
    loop's thread (gateway/store/db.py), so the overview's aggregates over 100k sessions (~1 s) would stall
    every chat call meanwhile; in a thread, sqlite3 releases the GIL while it reads (WAL: never blocking a
    writer). PostgreSQL's driver is already asynchronous."""
    if isinstance(engine, InLoopEngine):
        return await asyncio.to_thread(asyncio.run, work())
    return await work()


# --- aggregates that never overflow -----------------------------------------------------------------------

REWARD_CLAMP = 1e300
"""Rewards are clamped to +-this inside the viewer's SQL means: PostgreSQL's avg(float8) keeps a sum of squares
(1e155 squared overflows: an error, not inf) and its sum(float8) errors past 1.8e308; a clamped value's sum
stays finite for ~1e8 sessions. The REST API refuses such rewards today, but a store may already hold them."""


def clamped(column: Any) -> Any:
    return case((column > REWARD_CLAMP, REWARD_CLAMP), (column < -REWARD_CLAMP, -REWARD_CLAMP), else_=column)


def safe_avg(column: Any) -> Any:
    """avg(column) that never overflows on either store: sum of the clamped values over their count (NULL
    when there are none), no sum of squares."""
    return func.sum(clamped(column)) / func.nullif(func.count(column), 0)


def finite(value: Any) -> float | None:
    """A float from the database, None when absent or not finite (SQLite's sum gives inf past 1.8e308)."""
    if value is None:
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def mean_std(values: list[float]) -> tuple[float, float] | None:
    """Population mean and standard deviation of floats, finite for any finite input (1e155 squared, or 1e308
    + 1e308, would overflow): the mean from an exact sum (`fsum`), else from the values divided by the largest
    magnitude; the spread from the deviations (halved where a deviation overflows), scaled by the largest one.
    None for no value; non-finite values are left out."""
    xs = [x for x in values if math.isfinite(x)]
    if not xs:
        return None
    n = len(xs)
    try:
        total = math.fsum(xs)
    except OverflowError:
        total = math.inf
    if math.isfinite(total):
        mean = total / n
    else:
        scale = max(abs(x) for x in xs)
        mean = math.fsum(x / scale for x in xs) / n * scale
    devs = [x - mean for x in xs]
    half = not all(math.isfinite(d) for d in devs)
    if half:
        devs = [x / 2 - mean / 2 for x in xs]
    top = max(abs(d) for d in devs)
    if top == 0.0:
        return mean, 0.0
    std = math.sqrt(math.fsum((d / top) ** 2 for d in devs) / n) * top
    return mean, min(std * 2 if half else std, sys.float_info.max)


# --- a session's turns, light ---------------------------------------------------------------------------

@dataclass(slots=True)
class LightTurn:
    """A turn without its token arrays or its request's history, for the conversation: what the page shows of
    a 200-turn session without reading its megabytes of tokens (the token view loads those on demand)."""

    id: str
    seq: int
    parent_id: str | None
    reply: dict[str, Any]
    versions: bytes
    temperature: float
    finish_reason: str
    continuity: str
    chain_reason: str | None
    client_disconnected: bool
    reward: float | None
    prompt_len: int
    timings: dict[str, Any]
    completion_len: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    asked: dict[str, Any] = field(default_factory=dict)
    first_new: int = 0
    """Index in its request's messages of the first one its parent's request and reply did not have."""
    new_messages: list[dict[str, Any]] = field(default_factory=list)


# Each request holds the whole history the agent replayed: a long session's requests are O(turns²) of JSON
# (4.3 MB for the benchmark's 200 turns; parsing it all took 0.25 s). The database hands over only what is
# new in each turn, the messages past its parent's count, taking the arrays apart in C.
_TAIL_SQL = {  # each parent's count computed once (MATERIALIZED), not once per element: 0.33 -> 0.05 s
    "sqlite": """WITH x AS MATERIALIZED (
            SELECT t.seq, t.request, COALESCE(json_array_length(p.request, '$.messages') + 1, 0) AS first
            FROM turns t LEFT JOIN turns p ON p.id = t.parent_id WHERE t.session_id = :sid)
        SELECT x.seq, j.key, j.value FROM x, json_each(x.request, '$.messages') j WHERE j.key >= x.first
        ORDER BY x.seq, j.key""",
    # PostgreSQL's json is text, parsed again by every function given it: each request's messages are taken out
    # once (x), counted once (n), taken apart once (here 3 parses of 4.3 MB, ~140 ms; it was 6, ~230 ms).
    "postgresql": """WITH x AS MATERIALIZED (
            SELECT t.id, t.parent_id, t.seq, t.request->'messages' AS m FROM turns t WHERE t.session_id = :sid),
        y AS MATERIALIZED (SELECT id, parent_id, seq, CASE WHEN json_typeof(m) = 'array' THEN m END AS m FROM x),
        n AS MATERIALIZED (SELECT id, json_array_length(m) AS n FROM y WHERE m IS NOT NULL)
        SELECT y.seq, j.idx - 1, j.value::text FROM y LEFT JOIN n ON n.id = y.parent_id
            CROSS JOIN LATERAL json_array_elements(y.m) WITH ORDINALITY AS j(value, idx)
        WHERE j.idx - 1 >= COALESCE(n.n + 1, 0) ORDER BY 1, 2""",
}


async def light_turns(engine: DbEngine, session_id: str) -> list[LightTurn]:
    names = [f.name for f in fields(LightTurn)][:13]
    req = T.c.request
    extract = ((func.json_extract(req, "$.sampling"), func.json_extract(req, "$.asked"))
               if engine.dialect.name == "sqlite" else
               (sql_cast(req.op("->")(literal("sampling")), Text), sql_cast(req.op("->")(literal("asked")), Text)))
    q = (select(*(T.c[n] for n in names), func.length(T.c.completion_ids), *extract)
         .where(T.c.session_id == session_id).order_by(T.c.seq))
    async with engine.connect() as conn:
        rows: list[Any] = list((await conn.execute(q)).all())
        tails = (await conn.execute(text(_TAIL_SQL[engine.dialect.name]), {"sid": session_id})).all()
    turns = {}
    for r in rows:
        turn = LightTurn(*r[:13])
        turn.completion_len, turn.sampling, turn.asked = int(r[13] or 0) // 4, _obj(r[14]), _obj(r[15])
        turns[turn.seq] = turn
    for seq, index, value in tails:
        turn = turns[seq]
        if not turn.new_messages:
            turn.first_new = int(index)
        message = orjson.loads(value)
        turn.new_messages.append(message if isinstance(message, dict) else {"role": "?", "content": str(message)})
    return list(turns.values())


def _obj(raw: Any) -> dict[str, Any]:
    value = orjson.loads(raw) if isinstance(raw, str | bytes) else raw
    return value if isinstance(value, dict) else {}


# --- wall-clock series ------------------------------------------------------------------------------------

async def _span(conn: DbConnection, column: Any, *where: Any) -> tuple[float, float] | None:
    row: Any = (await conn.execute(select(func.min(column), func.max(column)).where(*where))).one()
    lo, hi = row
    return None if lo is None else (float(lo), float(hi))


def _floor_bucket(column: Any, span: tuple[float, float], dialect: str, buckets: int) -> tuple[Any, float]:
    """floor((t - t0) / width) as an integer on both stores (SQLite's CAST truncates, PostgreSQL's rounds)."""
    width = max((span[1] - span[0]) / buckets, 1.0)
    x = (column - span[0]) / width
    expr = sql_cast(x, Integer) if dialect == "sqlite" else sql_cast(func.floor(sql_cast(x, Float)), Integer)
    return expr, width


@dataclass(frozen=True, slots=True)
class RewardBucket:
    t: float
    """The bucket's middle (epoch seconds)."""
    mean: float | None
    """Mean session reward (None where not finite)."""
    sessions: int
    groups: int


@dataclass(frozen=True, slots=True)
class RateBucket:
    t: float
    per_s: float


async def reward_by_clock(conn: DbConnection, buckets: int = BUCKETS) -> list[RewardBucket]:
    """Training sessions' mean reward per wall-clock bucket of their group's completion."""
    where = (G.c.is_eval.is_(False), G.c.completed_at.is_not(None), S.c.reward.is_not(None),
             S.c.state == "finished")
    span = await _span(conn, G.c.completed_at, G.c.is_eval.is_(False), G.c.completed_at.is_not(None))
    if span is None:
        return []
    bucket, width = _floor_bucket(G.c.completed_at, span, conn.dialect.name, buckets)
    q = (select(bucket.label("b"), safe_avg(S.c.reward), func.count(), func.count(func.distinct(G.c.id)))
         .select_from(G.join(S, S.c.group_id == G.c.id)).where(*where).group_by(bucket).order_by(bucket))
    rows: list[Any] = list((await conn.execute(q)).all())
    return [RewardBucket(span[0] + (int(b) + 0.5) * width, finite(m), int(n), int(g)) for b, m, n, g in rows]


async def finished_by_clock(conn: DbConnection, buckets: int = BUCKETS) -> list[RateBucket]:
    """Sessions finished per second, per wall-clock bucket of their end."""
    span = await _span(conn, S.c.ended_at, S.c.state == "finished")
    if span is None:
        return []
    bucket, width = _floor_bucket(S.c.ended_at, span, conn.dialect.name, buckets)
    counted: list[Any] = list((await conn.execute(select(bucket, func.count()).where(S.c.state == "finished")
                                                 .group_by(bucket).order_by(bucket))).all())
    return [RateBucket(span[0] + (int(b) + 0.5) * width, int(n) / width) for b, n in counted]


def in_version(engine: DbEngine, version: int) -> Any:
    """The groups list's version filter: groups trained into `version`, and eval groups of that round
    (`metadata.eval_version`)."""
    meta = G.c["metadata"]
    eval_version = (func.json_extract(meta, "$.eval_version") == version if engine.dialect.name == "sqlite"
                    else meta.op("->>")(literal("eval_version")) == str(version))
    return or_(G.c.trained_version == version, and_(G.c.is_eval.is_(True), eval_version))
