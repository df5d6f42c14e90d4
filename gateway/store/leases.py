"""Leases of complete groups to trainers, staleness admission, and the weight-version state.

Everything a second gateway process needs is in the store: leases expire by time, admission counts are
recomputed from rows (never a counter kept only in memory: AReaL#1388), the current version is a row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sqlalchemy import Table, and_, func, select, update

from gateway.errors import Conflict, NotFound
from gateway.store.models import AdmissionCount, Batch, Group, Session, Setting, WeightState
from gateway.store.store import Store, TurnRow, new_id
from rollway_common.wire import INT32_MAX

G = cast(Table, Group.__table__)
AC = cast(Table, AdmissionCount.__table__)
S = cast(Table, Session.__table__)
B = cast(Table, Batch.__table__)
W = cast(Table, WeightState.__table__)
KV = cast(Table, Setting.__table__)
COUNTED = ("open", "complete", "leased", "trained")  # what admission counts (admission_counts, migration 0005)


def check_results(results: Mapping[str, str | int], version: int | None) -> None:
    """Each group's result in an ack or a publish: "trained", "filtered", or the version it was trained at, 1 ...
    the publish's `version` (any int32 version for a plain ack). A trainer acks only with a durable checkpoint, so
    the groups of every step since the last one ride on its publish: each keeps the version its update first went
    into, not the checkpoint's. Raises ValueError naming the first bad one."""
    top = INT32_MAX if version is None else version
    for gid, outcome in results.items():
        if outcome in ("trained", "filtered") or (type(outcome) is int and 1 <= outcome <= top):
            continue
        raise ValueError(f"the result for group {gid} must be 'trained', 'filtered' or the version it was trained "
                         f"at (1 ... {top}), got {outcome!r}")


@dataclass(slots=True)
class LeaseRequest:
    max_groups: int
    lease_seconds: float
    groups_per_step: int | None
    max_head_offpolicyness: int | None
    trainer_version: int | None
    train_constrained: bool = False
    """Train the completions of constrained turns too (gateway/samples.py)."""
    lease_format: int = 1
    """The samples' wire shape (docs/http-api.md "POST /v1/batches"): 1 (per-token returns) or 2 (turns)."""


class SampleBuilder(Protocol):
    """What a lease hands out for one finished session, built outside the store (gateway/samples.py): its
    samples in the wire shape `req` asks for, each with its oldest trained weight version (None: no loss
    token), which the staleness check reads."""

    def __call__(self, group_id: str, session_id: str, reward: float | None, turns: list[TurnRow],
                 req: LeaseRequest) -> list[tuple[dict[str, Any], int | None]]: ...


@dataclass(slots=True)
class LeaseResult:
    """What one lease attempt took: `batch_id` None (and `expires_at` 0) when no group was leased."""

    batch_id: str | None
    expires_at: float
    groups: list[dict[str, Any]]
    """The leased groups with their samples, as `POST /v1/batches` answers them."""
    dropped_stale: int
    """Groups dropped as stale by this attempt (max_head_offpolicyness)."""



class Leases:
    def __init__(self, store: Store, samples: SampleBuilder) -> None:
        self.store = store
        self.engine = store.engine
        self.samples = samples
        self._remembered: tuple[tuple[int | None, int | None], float] | None = None
        """The trainer's admission parameters this process last wrote, and when (time.monotonic)."""

    # --- weight versions -------------------------------------------------------------------------

    async def current_weights(self) -> tuple[int, str | None]:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(W.c.version, W.c.model_path).order_by(W.c.version.desc()).limit(1))).first()
        return (int(row.version), row.model_path) if row else (0, None)

    async def publish(self, version: int, model_path: str, batch_ids: list[str], results: dict[str, str | int],
                      failed: dict[str, str]) -> None:
        """Bump the version and ack the batches in one transaction."""
        async with self.store.begin() as conn:
            cur = (await conn.execute(select(func.max(W.c.version)))).scalar() or 0
            if version <= cur:
                raise Conflict(f"version {version} is not newer than the current version {cur}", param="version")
            await conn.execute(W.insert().values(version=version, model_path=model_path,
                                                 batch_id=",".join(batch_ids)[:64] or None,
                                                 published_at=time.time(), failed_backends=failed or None))
            covered: set[str] = set()
            for batch_id in batch_ids:  # one query per batch (not per group: that held the write lock 10 s+)
                ours = await self._groups_of(conn, batch_id)
                covered |= ours
                await self._ack(conn, batch_id, {g: r for g, r in results.items() if g in ours}, version)
            leftover = set(results) - covered
            if leftover:
                raise Conflict(f"groups {sorted(leftover)[:3]} are in none of the published batches", param="results")

    async def check_publishable(self, version: int, batch_ids: list[str]) -> None:
        cur, _ = await self.current_weights()
        if version <= cur:
            raise Conflict(f"version {version} is not newer than the current version {cur}", param="version")
        for batch_id in batch_ids:
            await self._live_batch(batch_id)

    async def _groups_of(self, conn: Any, batch_id: str) -> set[str]:
        return set((await conn.execute(select(G.c.id).where(G.c.batch_id == batch_id))).scalars())

    # --- leases ----------------------------------------------------------------------------------

    async def expire(self) -> int:
        """Return the groups of every lapsed lease to the queue. A read first: the write transaction (on SQLite,
        the store's one write lock, which every turn's write also takes) only when some lease did lapse."""
        now = time.time()
        lapsed = select(B.c.id).where(and_(B.c.state == "leased", B.c.expires_at < now))
        async with self.engine.connect() as conn:
            if (await conn.execute(lapsed.limit(1))).first() is None:
                return 0
        async with self.store.begin() as conn:
            ids = (await conn.execute(lapsed)).scalars().all()
            if not ids:
                return 0
            await conn.execute(update(B).where(B.c.id.in_(ids)).values(state="expired"))
            res = await conn.execute(
                update(G).where(and_(G.c.batch_id.in_(ids), G.c.state == "leased")).values(state="complete", batch_id=None)
            )
            return int(res.rowcount or 0)

    async def queued(self, limit: int) -> int:
        """How many groups are complete and not leased, counted up to `limit` (a long poll's check, no lease). The
        groups of lapsed leases count: they are put back in the queue first, as a lease would."""
        await self.expire()
        first = (select(G.c.id).where(and_(G.c.state == "complete", G.c.is_eval.is_(False))).limit(limit)).subquery()
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(first))).scalar_one())

    async def lease(self, req: LeaseRequest) -> LeaseResult:
        await self.expire()
        await self.remember_params(req)
        queued = (select(G.c.id).where(and_(G.c.state == "complete", G.c.is_eval.is_(False)))
                  .order_by(G.c.completed_at).limit(req.max_groups))
        async with self.engine.connect() as conn:  # nothing queued (a long poll's usual answer): no write lock taken
            if (await conn.execute(queued.limit(1))).first() is None:
                return LeaseResult(None, 0.0, [], 0)
        version = req.trainer_version if req.trainer_version is not None else (await self.current_weights())[0]
        batch_id = new_id("batch_")
        now = time.time()
        expires = now + req.lease_seconds
        async with self.store.begin() as conn:
            cands = (await conn.execute(queued)).scalars().all()
            if not cands:
                return LeaseResult(None, 0.0, [], 0)
            # Conditional update: a concurrent leaser (another gateway) can't take the same group.
            await conn.execute(
                update(G).where(and_(G.c.id.in_(cands), G.c.state == "complete")).values(state="leased", batch_id=batch_id)
            )
            await conn.execute(B.insert().values(id=batch_id, state="leased", created_at=now, expires_at=expires,
                                                 trainer_version=version))
        groups, stale, empty = [], [], []
        samples = await self._group_samples(list(cands), batch_id, req)
        for gid in cands:
            found = samples.get(gid)
            if found is None:
                continue
            g, oldest = found
            if not g["samples"]:  # nothing to train (no finished session with a loss token): closed here, as a
                empty.append(gid)  # trainer would ack it, not handed out to stay leased until someone does
                continue
            eta = req.max_head_offpolicyness
            if eta is not None and eta >= 0 and oldest is not None and version - oldest > eta:
                stale.append(gid)
                continue
            groups.append(g)
        if stale or empty:
            async with self.store.begin() as conn:
                for ids, reason in ((stale, "stale"), (empty, "no_samples")):
                    if ids:
                        await conn.execute(update(G).where(G.c.id.in_(ids)).values(state="dropped", drop_reason=reason))
        if not groups:
            async with self.store.begin() as conn:
                await conn.execute(update(B).where(B.c.id == batch_id).values(state="acked"))
            return LeaseResult(None, 0.0, [], len(stale))
        return LeaseResult(batch_id, expires, groups, len(stale))

    async def _group_samples(
        self, group_ids: list[str], batch_id: str, req: LeaseRequest
    ) -> dict[str, tuple[dict[str, Any], int | None]]:
        """Each group of `group_ids` still in `batch_id`, with its samples and their oldest trained version: three
        queries for the whole lease (the groups, their sessions, the finished sessions' turns), not one per
        session."""
        async with self.engine.connect() as conn:
            found = (await conn.execute(
                select(G.c.id, G.c.task).where(and_(G.c.id.in_(group_ids), G.c.batch_id == batch_id))
            )).all()
            tasks = {row.id: row.task for row in found}
            sessions = (await conn.execute(
                select(S.c.group_id, S.c.id, S.c.reward, S.c.state).where(S.c.group_id.in_(list(tasks)))
                .order_by(S.c.group_id, S.c.replica)
            )).all()
        turns = await self.store.turns_of_sessions([s.id for s in sessions if s.state == "finished"])
        out: dict[str, dict[str, Any]] = {
            gid: {"group_id": gid, "task": task, "samples": [], "sessions": []} for gid, task in tasks.items()
        }
        oldest: dict[str, int | None] = dict.fromkeys(out)
        for s in sessions:
            g = out[s.group_id]
            g["sessions"].append({"session_id": s.id, "reward": s.reward, "state": s.state})
            if s.state != "finished":
                continue
            for wire, first in self.samples(s.group_id, s.id, s.reward, turns[s.id], req):
                g["samples"].append(wire)
                if first is not None:
                    now = oldest[s.group_id]
                    oldest[s.group_id] = first if now is None else min(now, first)
        return {gid: (g, oldest[gid]) for gid, g in out.items()}

    async def renew(self, batch_id: str, lease_seconds: float) -> float:
        await self.expire()
        expires = time.time() + lease_seconds
        async with self.store.begin() as conn:
            await self._live_batch(batch_id, conn)
            await conn.execute(update(B).where(B.c.id == batch_id).values(expires_at=expires))
        return expires

    async def ack(self, batch_id: str, results: dict[str, str | int]) -> None:
        """Close groups with nothing to publish. Only the listed groups (all of them when none are
        listed, as "filtered"); the batch closes once none of its groups is still leased."""
        async with self.store.begin() as conn:
            await self._ack(conn, batch_id, results, None)

    async def _ack(self, conn: Any, batch_id: str, results: dict[str, str | int], version: int | None) -> None:
        """`version` given (a publish): groups not listed are trained. Else only listed ones change."""
        await self._live_batch(batch_id, conn)
        leased = set(
            (await conn.execute(select(G.c.id).where(and_(G.c.batch_id == batch_id, G.c.state == "leased")))).scalars()
        )
        unknown = set(results) - leased
        if unknown:
            raise Conflict(f"groups {sorted(unknown)[:3]} are not leased in batch {batch_id}", param="results")
        if version is not None:
            todo = {gid: results.get(gid, "trained") for gid in leased}
        else:
            todo = dict(results) if results else dict.fromkeys(leased, "filtered")
        try:
            check_results(todo, version)
        except ValueError as e:
            raise Conflict(str(e), param="results") from None
        for gid, outcome in todo.items():
            if outcome == "filtered":
                values: dict[str, Any] = {"state": "dropped", "drop_reason": "filtered"}
            else:  # the version its update first went into (an int), else this publish's
                values = {"state": "trained", "trained_version": version if outcome == "trained" else outcome}
            await conn.execute(update(G).where(G.c.id == gid).values(**values))
        if leased <= set(todo):
            await conn.execute(update(B).where(B.c.id == batch_id).values(state="acked"))

    async def _live_batch(self, batch_id: str, conn: Any = None) -> None:
        q = select(B.c.state, B.c.expires_at).where(B.c.id == batch_id)
        if conn is None:
            async with self.engine.connect() as c:
                row = (await c.execute(q)).first()
        else:
            row = (await conn.execute(q)).first()
        if row is None:
            raise NotFound(f"no batch {batch_id}")
        if row.state != "leased" or row.expires_at < time.time():
            raise Conflict(f"batch {batch_id} is {row.state if row.state != 'leased' else 'expired'}; "
                           "its groups went back to the queue", code="lease_expired")

    # --- staleness admission ---------------------------------------------------------------------

    REMEMBER_EVERY_S = 5.0
    """The same parameters are written again at most this often: each lease call of a trainer carries them, and
    a write on every one took the store's write lock several times a step. Rewritten now and then all the same, in
    case another gateway sharing the store wrote a different trainer's parameters meanwhile."""

    async def remember_params(self, req: LeaseRequest) -> None:
        """Store the trainer's B and η (each lease request carries them): every gateway admits with them."""
        key_now = (req.groups_per_step, req.max_head_offpolicyness)
        now = time.monotonic()
        if self._remembered is not None and self._remembered[0] == key_now \
                and now - self._remembered[1] < self.REMEMBER_EVERY_S:
            return
        values = {"groups_per_step": req.groups_per_step, "max_head_offpolicyness": req.max_head_offpolicyness}
        self._remembered = None  # a write that fails is tried again on the next lease
        async with self.store.begin() as conn:
            for key, value in values.items():
                if value is None:
                    continue
                done = await conn.execute(update(KV).where(KV.c.key == key).values(value=value))
                if not done.rowcount:
                    await conn.execute(KV.insert().values(key=key, value=value))
        self._remembered = (key_now, now)

    async def admission(self, default_b: int, default_eta: int) -> tuple[bool, int, int]:
        """(allowed, counted groups, limit). Limit -1 = no admission control. On the store's direct path (every
        opened store) one statement; the Core path's three reads are what it replaces."""
        direct = self.store.direct
        if direct is not None:
            stored_eta, stored_b, version, counted = await direct.admission()
        else:
            async with self.engine.connect() as conn:
                kv = {row.key: row.value for row in (await conn.execute(select(KV.c.key, KV.c.value))).all()}
                stored_eta, stored_b = kv.get("max_head_offpolicyness"), kv.get("groups_per_step")
                version = (await conn.execute(select(func.max(W.c.version)))).scalar() or 0
                counted = (await conn.execute(select(AC.c.groups).where(AC.c.id == 1))).scalar_one()
        eta = int(default_eta if stored_eta is None else stored_eta)
        b = int(default_b if stored_b is None else stored_b)
        if eta < 0:
            return True, 0, -1
        limit = (eta + version + 1) * b
        return counted < limit, int(counted), limit
