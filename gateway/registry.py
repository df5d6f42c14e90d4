"""`Registry`, which keeps this process's backend pool in step with the store's backend table (the admin routes
that add, list and remove SGLang servers at run time are gateway/routes/backends.py).

The registry is a store table, so every gateway process sees the same servers, under the same ids: each
reloads it on its health interval and before each publish; a new backend is brought to the current weight
version before it takes traffic.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import cast

from sqlalchemy import Table, delete, select

from gateway.pool import Backend, BackendPool
from gateway.store.db import STORE_UNAVAILABLE
from gateway.store.models import BackendRow
from gateway.store.store import Store

BR = cast(Table, BackendRow.__table__)
log = logging.getLogger("rollway.gateway")


class Registry:
    """The store's backend table mirrored into this process's pool, so a backend added or removed through any
    gateway is used (or dropped) by every one: read on each health interval (`follow`) and before each publish
    (a publish must reach every backend that serves, whichever gateway added it). A backend joins under the
    store's id (a DELETE through any gateway names it) and is admitted at once when it answers (brought to the
    current weights first), else by the health loop. Backends of the command line are this process's own and
    stay, and so does one this process is still adding (in the pool, not yet in the store).

    Reads and this process's own writes of the table take one lock, so a read never sees the table from
    before a write and the pool from after it (or the other way round)."""

    def __init__(self, pool: BackendPool, store: Store, configured: list[str]) -> None:
        self.pool = pool
        self.store = store
        self.configured = {u.rstrip("/") for u in configured}
        self._lock = asyncio.Lock()
        self._adding: collections.Counter[str] = collections.Counter()

    async def _stored(self) -> dict[str, str]:
        """url -> id of the enabled backends in the store."""
        async with self.store.engine.connect() as conn:
            rows = await conn.execute(select(BR.c.url, BR.c.id).where(BR.c.enabled.is_(True)))
            return {str(row.url).rstrip("/"): str(row.id) for row in rows}

    async def reload(self) -> None:
        async with self._lock:
            stored = await self._stored()
            present = {b.url: b for b in self.pool.backends()}
            added = []
            for url, bid in sorted(stored.items()):
                if url not in present:
                    log.info("backend %s registered by another gateway: adding it", url)
                    added.append(self.add(url, bid))
            for url, backend in present.items():
                if url not in stored and url not in self.configured and not self._adding[url]:
                    log.info("backend %s removed by another gateway: dropping it", url)
                    self.pool.remove(backend.id)
        if added:
            await self.pool.admit(added)

    def add(self, url: str, stored_id: str | None) -> Backend:
        """Into the pool, out of rotation, under the store's id (unless this pool uses it for another URL)."""
        taken = stored_id is not None and any(b.id == stored_id for b in self.pool.backends())
        return self.pool.add(url, backend_id=None if taken else stored_id, healthy=False)

    async def follow(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reload()
            except STORE_UNAVAILABLE as e:  # recovery: the next round reads it again
                log.warning("backend registry not read: %s", e)
            except Exception:  # recovery: the loop must outlive a bad round
                log.exception("backend registry round failed")

    @contextlib.asynccontextmanager
    async def adding(self, url: str) -> AsyncIterator[str | None]:
        """While this process adds `url` (its weights load before it is stored), the reads leave it in the
        pool. Yields the id the store already has for it (added through another gateway), if any."""
        self._adding[url] += 1
        try:
            async with self.store.engine.connect() as conn:
                stored_id = (await conn.execute(select(BR.c.id).where(BR.c.url == url))).scalar()
            yield None if stored_id is None else str(stored_id)
        finally:
            self._adding[url] -= 1
            if not self._adding[url]:
                del self._adding[url]

    async def record(self, backend: Backend) -> None:
        """Store an added backend (unless a row for its URL is there already)."""
        async with self._lock, self.store.begin() as conn:
            if (await conn.execute(select(BR.c.id).where(BR.c.url == backend.url))).first() is None:
                await conn.execute(BR.insert().values(id=backend.id, url=backend.url, created_at=time.time(),
                                                      enabled=True))

    async def remove(self, backend_id: str) -> bool:
        """Drop a backend from the store and this pool, by the id of either (a backend another gateway added
        may not be in this pool yet); False when neither knows it."""
        async with self._lock:
            backend = next((b for b in self.pool.backends() if b.id == backend_id), None)
            async with self.store.begin() as conn:
                if backend is not None:
                    await conn.execute(delete(BR).where(BR.c.url == backend.url))
                elif not (await conn.execute(delete(BR).where(BR.c.id == backend_id))).rowcount:
                    return False
            if backend is not None:
                self.pool.remove(backend.id)
            return True
