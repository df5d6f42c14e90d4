"""The run overview's figures (GET /ui/api/overview): aggregates the store computes, a few hundred points at
most whatever the run's size, so the page can poll them during a run.

Wall-clock series are bucketed in SQL (gateway/store/views.py) into about 60 buckets between the first and the
last event; the page smooths the training reward itself (an EMA over buckets, the raw points drawn too).
Held-out evals are grouped by their round (`metadata.eval_version`), never cut by a time bucket: one point per round, at the
time its last group completed. Every mean is overflow-safe (`safe_avg`, `mean_std` of gateway/store/views.py): a
store holding rewards of 1e155 or 1e308 still gives finite figures on SQLite and PostgreSQL.

The three training-reward figures differ on purpose, and the page says which is which: `train_reward_by_version`
is the mean over the sessions of the groups trained into a version (filtered and stale groups are not);
`train_reward_by_clock` over every finished training session, filtered and stale groups included, by the time
its group completed; the trainer's own `reward_mean` (in `steps`) over the sessions of a step's batch before
its dynamic filter (the figure `rollway demo` prints and puts in its JSON as `first_reward`/`last_reward`,
means of 3 steps).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

from sqlalchemy import Float, Table, and_, func, select
from sqlalchemy import cast as sql_cast

from gateway.services import Services
from gateway.store.db import DbConnection
from gateway.store.models import Batch, Group, Session, TrainedSample, TrainingStep, WeightState
from gateway.store.store import Store
from gateway.store.views import finished_by_clock, finite, mean_std, reward_by_clock, safe_avg

G = cast(Table, Group.__table__)
S = cast(Table, Session.__table__)
B = cast(Table, Batch.__table__)
W = cast(Table, WeightState.__table__)
TR = cast(Table, TrainedSample.__table__)
TS = cast(Table, TrainingStep.__table__)
LEASES_SHOWN = 10
"""Leases listed on the overview (newest first); the rest page through GET /ui/api/leases."""


def _round_of(meta: Any) -> int | None:
    v = meta.get("eval_version") if isinstance(meta, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


async def _eval_rounds(conn: DbConnection) -> list[dict[str, Any]]:
    """Held-out evals by round: the eval groups of one `metadata.eval_version`, whenever each completed, as one
    point at the time the round's last group completed (`t`; `t_first` its first). Groups without an
    eval_version are one round each (`version` None). Mean session reward and pass@k (the share of groups with
    a session reward > 0)."""
    q = (select(G.c.id, G.c["metadata"], G.c.completed_at, S.c.reward).select_from(G.join(S, S.c.group_id == G.c.id))
         .where(G.c.is_eval.is_(True), G.c.completed_at.is_not(None), S.c.reward.is_not(None),
                S.c.state == "finished"))
    rounds: dict[Any, dict[str, Any]] = {}
    found: list[Any] = list((await conn.execute(q)).all())
    for gid, meta, at, reward in found:
        version = _round_of(meta)
        r = rounds.setdefault(version if version is not None else ("group", gid),
                              {"version": version, "t": float(at), "t_first": float(at), "groups": {}})
        r["t"], r["t_first"] = max(r["t"], float(at)), min(r["t_first"], float(at))
        r["groups"].setdefault(gid, []).append(float(reward))
    out = []
    for r in rounds.values():
        groups: dict[str, list[float]] = r.pop("groups")
        stats = mean_std([x for xs in groups.values() for x in xs])
        out.append({**r, "mean": stats[0] if stats else None, "groups": len(groups),
                    "sessions": sum(len(xs) for xs in groups.values()),
                    "pass_at_k": sum(1 for xs in groups.values() if max(xs) > 0) / len(groups)})
    return sorted(out, key=lambda r: r["t"])


async def leases(conn: DbConnection, now: float, *, offset: int = 0, limit: int = LEASES_SHOWN) -> dict[str, Any]:
    """The leases still marked leased, newest first (one page), each `held` (expires in the future) or `lapsed`
    (expired: the gateway puts its groups back in the queue at the next lease or renewal; a viewer never
    writes), with its leased groups; and the counts of every lease by state."""
    by_state = {str(s): int(n) for s, n in (await conn.execute(select(B.c.state, func.count()).group_by(B.c.state))).all()}
    rows = [dict(r) for r in (await conn.execute(
        select(B.c.id, B.c.created_at, B.c.expires_at, B.c.trainer_version).where(B.c.state == "leased")
        .order_by(B.c.created_at.desc(), B.c.id.desc()).offset(offset).limit(limit))).mappings().all()]
    if rows:
        counted = {str(b): int(n) for b, n in (await conn.execute(
            select(G.c.batch_id, func.count()).where(G.c.state == "leased", G.c.batch_id.in_([r["id"] for r in rows]))
            .group_by(G.c.batch_id))).all()}
        for r in rows:
            r["groups"] = counted.get(r["id"], 0)
            r["status"] = "held" if r["expires_at"] > now else "lapsed"
    held = int((await conn.execute(select(func.count()).where(B.c.state == "leased", B.c.expires_at > now))).scalar_one())
    marked = by_state.get("leased", 0)
    # The trainer's last sign of life in the store: its latest lease, publish or step report.
    seen = [(await conn.execute(q)).scalar() for q in (select(func.max(B.c.created_at)),
                                                        select(func.max(W.c.published_at)).where(W.c.version > 0),
                                                        select(func.max(TS.c.reported_at)))]
    return {"leases": rows, "offset": offset, "limit": limit, "total": marked, "held": held, "lapsed": marked - held,
            "by_state": by_state, "trainer_last_seen": max((float(x) for x in seen if x is not None), default=None)}


async def overview(svc: Services) -> dict[str, Any]:
    store: Store = svc.store
    now = time.time()
    async with store.engine.connect() as conn:
        published: list[Any] = list((await conn.execute(select(W.c.version, W.c.published_at).order_by(W.c.version))).all())
        versions = [{"version": int(v), "published_at": float(t)} for v, t in published]
        states = {str(s): int(n) for s, n in (await conn.execute(
            select(G.c.state, func.count()).group_by(G.c.state))).all()}
        dropped = {str(r or "unknown"): int(n) for r, n in (await conn.execute(
            select(G.c.drop_reason, func.count()).where(G.c.state == "dropped").group_by(G.c.drop_reason))).all()}
        sessions = {str(s): int(n) for s, n in (await conn.execute(
            select(S.c.state, func.count()).group_by(S.c.state))).all()}
        by_version = [{"version": int(v), "mean": finite(m), "sessions": int(n)} for v, m, n in (await conn.execute(
            select(G.c.trained_version, safe_avg(S.c.reward), func.count())
            .select_from(G.join(S, S.c.group_id == G.c.id))
            .where(and_(G.c.trained_version.is_not(None), G.c.is_eval.is_(False), S.c.reward.is_not(None)))
            .group_by(G.c.trained_version).order_by(G.c.trained_version))).all()]
        train_clock = [dataclasses.asdict(b) for b in await reward_by_clock(conn)]
        eval_rounds = await _eval_rounds(conn)
        throughput = [dataclasses.asdict(b) for b in await finished_by_clock(conn)]
        # Response length: the trained (loss) tokens per trained session, by the version it trained into.
        lengths = [{"version": int(v), "mean": finite(m), "sessions": int(n)} for v, m, n in (await conn.execute(
            select(TR.c.version, func.avg(sql_cast(TR.c.loss_tokens, Float)), func.count())
            .group_by(TR.c.version).order_by(TR.c.version))).all()]
        lease_page = await leases(conn, now)
        queued = int((await conn.execute(select(func.count()).where(G.c.state == "complete",
                                                                    G.c.is_eval.is_(False)))).scalar_one())
    steps = await store.training_steps(limit=10_000)
    pool = svc.serving.pool if svc.serving is not None else None
    backends = [{"id": b.id, "url": b.url, "healthy": b.healthy, "in_flight": b.in_flight,
                 "weight_version": b.weight_version} for b in (pool.backends() if pool is not None else [])]
    return {
        "now": now,
        "view_only": svc.view_only,
        "version": versions[-1]["version"] if versions else 0,
        "versions": versions,
        "groups": states, "dropped": dropped, "sessions": sessions,
        "train_reward_by_version": by_version, "train_reward_by_clock": train_clock,
        "eval_by_version": await store.eval_summary(), "eval_by_clock": eval_rounds,
        "throughput": throughput,
        "response_length": lengths,
        "steps": [{"version": s["version"], "step": s["step"], "created_at": s["created_at"],
                   "metrics": s["metrics"]} for s in steps],
        "backends": backends,
        "lease_queue": {"complete": queued, "leased": states.get("leased", 0), **lease_page},
    }
