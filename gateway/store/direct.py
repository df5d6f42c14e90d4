"""The store's per-call statements sent straight to the database driver, past SQLAlchemy (same SQL semantics, the
same values as the Core path in `store.py`; JSON is written as compact orjson text where SQLAlchemy writes
`json.dumps`' spaced, ASCII-escaped text, which reads back the same): the two of every chat call (the session
lookup by key and the turn insert), and the writes of every group (its creation, its sessions' rewards) and the
admission read.

SQLAlchemy's statement, result and transaction handling was ~0.5 ms of the gateway's CPU per call on SQLite
and ~1.5 ms on PostgreSQL (py-spy on `benchmarks/gateway.py`), more than all the rest of recording a turn.

- SQLite: one sqlite3 connection of its own (out of the pool, autocommit), used on the event loop's thread
  like the rest of the embedded store (`db.InLoopEngine`); turns are group-committed (BEGIN IMMEDIATE, bump
  and insert each, COMMIT) under the store's write lock, and each caller returns once its turn's commit did.
- PostgreSQL: asyncpg connections of its own (`pg_pool.PgConnections`, not asyncpg's Pool); the insert is one
  statement (a data-modifying CTE bumps the session's turn count and inserts the turn with that seq), so it costs
  one round trip and is atomic and durable when it returns. asyncpg prepares each statement once per connection.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import orjson
import sqlalchemy.exc
from sqlalchemy import JSON, Column, Table
from sqlalchemy.dialects import postgresql

from gateway.errors import Conflict, NotFound
from gateway.store.models import TURN_RECORD_FIELDS, Group, Session, Turn, TurnRecord
from gateway.store.pg_pool import PgConnections

G = cast(Table, Group.__table__)
S = cast(Table, Session.__table__)
T = cast(Table, Turn.__table__)
TURN_COLUMNS = list(T.columns)
_SET_BY_STORE = ("session_id", "seq", "created_at")
INSERTED_COLUMNS = tuple(c for c in TURN_COLUMNS if c.name not in _SET_BY_STORE)
"""The columns a turn's values give (`Store.insert_turn`); the store sets the others."""
_JSON_COLUMNS = frozenset(c.name for c in TURN_COLUMNS if isinstance(c.type, JSON))
_RECORD_FIELDS = frozenset(TURN_RECORD_FIELDS)
AuthRow = tuple[str, str, str, int, Any]
"""session id, group id, state, turn count, the group's sampling policy (parsed JSON)."""

_AUTH = (f"SELECT s.id, s.group_id, s.state, s.turn_count, g.sampling FROM {S.name} s "
         f"JOIN {G.name} g ON g.id = s.group_id WHERE s.")


def json_text(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def _column_plan(columns: Sequence[Column[Any]]) -> tuple[tuple[str, int, Any], ...]:
    """Per column: (the record's field, how its value is bound: 0 as is, 1 as JSON text, 2 the column's default)."""
    plan = []
    for col in columns:
        default = col.default
        scalar = default.arg if default is not None and default.is_scalar else None  # type: ignore[attr-defined]
        how = (1 if col.name in _JSON_COLUMNS else 0) if col.name in _RECORD_FIELDS else 2
        plan.append((col.name, how, scalar))
    return tuple(plan)


_INSERTED_PLAN = _column_plan(INSERTED_COLUMNS)


def turn_params(turn: TurnRecord, columns: Sequence[Column[Any]] = INSERTED_COLUMNS) -> list[Any]:
    """A turn's values in the order of `columns`, as SQLAlchemy would bind them: JSON as text, a column the record
    lacks (`reward`) as its scalar default (else NULL). Booleans stay bool (sqlite3 stores them as 0/1, as
    SQLAlchemy did). The record's fields are checked against the table once, at import (models.py); the plan for
    the inserted columns is made once too (this runs for every stored turn)."""
    plan = _INSERTED_PLAN if columns is INSERTED_COLUMNS else _column_plan(columns)
    return [getattr(turn, name) if how == 0 else json_text(getattr(turn, name)) if how == 1 else scalar
            for name, how, scalar in plan]


class UnknownColumns(sqlalchemy.exc.CompileError):
    """Values name a column the table does not have: the direct path's form of the error SQLAlchemy's
    insert raises on the Core path ("Unconsumed column names"), so one `except` catches both."""


GROUP_COLUMNS = tuple(c for c in G.columns)
SESSION_COLUMNS = tuple(c for c in S.columns)


def row_params(values: dict[str, Any], columns: Sequence[Column[Any]]) -> list[Any]:
    """A group's or a session's values in the order of `columns`, bound as SQLAlchemy binds them (JSON as text,
    None in a JSON column as JSON null; absent columns as their scalar default, else NULL)."""
    out: list[Any] = []
    for col in columns:
        if col.name in values:
            v = values[col.name]
            if isinstance(col.type, JSON):
                v = json_text(v)
        else:
            default = col.default
            v = default.arg if default is not None and default.is_scalar else None  # type: ignore[attr-defined]
        out.append(v)
    unknown = set(values) - {c.name for c in columns}
    if unknown:
        raise UnknownColumns(f"values for no column of {columns[0].table.name}: {', '.join(sorted(unknown))}")
    return out


def _insert(table: Table, columns: Sequence[Column[Any]], marks: Sequence[str]) -> str:
    return f"INSERT INTO {table.name} ({', '.join(c.name for c in columns)}) VALUES ({', '.join(marks)})"


def _auth_row(raw: Any) -> AuthRow | None:
    return None if raw is None else (raw[0], raw[1], raw[2], raw[3], orjson.loads(raw[4] or "null"))


R = TypeVar("R")

Fetch = Callable[..., Awaitable[list[Any]]]
"""(sql, *params) -> rows, inside the caller's transaction; `sql` uses `{}` where a parameter goes."""

_REWARD_READ = (f"SELECT s.group_id, s.state, s.reward, g.state, g.n_samples FROM {S.name} s "
                f"JOIN {G.name} g ON g.id = s.group_id WHERE s.id = {{}}")


async def _reward_one(fetch: Fetch, session_id: str, state: str, old_reward: float | None, reward: float,
                      group_state: str, finish: bool, now: float) -> str:
    """One session's reward, as read (its `state` and `old_reward`, its group's `group_state`): the checks and
    the write that `reward_session` and `reward_group` share. Returns the session's state after it."""
    if state == "abandoned":  # nothing changes an abandoned session (docs/http-api.md, "Lifecycle")
        raise Conflict(f"session {session_id} is abandoned; it takes no reward")
    sets: dict[str, Any] = {}
    if old_reward != reward:
        if group_state in ("leased", "trained"):
            raise Conflict(f"group of session {session_id} was already {group_state}; reward is final")
        sets["reward"] = reward
    if finish and state != "finished":
        if state != "active":
            raise Conflict(f"session {session_id} is already {state}")
        state = "finished"
        sets.update(state=state, end_reason=None, ended_at=now)
    if sets:
        await fetch(f"UPDATE {S.name} SET {', '.join(f'{k} = {{}}' for k in sets)} WHERE id = {{}}",
                    *sets.values(), session_id)
    return str(state)


async def reward_session(fetch: Fetch, session_id: str, reward: float, finish: bool) -> tuple[str, str | None]:
    """`Store.set_reward` for a session reward (no per-turn rewards), with the same checks, errors and writes:
    the reward, with `finish` the session's end, and the group's completion, in the caller's transaction.
    Returns the session's state after the call, and the group's new state if it moved ("complete", "dropped").

    The Core path ran 6-7 statements through SQLAlchemy for this, the gateway's most frequent write after the turn
    itself (one per session): py-spy on the demo's loop (benchmarks/loop.py) put it at ~30% of the gateway's CPU."""
    rows = await fetch(_REWARD_READ, session_id)
    if not rows:
        raise NotFound(f"no session {session_id}")
    group_id, state, old_reward, group_state, n_samples = rows[0]
    state = await _reward_one(fetch, session_id, state, old_reward, reward, group_state, finish, time.time())
    group_end: str | None = None
    if group_state == "open":  # Store._refresh_group, statement for statement
        sessions = await fetch(f"SELECT state, reward FROM {S.name} WHERE group_id = {{}}", group_id)
        group_end = await _end_group(fetch, group_id, n_samples, sessions)
    return str(state), group_end


async def _end_group(fetch: Fetch, group_id: str, n_samples: int, sessions: Sequence[Sequence[Any]]) -> str | None:
    """`Store._refresh_group` for an open group whose sessions' (state, reward) are `sessions`: complete it when
    every live session is finished and rewarded, drop it when too few are live and none is active. Returns the
    state it moved to, or None."""
    live = [r for r in sessions if r[0] != "abandoned"]
    if len(live) < min(2, n_samples):
        if all(r[0] != "active" for r in sessions):
            await fetch(f"UPDATE {G.name} SET state = {{}}, drop_reason = {{}}, completed_at = {{}} WHERE id = {{}}",
                        "dropped", "too_few_sessions", time.time(), group_id)
            return "dropped"
    elif all(r[0] == "finished" and r[1] is not None for r in live):
        await fetch(f"UPDATE {G.name} SET state = {{}}, completed_at = {{}} WHERE id = {{}}",
                    "complete", time.time(), group_id)
        return "complete"
    return None


_GROUP_SESSIONS_READ = f"SELECT id, state, reward FROM {S.name} WHERE group_id = {{}} ORDER BY id"
_GROUP_READ = f"SELECT state, n_samples FROM {G.name} WHERE id = {{}}"


async def reward_group(fetch: Fetch, group_id: str, rewards: Sequence[tuple[str, float]],
                       finish: bool) -> tuple[str, list[str], str | None]:
    """`reward_session` for several sessions of one group, in the caller's transaction: the same checks and writes
    for each, in order, and the group's completion checked once, at the end, from the rows already read (every
    session of the group, then the group). An error leaves the transaction to the
    caller's rollback, so nothing of the call is kept. Returns the group's state after the call, each session's
    state in the order given, and the group's new state if this call moved it ("complete", "dropped")."""
    rows = await fetch(_GROUP_SESSIONS_READ, group_id)
    group = await fetch(_GROUP_READ, group_id)
    if not group:
        raise NotFound(f"no group {group_id}")
    group_state, n_samples = group[0]
    sessions = {r[0]: [r[1], r[2]] for r in rows}
    states: list[str] = []
    now = time.time()
    for session_id, reward in rewards:
        row = sessions.get(session_id)
        if row is None:
            raise NotFound(f"session {session_id} is not a session of group {group_id}", param="rewards")
        state = await _reward_one(fetch, session_id, row[0], row[1], reward, group_state, finish, now)
        row[0], row[1] = state, reward
        states.append(str(state))
    group_end = None
    if group_state == "open":  # on the rows as they now are
        group_end = await _end_group(fetch, group_id, n_samples, list(sessions.values()))
    return str(group_end or group_state), states, group_end


_ADMISSION = (
    "SELECT (SELECT value FROM settings WHERE key = 'max_head_offpolicyness'), "
    "(SELECT value FROM settings WHERE key = 'groups_per_step'), "
    "(SELECT max(version) FROM weight_versions), "
    "(SELECT groups FROM admission_counts WHERE id = 1)"  # kept by triggers on groups (migration 0005)
)
"""`Leases.admission`'s three reads (the settings, the current version, the groups counted) in one statement: one
round trip per group creation. Checked against the Core path by tests/gateway/test_store_direct.py."""

AdmissionRow = tuple[Any, Any, int, int]
"""eta and groups per step as stored (None when unset), the current version (0 before any), groups counted."""


def _json_value(v: Any) -> Any:
    # SQLite gives a JSON column's number back as a number (the column's type name gives it numeric affinity)
    return orjson.loads(v) if isinstance(v, str | bytes) else v


def _admission_row(raw: Any) -> AdmissionRow:
    eta, b, version, counted = raw
    return _json_value(eta), _json_value(b), int(version or 0), int(counted)


class _TransactionFailed(Exception):
    """BEGIN or COMMIT failed (its cause is the driver's error): no turn of the batch was stored."""


class SqliteStatements:
    """Turns are group-committed: those stored in the same turn of the event loop share one transaction (a
    commit writes the WAL pages it dirtied, ~45 us for one turn alone, and turns share pages)."""

    _BUMP = f"UPDATE {S.name} SET turn_count = turn_count + 1, last_active_at = ? WHERE id = ? RETURNING turn_count"
    _INSERT = (f"INSERT INTO {T.name} ({', '.join(_SET_BY_STORE)}, {', '.join(c.name for c in INSERTED_COLUMNS)}) "
               f"VALUES ({', '.join('?' for _ in (*_SET_BY_STORE, *INSERTED_COLUMNS))})")
    _SEQ = _SET_BY_STORE.index("seq")

    def __init__(self, db: sqlite3.Connection, write_lock: asyncio.Lock, loop: asyncio.AbstractEventLoop) -> None:
        self.db = db
        self.write_lock = write_lock
        self._queue: list[tuple[str, float, list[Any], asyncio.Future[int]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._loop = loop
        """The store's loop (`Store.open`'s)."""

    async def session_auth(self, column: str, value: str) -> AuthRow | None:
        return _auth_row(self.db.execute(f"{_AUTH}{column} = ?", (value,)).fetchone())

    async def insert_turn(self, session_id: str, now: float, turn: TurnRecord) -> int:
        return await self.insert_turn_started(session_id, now, turn)

    def insert_turn_started(self, session_id: str, now: float, turn: TurnRecord) -> asyncio.Future[int]:
        """The turn queued for the writer's next group commit; the future resolves to its seq once committed."""
        params = [session_id, 0, now, *turn_params(turn)]
        done: asyncio.Future[int] = self._loop.create_future()
        self._queue.append((session_id, now, params, done))
        if self._writer is None:  # it starts after this turn of the loop: what else is stored in it joins
            self._writer = self._loop.create_task(self._write())
        return done

    async def _write(self) -> None:
        try:
            async with self.write_lock:
                while self._queue:
                    batch, self._queue = self._queue, []
                    self._commit_or_split(batch)
        finally:
            self._writer = None

    def _commit_or_split(self, batch: list[tuple[str, float, list[Any], asyncio.Future[int]]]) -> None:
        """One transaction for the batch; if a statement fails, each turn again on its own (one bad turn fails
        alone). If the transaction itself could not start or commit (the file locked past busy_timeout by
        another process, the disk), every turn of the batch gets that error at once."""
        try:
            results = self._commit(batch)
        except _TransactionFailed as e:
            results = [cast(Exception, e.__cause__)] * len(batch)
        except Exception as e:  # recovery: retried turn by turn below, or answered with the error
            if len(batch) > 1:
                for item in batch:
                    self._commit_or_split([item])
                return
            results = [e]
        for (_, _, _, done), result in zip(batch, results, strict=True):
            if done.done():
                continue
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

    def _commit(self, batch: list[tuple[str, float, list[Any], asyncio.Future[int]]]) -> list[int | Exception]:
        db = self.db
        results: list[int | Exception] = []
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise _TransactionFailed() from e
        try:
            for session_id, now, params, _ in batch:
                bumped = db.execute(self._BUMP, (now, session_id)).fetchall()
                if not bumped:
                    results.append(NotFound(f"no session {session_id}"))
                    continue
                params[self._SEQ] = seq = int(bumped[0][0])
                db.execute(self._INSERT, params)
                results.append(seq)
            try:
                db.execute("COMMIT")
            except sqlite3.Error as e:
                raise _TransactionFailed() from e
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return results

    async def admission(self) -> AdmissionRow:
        return _admission_row(self.db.execute(_ADMISSION).fetchone())

    _GROUP_INSERT = _insert(G, GROUP_COLUMNS, ["?"] * len(GROUP_COLUMNS))
    _SESSION_INSERT = _insert(S, SESSION_COLUMNS, ["?"] * len(SESSION_COLUMNS))

    async def create_group(self, group: list[Any], sessions: list[list[Any]]) -> None:
        """A group's row and its sessions' rows (`row_params` of each) in one transaction."""

        async def work(fetch: Fetch) -> None:
            self.db.execute(self._GROUP_INSERT, group)
            self.db.executemany(self._SESSION_INSERT, sessions)

        await self._transaction(work)

    async def _transaction(self, work: Callable[[Fetch], Awaitable[R]]) -> R:
        """`work`'s statements in one transaction, under the store's write lock (as every write to the file)."""

        async def fetch(sql: str, *params: Any) -> list[Any]:
            return self.db.execute(sql.format(*("?" for _ in params)), params).fetchall()

        async with self.write_lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                out = await work(fetch)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        return out

    async def reward_session(self, session_id: str, reward: float, finish: bool) -> tuple[str, str | None]:
        return await self._transaction(lambda fetch: reward_session(fetch, session_id, reward, finish))

    async def reward_group(self, group_id: str, rewards: Sequence[tuple[str, float]],
                           finish: bool) -> tuple[str, list[str], str | None]:
        return await self._transaction(lambda fetch: reward_group(fetch, group_id, rewards, finish))

    async def close(self) -> None:
        """The connection belongs to the engine (`InLoopEngine.dispose` closes it)."""
        if self._writer is not None:
            await self._writer


def _pg_type(col: Any) -> str:
    """The column's PostgreSQL type without a length: a cast must not truncate what the column would refuse."""
    return re.sub(r"\(.*\)", "", str(col.type.compile(dialect=postgresql.dialect())))


class PgStatements:
    _INSERTED = INSERTED_COLUMNS
    # $1 = now, $2 = session id, then the turn's other columns in order; parameters carry casts because an
    # INSERT ... SELECT does not type them from the target columns.
    _INSERT = (
        f"WITH s AS (UPDATE {S.name} SET turn_count = turn_count + 1, last_active_at = $1 WHERE id = $2 "
        f"RETURNING turn_count) "
        f"INSERT INTO {T.name} (session_id, seq, created_at, {', '.join(c.name for c in _INSERTED)}) "
        f"SELECT $2, s.turn_count, $1, "
        + ", ".join(f"CAST(${i + 3} AS {_pg_type(c)})" for i, c in enumerate(_INSERTED))
        + " FROM s RETURNING seq"
    )

    def __init__(self, pool: PgConnections) -> None:
        self.pool = pool

    @classmethod
    async def open(cls, connect_args: dict[str, Any], max_size: int = 16) -> PgStatements:
        """`connect_args`: asyncpg.connect keywords, as SQLAlchemy's asyncpg dialect derives them from the URL."""
        # Not asyncpg's Pool: its acquire and release cost 40-75 us of CPU a statement (gateway.store.pg_pool). These
        # statements leave no session state behind (no SET, LISTEN or advisory lock; a transaction ends in it).
        return cls(await PgConnections.open(connect_args, max_size))

    async def session_auth(self, column: str, value: str) -> AuthRow | None:
        return _auth_row(await self.pool.fetchrow(f"{_AUTH}{column} = $1", value))

    async def insert_turn(self, session_id: str, now: float, turn: TurnRecord) -> int:
        params = turn_params(turn)
        seq = await self.pool.fetchval(self._INSERT, now, session_id, *params)
        if seq is None:
            raise NotFound(f"no session {session_id}")
        return int(seq)

    async def admission(self) -> AdmissionRow:
        return _admission_row(await self.pool.fetchrow(_ADMISSION))

    _GROUP_INSERT = _insert(G, GROUP_COLUMNS, [f"CAST(${i + 1} AS {_pg_type(c)})" for i, c in enumerate(GROUP_COLUMNS)])
    _SESSION_INSERT = _insert(S, SESSION_COLUMNS,
                              [f"CAST(${i + 1} AS {_pg_type(c)})" for i, c in enumerate(SESSION_COLUMNS)])

    async def create_group(self, group: list[Any], sessions: list[list[Any]]) -> None:
        """A group's row and its sessions' rows (`row_params` of each) in one transaction."""
        async with self.pool.holding() as conn, conn.transaction():
            await conn.execute(self._GROUP_INSERT, *group)
            await conn.executemany(self._SESSION_INSERT, sessions)

    async def _transaction(self, work: Callable[[Fetch], Awaitable[R]], locked: tuple[str, ...]) -> R:
        """`work`'s statements in one transaction; the reads in `locked` take their rows' locks (FOR UPDATE)."""
        async with self.pool.holding() as conn, conn.transaction():

            async def fetch(sql: str, *params: Any) -> list[Any]:
                if any(sql is read for read in locked):
                    sql += " FOR UPDATE"
                return list(await conn.fetch(sql.format(*(f"${i + 1}" for i in range(len(params)))), *params))

            return await work(fetch)

    async def reward_session(self, session_id: str, reward: float, finish: bool) -> tuple[str, str | None]:
        """The first read locks the session's row and its group's, so two sessions of a group finishing at once
        complete it in turn: each sees the other's end."""
        return await self._transaction(lambda fetch: reward_session(fetch, session_id, reward, finish),
                                       (_REWARD_READ,))

    async def reward_group(self, group_id: str, rewards: Sequence[tuple[str, float]],
                           finish: bool) -> tuple[str, list[str], str | None]:
        """The reads lock the group's sessions, in id order, and then the group: sessions before their group, as
        every other path takes them (a session's reward, its end, the idle sweeper), so no two of them can wait
        on each other in a cycle."""
        return await self._transaction(lambda fetch: reward_group(fetch, group_id, rewards, finish),
                                       (_GROUP_SESSIONS_READ, _GROUP_READ))

    async def close(self) -> None:
        await self.pool.close(10)


Direct = SqliteStatements | PgStatements
