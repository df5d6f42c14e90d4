"""The per-call statements sent straight to the driver (gateway/store/direct.py) store and read exactly what the
SQLAlchemy Core path does, on SQLite and on PostgreSQL; a turn for an unknown session stores nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.errors import NotFound
from gateway.samples import LeaseSamples
from gateway.store.db import create_engine
from gateway.store.models import TURN_RECORD_FIELDS, Turn, TurnRecord
from gateway.store.store import Store
from rollway_common.wire import pack


def turn_values(turn_id: str) -> TurnRecord:
    return TurnRecord(id=turn_id, parent_id=None, endpoint="chat",
                request={"messages": [{"role": "user", "content": "é 1+1"}], "tools": None, "asked": {"n": 1}},
                reply={"role": "assistant", "content": "2"}, prompt_ids=pack([1, 2, 3], "int32"), prompt_len=3,
                completion_ids=pack([4], "int32"), logprobs=pack([-0.5], "float32"), versions=pack([0], "int32"),
                temperature=1.0, finish_reason="stop", continuity="new-chain", chain_reason=None,
                client_disconnected=True, timings={"started": 1.5, "backend": None})


async def test_direct_statements_store_and_read_what_sqlalchemy_does(db_url: str) -> None:
    store = Store(create_engine(db_url))
    await store.open()
    try:
        assert store.direct is not None
        _, creds = await store.create_group({"q": 1}, 2, sampling={"temperature": 0.7})
        sid, key = creds[0]
        direct_auth = await store.session_auth(key=key)
        assert await store.insert_turn(sid, turn_values("t-direct")) == 1
        direct, store.direct = store.direct, None  # the SQLAlchemy path
        core_auth = await store.session_auth(key=key)
        assert await store.insert_turn(sid, turn_values("t-core")) == 2
        store.direct = direct
        assert core_auth is not None and core_auth.turn_count == 1
        assert direct_auth == dataclasses.replace(core_auth, turn_count=0)
        assert direct_auth.sampling["temperature"] == 0.7
        assert await store.session_auth(session_id=sid) == dataclasses.replace(core_auth, turn_count=2)
        d_row, c_row = await store.session_turns(sid)
        assert (d_row.id, d_row.seq, c_row.id, c_row.seq) == ("t-direct", 1, "t-core", 2)
        for name in d_row.__slots__:
            if name not in ("id", "seq"):
                assert getattr(d_row, name) == getattr(c_row, name), name
        assert d_row.client_disconnected is True and d_row.reward is None
        assert await store.session_auth(key="rw-nope") is None and await store.session_auth(session_id="x") is None
    finally:
        await store.close()


async def test_a_turn_for_an_unknown_session_stores_nothing(db_url: str) -> None:
    store = Store(create_engine(db_url))
    await store.open()
    try:
        with pytest.raises(NotFound):
            await store.insert_turn("sess_missing", turn_values("t-orphan"))
        _, creds = await store.create_group({"q": 2}, 2, sampling={})
        assert await store.insert_turn(creds[0][0], turn_values("t-kept")) == 1  # the store is still usable
        assert [r.id for r in await store.session_turns(creds[0][0])] == ["t-kept"]
        assert await store.session_turns("sess_missing") == []
    finally:
        await store.close()


async def test_concurrent_turns_share_commits_and_a_bad_one_fails_alone(db_url: str) -> None:
    """Turns stored together (SQLite group-commits them) each get their own seq; an unknown session and a
    duplicate turn id fail only their own call."""
    import asyncio

    store = Store(create_engine(db_url))
    await store.open()
    try:
        _, creds = await store.create_group({"q": 3}, 8, sampling={})
        sids = [sid for sid, _ in creds]
        await store.insert_turn(sids[0], turn_values("t-dup"))
        calls = [store.insert_turn(sid, turn_values(f"t-{i}-{sid}")) for i in range(3) for sid in sids]
        calls.append(store.insert_turn("sess_missing", turn_values("t-missing")))
        calls.append(store.insert_turn(sids[1], turn_values("t-dup")))  # the id is taken
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[-2], NotFound)
        assert isinstance(results[-1], Exception) and not isinstance(results[-1], NotFound)
        for k, sid in enumerate(sids):  # (on PostgreSQL the three calls of a session may land in any order)
            rows = await store.session_turns(sid)
            assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
            assert sorted(r.id for r in rows if r.id != "t-dup") == [f"t-{i}-{sid}" for i in range(3)]
            first = 2 if k == 0 else 1  # the first session already had a turn
            assert sorted(results[k:-2:len(sids)]) == [first, first + 1, first + 2]  # type: ignore[type-var]
    finally:
        await store.close()


def test_a_turn_record_names_the_columns_the_gateway_writes() -> None:
    """A turn is a typed record: every field is a column of `turns`, every column but those the store sets
    (session_id, seq, created_at) and the reward (set by a reward call) is a field, and a misspelt or a
    store-set field cannot be given at all (the dict it replaced once carried a `session_id` that stored the
    turn in another session than the one it counted)."""
    columns = set(Turn.__table__.columns.keys())
    assert set(TURN_RECORD_FIELDS) == columns - {"session_id", "seq", "created_at", "reward"}
    good = dataclasses.asdict(turn_values("t"))
    with pytest.raises(TypeError, match="finsh_reason"):
        TurnRecord(**{**good, "finsh_reason": "stop"})
    with pytest.raises(TypeError, match="session_id"):
        TurnRecord(**{**good, "session_id": "sess_other"})


async def test_both_paths_store_a_records_defaults(db_url: str) -> None:
    """The fields a record may leave out (client_disconnected, constrained) and the column it has no
    field for (reward) read back the same on the direct path and the SQLAlchemy path."""
    store = Store(create_engine(db_url))
    await store.open()
    try:
        assert store.direct is not None
        _, creds = await store.create_group({"q": 3}, 1, sampling={})
        sid = creds[0][0]
        bare = dataclasses.asdict(turn_values("t"))
        for k in ("client_disconnected", "constrained"):
            del bare[k]
        first, second = f"t-bare-direct-{sid}", f"t-bare-core-{sid}"  # turn ids are unique in the whole store
        assert await store.insert_turn(sid, TurnRecord(**{**bare, "id": first})) == 1
        direct, store.direct = store.direct, None
        try:
            assert await store.insert_turn(sid, TurnRecord(**{**bare, "id": second})) == 2
        finally:
            store.direct = direct
        a, b = await store.session_turns(sid)
        assert (a.id, b.id, a.client_disconnected, a.constrained, a.reward) == (first, second, False, False, None)
        assert dataclasses.replace(a, id=second, seq=2) == b
    finally:
        await store.close()


async def _reward_scenarios(store: Store) -> list[Any]:
    """Every branch of a session reward, each in a group of its own; what each call returned or raised, then the
    groups' and sessions' states (ids and times left out)."""
    from gateway.errors import GatewayError
    from gateway.store.leases import LeaseRequest, Leases

    out: list[Any] = []

    async def call(sid: str, reward: float, finish: bool) -> None:
        try:
            out.append(await store.set_reward(sid, reward, None, finish=finish))
        except GatewayError as e:
            out.append((type(e).__name__, str(e).replace(sid, "SID")))

    groups = []
    _, a = await store.create_group("two finish", 2, sampling={})  # open, then complete
    await call(a[0][0], 1.0, True)
    await call(a[1][0], 0.0, False)  # rewarded, not finished: the group stays open
    await call(a[1][0], 0.0, True)
    await call(a[1][0], 0.0, True)  # finishing twice is a no-op
    _, b = await store.create_group("abandoned", 2, sampling={})  # an abandoned session takes no reward
    await store.end_session(b[0][0], "abandoned", "x")
    await call(b[0][0], 1.0, True)
    await call(b[1][0], 1.0, True)  # the last live one of two: too few sessions, dropped
    _, c = await store.create_group("one", 1, sampling={})
    await call(c[0][0], 0.5, True)
    _, d = await store.create_group("after the lease", 2, sampling={})
    for sid, _ in d:  # a turn each: a group with nothing to train is dropped by the lease, not leased
        await store.insert_turn(sid, dataclasses.replace(turn_values(f"t-{sid}"), client_disconnected=False))
        await call(sid, 1.0, True)
    leases = Leases(store, LeaseSamples(1.0))
    await leases.lease(LeaseRequest(64, 60, None, None, None))
    await call(d[0][0], 1.0, True)  # the same reward again: fine
    await call(d[0][0], 0.0, True)  # another one: final
    _, e = await store.create_group("finished then rewarded", 2, sampling={})
    await store.end_session(e[0][0], "finished", None)
    await call(e[0][0], 0.25, False)
    await call("sess_missing", 1.0, True)
    for creds in (a, b, c, d, e):
        groups.append(creds)
    for creds in groups:
        session, _ = await store.session(creds[0][0])
        group = await store.group(session["group_id"])
        out.append((group["state"], group.get("drop_reason"),
                    [(s["state"], s["reward"], s.get("end_reason")) for s in group["sessions"]]))
    return out


async def test_a_session_reward_does_on_the_direct_path_what_sqlalchemy_does(db_url: str) -> None:
    store = Store(create_engine(db_url))
    await store.open()
    try:
        assert store.direct is not None
        direct = await _reward_scenarios(store)
        saved, store.direct = store.direct, None  # the SQLAlchemy path
        try:
            core = await _reward_scenarios(store)
        finally:
            store.direct = saved
        assert direct == core
        assert direct[:4] == ["finished", "active", "finished", "finished"]
        # complete without a turn: dropped by the lease (no_samples); d, complete with turns: leased
        assert direct[-5][:2] == ("dropped", "no_samples") and direct[-4][:2] == ("dropped", "too_few_sessions")
        assert direct[-2][0] == "leased"
        assert ("Conflict", "group of session SID was already leased; reward is final") in direct
    finally:
        await store.close()


async def test_sessions_of_a_group_finishing_at_once_complete_it(db_url: str) -> None:
    import asyncio

    store = Store(create_engine(db_url))
    await store.open()
    try:
        gid, creds = await store.create_group("race", 8, sampling={})
        states = await asyncio.gather(*(store.set_reward(sid, 1.0, None, finish=True) for sid, _ in creds))
        assert states == ["finished"] * 8
        assert (await store.group(gid))["state"] == "complete"
    finally:
        await store.close()


async def test_admission_reads_what_the_core_path_reads(db_url: str) -> None:
    """`Leases.admission` on the direct path (one statement) and on the Core path (three reads): the same answer
    with nothing set, with eta and B remembered from a lease request, after versions, and with groups in every
    state (eval groups and dropped ones are not counted)."""
    from sqlalchemy import update

    from gateway.store.leases import G, LeaseRequest, Leases

    store = Store(create_engine(db_url))
    await store.open()
    leases = Leases(store, LeaseSamples(1.0))

    async def both(default_b: int = 4, default_eta: int = 1) -> tuple[bool, int, int]:
        direct_answer = await leases.admission(default_b, default_eta)
        direct, store.direct = store.direct, None
        try:
            core_answer = await leases.admission(default_b, default_eta)
        finally:
            store.direct = direct
        assert direct_answer == core_answer
        return direct_answer

    try:
        assert store.direct is not None
        version = (await leases.current_weights())[0]
        _, before, limit = await both()  # the module's database: earlier tests' groups are there
        assert limit == (1 + version + 1) * 4  # the defaults
        gids = [(await store.create_group({"q": i}, 2, sampling={}))[0] for i in range(6)]
        await store.create_group({"q": "eval"}, 2, sampling={}, is_eval=True)
        async with store.begin() as conn:
            for gid, state in zip(gids, ("open", "complete", "leased", "trained", "dropped", "dropped"), strict=True):
                await conn.execute(update(G).where(G.c.id == gid).values(state=state))
        n = before + 4
        assert await both() == (n < limit, n, limit)
        await leases.remember_params(LeaseRequest(max_groups=1, lease_seconds=1.0, groups_per_step=3,
                                                   max_head_offpolicyness=0, trainer_version=None))
        assert await both() == (n < (version + 1) * 3, n, (version + 1) * 3)  # stored values win over defaults
        await leases.publish(version + 1, "/m/1", [], {}, {})
        await leases.publish(version + 2 + n, "/m/2", [], {}, {})
        assert await both() == (True, n, (version + 3 + n) * 3)
        await leases.remember_params(LeaseRequest(max_groups=1, lease_seconds=1.0, groups_per_step=3,
                                                   max_head_offpolicyness=-1, trainer_version=None))
        assert await both() == (True, 0, -1)  # eta < 0: no admission control
    finally:
        await store.close()


async def test_the_admission_count_follows_every_change_of_groups(db_url: str) -> None:
    """admission_counts (kept by triggers, migration 0005) equals a count of the counted groups after inserts,
    changes of state between counted and not counted ones (both ways), within counted ones, of is_eval, and
    deletes; admission reads it."""
    from sqlalchemy import delete, func, select, update

    from gateway.store.leases import AC, COUNTED, G, LeaseRequest, Leases, S

    store = Store(create_engine(db_url))
    await store.open()
    leases = Leases(store, LeaseSamples(1.0))
    await leases.remember_params(LeaseRequest(max_groups=1, lease_seconds=1.0, groups_per_step=4,
                                               max_head_offpolicyness=1, trainer_version=None))

    async def check() -> int:
        async with store.engine.connect() as conn:
            kept = (await conn.execute(select(AC.c.groups).where(AC.c.id == 1))).scalar_one()
            counted = (await conn.execute(select(func.count()).select_from(G).where(
                G.c.state.in_(COUNTED), G.c.is_eval.is_(False)))).scalar_one()
        assert kept == counted
        got = await leases.admission(4, 1)
        assert got[1] == kept, got
        return int(kept)

    async def change(gid: str, **values: Any) -> None:
        async with store.begin() as conn:
            await conn.execute(update(G).where(G.c.id == gid).values(**values))

    try:
        start = await check()
        gids = [(await store.create_group({"q": i}, 2, sampling={}))[0] for i in range(4)]
        eval_gid = (await store.create_group({"q": "eval"}, 2, sampling={}, is_eval=True))[0]
        assert await check() == start + 4
        await change(gids[0], state="complete")
        await change(gids[0], state="leased")
        await change(gids[0], state="trained")  # counted all along
        await change(gids[1], state="dropped", drop_reason="filtered")
        assert await check() == start + 3
        await change(gids[1], state="complete")  # back (as no code path does, but the count must follow)
        await change(eval_gid, is_eval=False)
        assert await check() == start + 5
        await change(gids[2], is_eval=True, state="dropped")
        async with store.begin() as conn:
            await conn.execute(update(G).where(G.c.id.in_([gids[3], gids[1]])).values(state="leased"))
            await conn.execute(delete(S).where(S.c.group_id == gids[3]))
            await conn.execute(delete(G).where(G.c.id == gids[3]))
        assert await check() == start + 3
    finally:
        await store.close()


async def test_group_rewards_give_what_the_core_path_gives(db_url: str) -> None:
    """`Store.set_group_rewards` on the direct path (one transaction) and on the Core path (a transaction per
    session): the same answers, stored rewards, session states, group state, and group-end notices."""
    from gateway.errors import Conflict

    store = Store(create_engine(db_url))
    await store.open()
    ended: list[str] = []
    store.on_group_end = ended.append
    direct = store.direct
    try:
        results = []
        for path in ("direct", "core"):
            store.direct = direct if path == "direct" else None
            gid, creds = await store.create_group({"q": path}, 3, sampling={})
            sids = [sid for sid, _ in creds]
            await store.end_session(sids[2], "abandoned", "test")
            with pytest.raises(NotFound):
                await store.set_group_rewards("grp_missing", [(sids[0], 1.0)], finish=True)
            with pytest.raises(Conflict):
                await store.set_group_rewards(gid, [(sids[2], 1.0)], finish=True)
            first = await store.set_group_rewards(gid, [(sids[0], 1.0)], finish=True)
            second = await store.set_group_rewards(gid, [(sids[1], 0.25), (sids[0], 1.0)], finish=True)
            group = await store.group(gid)
            # a group left with one live session is dropped once it is rewarded and finished
            gid2, creds2 = await store.create_group({"q": path + "-drop"}, 3, sampling={})
            for sid, _ in creds2[1:]:
                await store.end_session(sid, "abandoned", "test")
            dropped = await store.set_group_rewards(gid2, [(creds2[0][0], 0.5)], finish=True)
            results.append((first, second, group["state"],
                            [(s["state"], s["reward"]) for s in group["sessions"]], list(ended), dropped,
                            (await store.group(gid2))["state"]))
            ended.clear()
        store.direct = direct
        assert results[0] == results[1]
        assert results[0][:2] == (("open", ["finished"]), ("complete", ["finished", "finished"]))
        assert results[0][4:] == (["complete", "dropped"], ("dropped", ["finished"]), "dropped")
    finally:
        store.direct = direct
        await store.close()


async def test_a_group_is_created_on_the_direct_path_as_sqlalchemy_creates_it(db_url: str) -> None:
    """Every column of the group's row and its sessions' rows reads back as what the Core path writes: JSON (a string
    task, a null metadata stored as JSON null, not SQL NULL), booleans, NULLs. (The JSON text itself differs in
    spacing and escapes; nothing reads it as text.)"""
    from sqlalchemy import select, text

    from gateway.store.direct import G, S

    store = Store(create_engine(db_url))
    await store.open()
    try:
        assert store.direct is not None
        made = {}
        for path in ("direct", "core"):
            direct = store.direct
            if path == "core":
                store.direct = None
            try:
                for task, metadata, is_eval in (({"q": "é", "n": [1, 2.5]}, None, False), ("plain", {"k": 1}, True)):
                    gid, creds = await store.create_group(task, 3, sampling={"temperature": 0.5, "top_p": None},
                                                          metadata=metadata, is_eval=is_eval)
                    made.setdefault(path, []).append((gid, creds))
            finally:
                store.direct = direct

        async def rows(gid: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            async with store.engine.connect() as conn:
                g = (await conn.execute(select(G).where(G.c.id == gid))).mappings().one()
                ss = (await conn.execute(select(S).where(S.c.group_id == gid).order_by(S.c.replica))).mappings().all()
                # SQL NULL and JSON null both read back as None: which one is stored, asked of the database
                nulls = (await conn.execute(text(
                    "SELECT metadata IS NULL, task IS NULL, drop_reason IS NULL FROM groups WHERE id = :id"),
                    {"id": gid})).one()
            skip = {"id", "group_id", "key_hash", "created_at", "last_active_at"}
            return ({**{k: v for k, v in g.items() if k not in ("id", "created_at")}, "nulls": tuple(nulls)},
                    [{k: v for k, v in s.items() if k not in skip} for s in ss])

        for (d_gid, d_creds), (c_gid, _) in zip(made["direct"], made["core"], strict=True):
            assert await rows(d_gid) == await rows(c_gid)
            d_group, c_group = await store.group(d_gid), await store.group(c_gid)
            for key in ("task", "n_samples", "state", "is_eval", "sampling", "metadata"):
                assert d_group[key] == c_group[key], key
            for sid, key in d_creds:  # each session opens with its key, on its own replica
                auth = await store.session_auth(key=key)
                assert auth is not None and auth.id == sid and auth.group_id == d_gid and auth.state == "active"
    finally:
        await store.close()


def test_the_admission_count_starts_as_the_count_of_the_groups_already_there(tmp_path: Any) -> None:
    """Migration 0005 on a store that has groups: the count starts from them (then the triggers keep it)."""
    import sqlite3

    from gateway.store import db

    url = f"sqlite:///{tmp_path / 'old.db'}"
    db.upgrade(url, "0004")
    con = sqlite3.connect(tmp_path / "old.db")
    rows = [("g1", "open", 0), ("g2", "trained", 0), ("g3", "dropped", 0), ("g4", "complete", 1), ("g5", "leased", 0)]
    con.executemany("INSERT INTO groups (id, task, n_samples, state, is_eval, sampling, created_at) "
                    "VALUES (?, '{}', 2, ?, ?, '{}', 0)", rows)
    con.commit()
    db.upgrade(url)
    assert con.execute("SELECT groups FROM admission_counts WHERE id = 1").fetchone() == (3,)
    con.execute("UPDATE groups SET state = 'dropped' WHERE id = 'g1'")
    assert con.execute("SELECT groups FROM admission_counts WHERE id = 1").fetchone() == (2,)
    con.close()


async def test_a_started_insert_commits_when_its_waiter_is_cancelled(db_url: str) -> None:
    """`insert_turn_started` (what a chat call awaits under `asyncio.shield`): a waiter cancelled while the turn
    commits leaves the turn stored, durable, with its seq; a turn for an unknown session fails its future alone."""
    import asyncio

    store = Store(create_engine(db_url))
    await store.open()
    try:
        _, creds = await store.create_group({"q": 9}, 1, sampling={})
        sid = creds[0][0]
        started = store.insert_turn_started(sid, turn_values("t-left"))
        waiter = asyncio.ensure_future(asyncio.shield(started))
        await asyncio.sleep(0)
        waiter.cancel()
        assert await started == 1
        assert waiter.cancelled()
        missing = store.insert_turn_started("sess_missing", turn_values("t-none"))
        kept = store.insert_turn_started(sid, turn_values("t-next"))
        with pytest.raises(NotFound):
            await missing
        assert await kept == 2
        assert [r.id for r in await store.session_turns(sid)] == ["t-left", "t-next"]
    finally:
        await store.close()
