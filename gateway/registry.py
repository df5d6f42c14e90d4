"""The backend pool at run time (admin): add, list, remove SGLang servers; and `Registry`, which keeps this
process's pool in step with the store's backend table.

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

import sqlalchemy.exc
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, field_validator
from sqlalchemy import Table, delete, select

from gateway.auth import admin
from gateway.backend_policy import check_registrable, check_resolved
from gateway.errors import BadRequest, NotFound
from gateway.pool import Backend, BackendPool
from gateway.protocol import Strict
from gateway.routes.common import STORE_UNAVAILABLE, json_response, read_body
from gateway.settings import backend_url
from gateway.sglang import BackendError
from gateway.store.models import BackendRow
from gateway.store.store import Store
from gateway.weight_sync import AwaitingWeights

router = APIRouter()
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


class AddBackend(Strict):
    url: str = Field(min_length=8, max_length=2048, pattern=r"^https?://")
    """An SGLang server's base URL: http:// or https://, host, port (e.g. http://10.0.0.5:30000); what may be
    registered: gateway.backend_policy."""

    @field_validator("url")
    @classmethod
    def _valid(cls, v: str) -> str:
        return check_registrable(backend_url(v))


def backend_json(b: object) -> dict[str, object]:
    return {"id": b.id, "url": b.url, "healthy": b.healthy, "in_flight": b.in_flight,  # type: ignore[attr-defined]
            "weight_version": b.weight_version, "last_error": b.last_error}  # type: ignore[attr-defined]


@router.get("/v1/backends")
async def list_backends(request: Request) -> Response:
    await admin(request)
    return json_response({"object": "list", "data": [backend_json(b) for b in request.app.state.pool.backends()]})


@router.post("/v1/backends")
async def add_backend(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, AddBackend)
    state = request.app.state
    registry: Registry = state.registry
    url = body.url.rstrip("/")
    try:
        await check_resolved(url)
    except ValueError as e:
        raise BadRequest(str(e), param="url") from None
    async with registry.adding(url) as stored_id:
        backend = registry.add(url, stored_id)  # no traffic until it serves the current weights (sync_backend)
        try:
            if not await backend.client.health():
                raise BackendError(f"{url}/health does not answer 200")
            await state.publisher.sync_backend(backend)
        except AwaitingWeights as e:  # kept out of rotation: the trainer's catch-up (or next publish) brings it up
            backend.last_error = str(e)
        except BackendError as e:
            with contextlib.suppress(KeyError):  # a DELETE may have taken it out meanwhile
                state.pool.remove(backend.id)
            # The URL given does not lead to a usable server: the request is what is wrong, not the gateway.
            raise BadRequest(f"backend {url} is not usable (it must answer GET /health and take the current "
                             f"weights; add it again once it does): {e}", param="url", code="backend_unusable") from e
        try:
            await registry.record(backend)
        except sqlalchemy.exc.IntegrityError:  # another gateway stored the same URL at the same moment
            pass
        except BaseException:  # not stored: not kept either, or the next read would drop it unannounced
            with contextlib.suppress(KeyError):
                state.pool.remove(backend.id)
            raise
    return json_response(backend_json(backend), status=201)


@router.delete("/v1/backends/{backend_id}")
async def remove_backend(request: Request, backend_id: str) -> Response:
    await admin(request)
    if not await request.app.state.registry.remove(backend_id):
        raise NotFound(f"no backend {backend_id}")
    return json_response({"id": backend_id, "removed": True})
