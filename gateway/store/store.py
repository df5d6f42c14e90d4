"""Store: the gateway's queries over groups, sessions and turns (SQLAlchemy Core).

The two statements of every chat call — the session lookup by key and the turn insert — go straight to the
driver (`direct.py`) once the store is opened; the Core versions here are what they replace, and what a
store that was not opened uses.

Every method is one transaction. Group state follows from its sessions and is recomputed in the same
transaction that changes a session, so a group's state is never ahead of or behind its rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, and_, func, select, update

from gateway.errors import BadRequest, Conflict, NotFound
from gateway.store import idempotency
from gateway.store.db import DbConnection, DbEngine, InLoopEngine
from gateway.store.direct import (
    GROUP_COLUMNS,
    SESSION_COLUMNS,
    Direct,
    PgStatements,
    SqliteStatements,
    row_params,
)
from gateway.store.models import Group, Session, Turn, TurnRecord
from gateway.store.reports import ViewerStore
from gateway.store.requests import expand
from gateway.store.views import mean_std

G = cast(Table, Group.__table__)
S = cast(Table, Session.__table__)
T = cast(Table, Turn.__table__)


def new_id(prefix: str) -> str:
    """128 random bits, hex, from the OS: for ids that are secrets (a session id opens its session)."""
    return f"{prefix}{secrets.token_hex(16)}"


_unique = random.Random()  # seeded from the OS once per process, and again in a forked child
os.register_at_fork(after_in_child=_unique.seed)


def unique_id(prefix: str) -> str:
    """128 bits, hex, for ids that must be unique but are no secret (turns, backend requests): the time in
    milliseconds (48 bits), then 80 pseudo-random bits, drawn without new_id's system call per id on the hot path.
    Time first, as UUIDv7 does: the turns' primary-key index takes each new id at its right end, as the table
    takes the row, where random ids landed on a random page of it each (one more page written a turn, SQLite's
    WAL and PostgreSQL's alike, and read back once the index outgrew the cache). Predictable from earlier ids:
    never use one as a capability (a turn id only ever counts together with its session's key or id)."""
    return f"{prefix}{int(time.time() * 1000) & 0xFFFF_FFFF_FFFF:012x}{_unique.getrandbits(80):020x}"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(slots=True, frozen=True)
class SessionAuth:
    """What a chat call needs to know about its session."""

    id: str
    group_id: str
    state: str
    turn_count: int
    sampling: dict[str, Any]


@dataclass(slots=True)
class TurnRow:
    id: str
    seq: int
    parent_id: str | None
    request: dict[str, Any]
    """Whole as read (`requests.expand`); as stored, a delta on its parent's where it extends it."""
    reply: dict[str, Any]
    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes
    versions: bytes
    temperature: float
    finish_reason: str
    continuity: str
    chain_reason: str | None
    client_disconnected: bool
    reward: float | None
    prompt_len: int
    timings: dict[str, Any]
    constrained: bool = False
    """Decoded under a grammar: kept out of the loss by default (gateway/samples.py)."""


class Store(ViewerStore):
    def __init__(self, engine: DbEngine) -> None:
        self.engine = engine
        # SQLite has one writer at a time; a writer that finds the lock taken sleeps in SQLite's busy handler
        # (up to 100 ms a try) rather than being woken when it frees. Measured in the demo: reward and finish
        # took 125 ms on average that way. So this process's writers queue here, in order, instead.
        self._write_lock = asyncio.Lock() if engine.dialect.name == "sqlite" else None
        self.direct: Direct | None = None
        """The per-call statements straight to the driver; set by `open`."""
        self._idempotency_secret = idempotency.Secret(engine)
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop `open` ran on, which the store is used and closed on: the hot path takes it from here, where
        `asyncio.get_running_loop()` is a getpid() system call on Python 3.11."""
        self.on_group_end: Callable[[str], None] | None = None
        """Called with "complete" or "dropped" once a commit moved a group there (by a session's reward, end or
        idle timeout): the gateway wakes the long-polls waiting for that (gateway/changes.py)."""

    async def open(self) -> None:
        """Open the direct path of the per-call statements (see `direct.py`)."""
        if self.direct is not None:
            return
        self._loop = asyncio.get_running_loop()
        if isinstance(self.engine, InLoopEngine):
            db = self.engine.hot_connection()
            if db is not None and self._write_lock is not None:
                self.direct = SqliteStatements(db, self._write_lock, self._loop)
        elif self.engine.dialect.name == "postgresql":
            _, connect_args = self.engine.dialect.create_connect_args(self.engine.url)
            self.direct = await PgStatements.open(dict(connect_args))

    async def close(self) -> None:
        if self.direct is not None:
            await self.direct.close()
            self.direct = None
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[DbConnection]:
        """A write transaction (every write goes through here; never nest two)."""
        async with self._write_lock or contextlib.nullcontext(), self.engine.begin() as conn:
            yield conn

    # --- groups and sessions ---------------------------------------------------------------------

    async def create_group(
        self,
        task: Any,
        n_samples: int,
        *,
        sampling: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        is_eval: bool = False,
        ids: tuple[str, list[tuple[str, str]]] | None = None,
    ) -> tuple[str, list[tuple[str, str]]]:
        """A group and its sessions; returns (group_id, [(session_id, api_key)]). `ids`: those to use (`keyed_ids`)
        rather than new random ones; a group already there with that id makes the insert fail."""
        now = time.time()
        if ids is not None:
            gid, creds = ids
        else:
            gid = new_id("grp_")
            creds = [(new_id("sess_"), "rw-" + secrets.token_urlsafe(32)) for _ in range(n_samples)]
        if self.direct is not None:
            group = row_params(dict(id=gid, task=task, n_samples=n_samples, state="open", is_eval=is_eval,
                                    sampling=sampling, metadata=metadata, created_at=now), GROUP_COLUMNS)
            sessions = [row_params(dict(id=sid, group_id=gid, replica=i, key_hash=hash_key(key), state="active",
                                        turn_count=0, created_at=now, last_active_at=now), SESSION_COLUMNS)
                        for i, (sid, key) in enumerate(creds)]
            await self.direct.create_group(group, sessions)
            return gid, creds
        async with self.begin() as conn:
            await conn.execute(
                G.insert().values(
                    id=gid, task=task, n_samples=n_samples, state="open", is_eval=is_eval,
                    sampling=sampling, metadata=metadata, created_at=now,
                )
            )
            await conn.execute(
                S.insert(),
                [
                    dict(id=sid, group_id=gid, replica=i, key_hash=hash_key(key), state="active",
                         turn_count=0, created_at=now, last_active_at=now)
                    for i, (sid, key) in enumerate(creds)
                ],
            )
        return gid, creds

    async def keyed_ids(self, key: str, n_samples: int) -> tuple[str, list[tuple[str, str]]]:
        """The ids and API keys of the group an idempotency key names (`idempotency.derive`)."""
        return idempotency.derive(await self._idempotency_secret.get(self.begin), key, n_samples)

    async def created_before(self, group_id: str, task: Any, n_samples: int, is_eval: bool) -> bool:
        """Whether the group a keyed creation names is already there (then the creation is a retry and answers
        as the first did); Conflict if it is there but was created with another task, size or kind."""
        async with self.engine.connect() as conn:
            g = (await conn.execute(select(G.c.task, G.c.n_samples, G.c.is_eval).where(G.c.id == group_id))).first()
        if g is None:
            return False
        if g.task != task or g.n_samples != n_samples or bool(g.is_eval) != is_eval:
            raise Conflict("this Idempotency-Key already created a group with another task, n_samples or eval",
                           param="Idempotency-Key")
        return True

    async def session_auth(self, *, key: str | None = None, session_id: str | None = None) -> SessionAuth | None:
        column, value = ("key_hash", hash_key(key)) if key is not None else ("id", session_id)
        if self.direct is not None:
            raw = await self.direct.session_auth(column, str(value))
            return None if raw is None else SessionAuth(*raw)
        q = (
            select(S.c.id, S.c.group_id, S.c.state, S.c.turn_count, G.c.sampling)
            .join(G, G.c.id == S.c.group_id)
            .where(S.c[column] == value)
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(q)).first()
        if row is None:
            return None
        return SessionAuth(row.id, row.group_id, row.state, row.turn_count, row.sampling)

    async def session_turns(self, session_id: str) -> list[TurnRow]:
        cols = [T.c[name] for name in TurnRow.__slots__]
        q = select(*cols).where(T.c.session_id == session_id).order_by(T.c.seq)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
        turns = [TurnRow(*r) for r in rows]
        expand(turns)
        return turns

    async def turns_of_sessions(self, session_ids: list[str]) -> dict[str, list[TurnRow]]:
        """`session_turns` of many sessions in one query per 500 (a lease reads every session of its groups)."""
        cols = [T.c[name] for name in TurnRow.__slots__]
        out: dict[str, list[TurnRow]] = {sid: [] for sid in session_ids}
        async with self.engine.connect() as conn:
            for i in range(0, len(session_ids), 500):
                q = select(T.c.session_id, *cols).where(T.c.session_id.in_(session_ids[i:i + 500]))
                for r in (await conn.execute(q.order_by(T.c.session_id, T.c.seq))).all():
                    out[r[0]].append(TurnRow(*r[1:]))
        for turns in out.values():
            expand(turns)
        return out

    def insert_turn_started(self, session_id: str, turn: TurnRecord) -> asyncio.Future[int]:
        """`insert_turn`, started now; the future resolves to the turn's seq once it is durable. Cancelling a
        waiter does not cancel the write when it awaits the future under `asyncio.shield` (a client that leaves
        while its turn commits). On SQLite's direct path the future is the turn's place in the writer's next group
        commit, with no task of its own (a shielded coroutine was one more task and loop step a call)."""
        if isinstance(self.direct, SqliteStatements):
            return self.direct.insert_turn_started(session_id, time.time(), turn)
        return (self._loop or asyncio.get_running_loop()).create_task(self.insert_turn(session_id, turn))

    async def insert_turn(self, session_id: str, turn: TurnRecord) -> int:
        """Store one turn and bump the session's turn count; returns the turn's seq. Durable on return."""
        now = time.time()
        if self.direct is not None:
            return await self.direct.insert_turn(session_id, now, turn)
        async with self.begin() as conn:
            seq = (
                await conn.execute(
                    update(S)
                    .where(S.c.id == session_id)
                    .values(turn_count=S.c.turn_count + 1, last_active_at=now)
                    .returning(S.c.turn_count)
                )
            ).scalar()
            if seq is None:
                raise NotFound(f"no session {session_id}")
            await conn.execute(T.insert().values(session_id=session_id, seq=seq, created_at=now, **turn.values()))
        return int(seq)

    # --- rewards and lifecycle -------------------------------------------------------------------

    async def set_reward(
        self, session_id: str, reward: float | None, turn_rewards: list[tuple[str, float]] | None,
        *, finish: bool = False,
    ) -> str:
        """Set a session's reward (or per-turn rewards); with `finish`, also finish it in the same transaction.
        Returns the session's state after the call."""
        if self.direct is not None and reward is not None and not turn_rewards:
            state, group_end = await self.direct.reward_session(session_id, reward, finish)
        else:
            state, group_end = await self._set_reward(session_id, reward, turn_rewards, finish)
        self._group_ended(group_end)
        return state

    async def set_group_rewards(self, group_id: str, rewards: list[tuple[str, float]], *,
                                finish: bool = False) -> tuple[str, list[str]]:
        """A reward for each of several sessions of one group (and with `finish`, their end). On the direct path
        (every opened store, so every gateway) one transaction: all are stored or, on any error (a session of
        another group, an abandoned one, a final reward changed), none. A store not opened stores them a
        transaction per session, after checking that each is of the group. Returns the group's state after the
        call and each session's state, in the order given."""
        if self.direct is not None:
            group_state, states, group_end = await self.direct.reward_group(group_id, rewards, finish)
        else:  # a store not opened (the Core path): one transaction per session, checked against the group first
            members = {s["id"] for s in (await self.group(group_id))["sessions"]}
            for session_id, _ in rewards:
                if session_id not in members:
                    raise NotFound(f"session {session_id} is not a session of group {group_id}", param="rewards")
            states = []
            for session_id, reward in rewards:
                state, group_end = await self._set_reward(session_id, reward, None, finish)
                states.append(state)
                self._group_ended(group_end)
            return str((await self.group(group_id))["state"]), states
        self._group_ended(group_end)
        return group_state, states

    def _group_ended(self, group_state: str | None) -> None:
        if group_state is not None and self.on_group_end is not None:
            self.on_group_end(group_state)

    async def _set_reward(
        self, session_id: str, reward: float | None, turn_rewards: list[tuple[str, float]] | None, finish: bool,
    ) -> tuple[str, str | None]:
        async with self.begin() as conn:
            sess = await self._session_for_update(conn, session_id)
            if sess.state == "abandoned":  # nothing changes an abandoned session (docs/http-api.md, "Lifecycle")
                raise Conflict(f"session {session_id} is abandoned; it takes no reward")
            gstate = (await conn.execute(select(G.c.state).where(G.c.id == sess.group_id))).scalar_one()
            locked = gstate in ("leased", "trained")
            if reward is not None:
                if sess.reward != reward:
                    if locked:
                        raise Conflict(f"group of session {session_id} was already {gstate}; reward is final")
                    await conn.execute(update(S).where(S.c.id == session_id).values(reward=reward))
            for turn_id, value in turn_rewards or []:
                row = (
                    await conn.execute(
                        select(T.c.reward).where(and_(T.c.id == turn_id, T.c.session_id == session_id))
                    )
                ).first()
                if row is None:
                    raise NotFound(f"turn {turn_id} is not a turn of session {session_id}", param="turn_id")
                if row.reward != value:
                    if locked:
                        raise Conflict(f"group of session {session_id} was already {gstate}; reward is final")
                    await conn.execute(update(T).where(T.c.id == turn_id).values(reward=value))
            if turn_rewards and reward is None and sess.reward is None:
                # A session rewarded per turn counts as rewarded; its session reward is the sum.
                total = (
                    await conn.execute(select(func.sum(T.c.reward)).where(T.c.session_id == session_id))
                ).scalar_one()
                await conn.execute(update(S).where(S.c.id == session_id).values(reward=total))
            state = sess.state
            if finish and state != "finished":
                if state != "active":
                    raise Conflict(f"session {session_id} is already {state}")
                state = "finished"
                await conn.execute(
                    update(S).where(S.c.id == session_id).values(state=state, end_reason=None, ended_at=time.time())
                )
            group_end = await self._refresh_group(conn, sess.group_id)
        return state, group_end

    async def end_session(self, session_id: str, state: str, reason: str | None) -> str:
        """finish or abandon; returns the session's state after the call (idempotent for the same end)."""
        assert state in ("finished", "abandoned")
        async with self.begin() as conn:
            sess = await self._session_for_update(conn, session_id)
            if sess.state == state:  # finishing twice (or abandoning twice) is a no-op
                return state
            if sess.state != "active":  # a finished session can't be abandoned, nor an abandoned one finished
                raise Conflict(f"session {session_id} is already {sess.state}")
            await conn.execute(
                update(S).where(S.c.id == session_id).values(state=state, end_reason=reason, ended_at=time.time())
            )
            group_end = await self._refresh_group(conn, sess.group_id)
        self._group_ended(group_end)
        return state

    async def abandon_idle(self, idle_s: float) -> int:
        """Abandon sessions idle longer than `idle_s`; returns how many."""
        cutoff = time.time() - idle_s
        async with self.begin() as conn:
            rows = (
                await conn.execute(
                    select(S.c.id, S.c.group_id).where(and_(S.c.state == "active", S.c.last_active_at < cutoff))
                )
            ).all()
            if not rows:
                return 0
            await conn.execute(
                update(S)
                .where(S.c.id.in_([r.id for r in rows]))
                .values(state="abandoned", end_reason="idle_timeout", ended_at=time.time())
            )
            ends = [await self._refresh_group(conn, gid) for gid in {r.group_id for r in rows}]
        for end in ends:
            self._group_ended(end)
        return len(rows)

    async def _session_for_update(self, conn: DbConnection, session_id: str) -> Any:
        q = select(S.c.id, S.c.group_id, S.c.state, S.c.reward).where(S.c.id == session_id)
        if conn.dialect.name == "postgresql":
            q = q.with_for_update()
        row = (await conn.execute(q)).first()
        if row is None:
            raise NotFound(f"no session {session_id}")
        return row

    async def _refresh_group(self, conn: DbConnection, group_id: str) -> str | None:
        """open -> complete when every session is finished+rewarded or abandoned; drop when too few live.
        Returns the group's new state when it moved ("complete" or "dropped").

        On PostgreSQL the group's row is locked first (after the caller's session row: sessions before their group,
        as every path takes them): two sessions of a group ended at once each read the other as still active under
        READ COMMITTED, and neither moved the group, which stayed open for good. Locked, the second waits for the
        first to commit, and then reads its end."""
        q = select(G.c.state, G.c.n_samples).where(G.c.id == group_id)
        if conn.dialect.name == "postgresql":
            q = q.with_for_update()
        g = (await conn.execute(q)).one()
        if g.state != "open":
            return None
        rows = (await conn.execute(select(S.c.state, S.c.reward).where(S.c.group_id == group_id))).all()
        live = [r for r in rows if r.state != "abandoned"]
        if len(live) < min(2, g.n_samples):
            if all(r.state != "active" for r in rows):
                await conn.execute(
                    update(G).where(G.c.id == group_id).values(state="dropped", drop_reason="too_few_sessions",
                                                               completed_at=time.time())
                )
                return "dropped"
            return None
        if all(r.state == "finished" and r.reward is not None for r in live):
            await conn.execute(update(G).where(G.c.id == group_id).values(state="complete", completed_at=time.time()))
            return "complete"
        return None

    # --- reading ---------------------------------------------------------------------------------

    async def group(self, group_id: str) -> dict[str, Any]:
        async with self.engine.connect() as conn:
            g = (await conn.execute(select(G).where(G.c.id == group_id))).mappings().first()
            if g is None:
                raise NotFound(f"no group {group_id}")
            sessions = (
                await conn.execute(
                    select(S.c.id, S.c.replica, S.c.state, S.c.end_reason, S.c.reward, S.c.turn_count)
                    .where(S.c.group_id == group_id)
                    .order_by(S.c.replica)
                )
            ).mappings().all()
        out = {str(k): v for k, v in g.items()}  # "metadata" comes back as a quoted_name
        out["sessions"] = [dict(s) for s in sessions]
        return out

    async def session(self, session_id: str) -> tuple[dict[str, Any], list[TurnRow]]:
        async with self.engine.connect() as conn:
            s = (
                await conn.execute(select(S).where(S.c.id == session_id))
            ).mappings().first()
        if s is None:
            raise NotFound(f"no session {session_id}")
        out = {str(k): v for k, v in s.items() if k != "key_hash"}
        return out, await self.session_turns(session_id)

    async def list_sessions(
        self, *, state: str | None, since: float | None, limit: int, after: str | None
    ) -> list[dict[str, Any]]:
        if limit < 1 or limit > 1000:
            raise BadRequest("limit must be between 1 and 1000", param="limit")
        q = select(S.c.id, S.c.group_id, S.c.state, S.c.reward, S.c.turn_count, S.c.created_at).order_by(
            S.c.created_at, S.c.id
        )
        if state:
            q = q.where(S.c.state == state)
        if since is not None:
            q = q.where(S.c.created_at >= since)
        if after:
            async with self.engine.connect() as conn:
                ref = (await conn.execute(select(S.c.created_at).where(S.c.id == after))).first()
            if ref is None:
                raise BadRequest(f"unknown cursor {after}", param="after")
            q = q.where((S.c.created_at > ref.created_at) | and_(S.c.created_at == ref.created_at, S.c.id > after))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q.limit(limit))).mappings().all()
        return [dict(r) for r in rows]

    async def eval_summary(self) -> dict[str, dict[str, float]]:
        """Complete eval groups by `metadata.eval_version` (what `rollway rollout` sets; "unknown" without):
        mean session reward (finite whatever the rewards: `views.mean_std`), pass@k (share of groups with a session
        reward > 0; k = the groups' size, the largest when sizes differ) and the number of groups."""
        q = (
            select(G.c.id, G.c["metadata"], G.c.n_samples, S.c.reward)
            .join(S, S.c.group_id == G.c.id)
            .where(and_(G.c.is_eval.is_(True), G.c.state == "complete", S.c.state == "finished"))
        )
        async with self.engine.connect() as conn:
            rows: list[Any] = list((await conn.execute(q)).all())
        by_version: dict[str, dict[str, list[float]]] = {}
        sizes: dict[str, int] = {}
        for gid, meta, n, reward in rows:
            version = meta.get("eval_version") if isinstance(meta, dict) else None
            label = str(version) if isinstance(version, int) and not isinstance(version, bool) else "unknown"
            by_version.setdefault(label, {}).setdefault(gid, []).append(float(reward or 0.0))
            sizes[label] = max(sizes.get(label, 0), int(n))
        out = {}
        for label, groups in by_version.items():
            rewards = [r for rs in groups.values() for r in rs]
            out[label] = {
                "mean_reward": mean_of(rewards),  # a plain sum gave inf for rewards past 1e308 / n
                "pass_at_k": sum(1 for rs in groups.values() if any(r > 0 for r in rs)) / len(groups),
                "k": float(sizes[label]),
                "groups": float(len(groups)),
            }
        return out

    async def counts(self) -> dict[str, dict[str, int]]:
        async with self.engine.connect() as conn:
            g = (await conn.execute(select(G.c.state, func.count()).group_by(G.c.state))).all()
            s = (await conn.execute(select(S.c.state, func.count()).group_by(S.c.state))).all()
            t = (await conn.execute(select(T.c.continuity, func.count()).group_by(T.c.continuity))).all()
        return {"groups": dict(g), "sessions": dict(s), "turns": dict(t)}


def mean_of(values: list[float]) -> float:
    """The mean of finite rewards, never inf (`mean_std`: an exact sum, scaled where it would overflow); 0.0
    for none."""
    stats = mean_std(values)
    return stats[0] if stats else 0.0
