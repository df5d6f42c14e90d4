"""The run overview's figures (GET /ui/api/overview): aggregates the store computes, a few hundred points at
most whatever the run's size, so the page can poll them during a run.

Wall-clock series are bucketed in SQL into about `BUCKETS` buckets between the first and the last event;
the page smooths the training reward itself (an EMA over buckets, the raw points drawn too).
"""

from __future__ import annotations

import time
from typing import Any, cast

from sqlalchemy import Float, Integer, Table, and_, func, select
from sqlalchemy import cast as sql_cast

from gateway.store.db import DbConnection
from gateway.store.models import Batch, Group, Session, WeightState
from gateway.store.store import Store

G = cast(Table, Group.__table__)
S = cast(Table, Session.__table__)
B = cast(Table, Batch.__table__)
W = cast(Table, WeightState.__table__)
BUCKETS = 60


async def _span(conn: DbConnection, column: Any, *where: Any) -> tuple[float, float] | None:
    row: Any = (await conn.execute(select(func.min(column), func.max(column)).where(*where))).one()
    lo, hi = row
    return None if lo is None else (float(lo), float(hi))


def _floor_bucket(column: Any, span: tuple[float, float], dialect: str) -> tuple[Any, float]:
    """floor((t - t0) / width) as an integer on both stores (SQLite's CAST truncates, PostgreSQL's rounds)."""
    width = max((span[1] - span[0]) / BUCKETS, 1.0)
    x = (column - span[0]) / width
    expr = sql_cast(x, Integer) if dialect == "sqlite" else sql_cast(func.floor(sql_cast(x, Float)), Integer)
    return expr, width


async def _reward_by_clock(conn: DbConnection, dialect: str, *, is_eval: bool) -> list[dict[str, Any]]:
    where = (G.c.is_eval.is_(is_eval), G.c.completed_at.is_not(None), S.c.reward.is_not(None),
             S.c.state == "finished")
    span = await _span(conn, G.c.completed_at, G.c.is_eval.is_(is_eval), G.c.completed_at.is_not(None))
    if span is None:
        return []
    bucket, width = _floor_bucket(G.c.completed_at, span, dialect)
    q = (select(bucket.label("b"), func.avg(S.c.reward), func.count(), func.count(func.distinct(G.c.id)))
         .select_from(G.join(S, S.c.group_id == G.c.id)).where(*where).group_by(bucket).order_by(bucket))
    rows: list[Any] = list((await conn.execute(q)).all())
    out: list[dict[str, Any]] = [{"t": span[0] + (int(b) + 0.5) * width, "mean": float(m), "sessions": int(n), "groups": int(g)}
           for b, m, n, g in rows]
    if is_eval:  # pass@k per bucket: the share of its groups with a session reward > 0
        gq = (select(G.c.completed_at, func.max(S.c.reward)).select_from(G.join(S, S.c.group_id == G.c.id))
              .where(*where).group_by(G.c.id, G.c.completed_at))
        passed: dict[int, list[int]] = {}
        found: list[Any] = list((await conn.execute(gq)).all())
        for at, best in found:
            k = min(int((float(at) - span[0]) // width), BUCKETS)
            passed.setdefault(k, []).append(1 if (best or 0) > 0 else 0)
        for point in out:
            hits = passed.get(min(int((point["t"] - span[0]) // width), BUCKETS), [])
            point["pass_at_k"] = sum(hits) / len(hits) if hits else None
    return out


async def overview(state: Any) -> dict[str, Any]:
    store: Store = state.store
    dialect = store.engine.dialect.name
    async with store.engine.connect() as conn:
        published: list[Any] = list((await conn.execute(select(W.c.version, W.c.published_at).order_by(W.c.version))).all())
        versions = [{"version": int(v), "published_at": float(t)} for v, t in published]
        states = {str(s): int(n) for s, n in (await conn.execute(
            select(G.c.state, func.count()).group_by(G.c.state))).all()}
        dropped = {str(r or "unknown"): int(n) for r, n in (await conn.execute(
            select(G.c.drop_reason, func.count()).where(G.c.state == "dropped").group_by(G.c.drop_reason))).all()}
        sessions = {str(s): int(n) for s, n in (await conn.execute(
            select(S.c.state, func.count()).group_by(S.c.state))).all()}
        by_version = [{"version": int(v), "mean": float(m), "sessions": int(n)} for v, m, n in (await conn.execute(
            select(G.c.trained_version, func.avg(S.c.reward), func.count())
            .select_from(G.join(S, S.c.group_id == G.c.id))
            .where(and_(G.c.trained_version.is_not(None), G.c.is_eval.is_(False), S.c.reward.is_not(None)))
            .group_by(G.c.trained_version).order_by(G.c.trained_version))).all()]
        train_clock = await _reward_by_clock(conn, dialect, is_eval=False)
        eval_clock = await _reward_by_clock(conn, dialect, is_eval=True)
        throughput: list[dict[str, Any]] = []
        span = await _span(conn, S.c.ended_at, S.c.state == "finished")
        if span is not None:
            bucket, width = _floor_bucket(S.c.ended_at, span, dialect)
            counted: list[Any] = list((await conn.execute(select(bucket, func.count()).where(S.c.state == "finished")
                                                         .group_by(bucket).order_by(bucket))).all())
            throughput = [{"t": span[0] + (int(b) + 0.5) * width, "per_s": int(n) / width} for b, n in counted]
        leases = [dict(r) for r in (await conn.execute(
            select(B.c.id, B.c.created_at, B.c.expires_at, B.c.trainer_version).where(B.c.state == "leased")
            .order_by(B.c.created_at))).mappings().all()]
        leased_groups = {str(b): int(n) for b, n in (await conn.execute(
            select(G.c.batch_id, func.count()).where(G.c.state == "leased").group_by(G.c.batch_id))).all()}
    for lease in leases:
        lease["groups"] = leased_groups.get(lease["id"], 0)
    steps = await store.training_steps(limit=10_000)
    pool = getattr(state, "pool", None)
    backends = [{"id": b.id, "url": b.url, "healthy": b.healthy, "in_flight": b.in_flight,
                 "weight_version": b.weight_version} for b in (pool.backends() if pool is not None else [])]
    return {
        "now": time.time(),
        "version": versions[-1]["version"] if versions else 0,
        "versions": versions,
        "groups": states, "dropped": dropped, "sessions": sessions,
        "train_reward_by_version": by_version, "train_reward_by_clock": train_clock,
        "eval_by_version": await store.eval_summary(), "eval_by_clock": eval_clock,
        "throughput": throughput,
        "steps": [{"version": s["version"], "step": s["step"], "created_at": s["created_at"],
                   "metrics": s["metrics"]} for s in steps],
        "backends": backends,
        "lease_queue": {"complete": states.get("complete", 0), "leased": states.get("leased", 0), "leases": leases},
    }
