"""The SQLite engine runs the sqlite3 driver on the event loop's thread (gateway/store/db.py): reads must never
wait for a writer, writes take the write lock up front, and a failed write transaction leaves nothing behind."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gateway.store.db import create_engine, upgrade
from gateway.store.models import Group
from gateway.store.store import Store

G = Group.__table__


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    upgrade(url)
    return url


async def _groups(store: Store) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(G))).scalar_one())


async def test_a_read_does_not_wait_for_another_process_writer(db: str) -> None:
    store = Store(create_engine(db))
    try:
        await store.create_group({"q": 1}, 2, sampling={})
        other = sqlite3.connect(db.removeprefix("sqlite:///"), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        t0 = time.perf_counter()
        assert await _groups(store) == 1  # WAL: the read sees the last commit at once
        assert time.perf_counter() - t0 < 1.0  # busy_timeout is 10 s: a read that took the lock would wait
        other.execute("ROLLBACK")
        other.close()
    finally:
        await store.engine.dispose()


async def test_a_write_waits_for_the_lock_then_commits(db: str) -> None:
    store = Store(create_engine(db))
    assert await _groups(store) == 0  # the store's first connection puts the file in WAL mode
    other = sqlite3.connect(db.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    timer = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    timer.start()
    try:
        t0 = time.perf_counter()
        await store.create_group({"q": 1}, 2, sampling={})
        assert time.perf_counter() - t0 >= 0.25  # it waited for the other writer instead of failing
        assert await _groups(store) == 1
    finally:
        timer.join()
        other.close()
        await store.engine.dispose()


async def test_a_failed_write_rolls_back_and_concurrent_writers_all_land(db: str) -> None:
    store = Store(create_engine(db))
    try:
        with pytest.raises(RuntimeError):
            async with store.begin() as conn:
                await conn.execute(G.insert().values(id="g-x", task={}, n_samples=1, state="open", sampling={},
                                                     created_at=time.time()))
                raise RuntimeError("boom")
        assert await _groups(store) == 0

        async def create(i: int) -> None:
            await asyncio.sleep(0.001 * (i % 3))
            await store.create_group({"q": i}, 2, sampling={})

        await asyncio.gather(*(create(i) for i in range(50)), *(_groups(store) for _ in range(50)))
        assert await _groups(store) == 50
    finally:
        await store.engine.dispose()


async def test_raw_hot_path_stores_and_reads_what_sqlalchemy_does(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """session_auth and insert_turn go to the sqlite3 driver directly: same rows as through SQLAlchemy."""
    from gateway.wire import pack

    store = Store(create_engine(db))
    try:
        _, creds = await store.create_group({"q": 1}, 2, sampling={"temperature": 0.7})
        values = dict(parent_id=None, endpoint="chat", request={"messages": [{"role": "user", "content": "é 1+1"}]},
                      reply={"role": "assistant", "content": "2"}, prompt_ids=pack([1, 2, 3], "int32"), prompt_len=3,
                      completion_ids=pack([4], "int32"), logprobs=pack([-0.5], "float32"),
                      versions=pack([0], "int32"), temperature=1.0, finish_reason="stop", continuity="new-chain",
                      chain_reason=None, client_disconnected=True, timings={"started": 1.5})
        raw_auth = await store.session_auth(key=creds[0][1])
        await store.insert_turn(creds[0][0], {"id": "t-raw", **values})
        assert store._sqlite is not None
        monkeypatch.setattr(store, "_sqlite", None)  # the SQLAlchemy path
        sa_auth = await store.session_auth(key=creds[0][1])
        await store.insert_turn(creds[0][0], {"id": "t-sa", **values})
        assert sa_auth is not None and sa_auth.turn_count == 1
        sa_auth = dataclasses.replace(sa_auth, turn_count=0)
        assert raw_auth == sa_auth and raw_auth is not None and raw_auth.sampling["temperature"] == 0.7
        raw_row, sa_row = await store.session_turns(creds[0][0])
        assert (raw_row.id, raw_row.seq, sa_row.id, sa_row.seq) == ("t-raw", 1, "t-sa", 2)
        for name in raw_row.__slots__:
            if name not in ("id", "seq"):
                assert getattr(raw_row, name) == getattr(sa_row, name), name
        assert raw_row.client_disconnected is True and raw_row.reward is None
        monkeypatch.undo()
        assert (await store.session_auth(key=creds[0][1])).turn_count == 2  # type: ignore[union-attr]
        assert await store.session_auth(key="rw-nope") is None and await store.session_auth(session_id="x") is None
    finally:
        await store.engine.dispose()
