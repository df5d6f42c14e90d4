"""The SQLite engine runs the sqlite3 driver on the event loop's thread (gateway/store/db.py): reads must never
wait for a writer, writes take the write lock up front, and a failed write transaction leaves nothing behind."""

from __future__ import annotations

import asyncio
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
