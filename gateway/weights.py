"""Weight publishing and staleness admission (docs/architecture.md: "Publishing weights",
"Staleness admission").

Publish: pause every backend (abort mode), load the new weights with their version, continue; the
generation loop resubmits each interrupted reply with its partial tokens (gateway.generation), so no
work is lost and agents see no error. Then bump the version and ack the batch in one transaction.
A backend that fails to load is reported and taken out of rotation; the health loop brings it back
only after it loaded the current version (`sync_backend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.adapters import Adapters, is_adapter
from gateway.errors import ServiceUnavailable, TooManyRequests
from gateway.metrics import Metrics
from gateway.pool import Backend, BackendPool
from gateway.settings import Settings
from gateway.sglang import BackendError
from gateway.store.leases import Leases
from gateway.weight_sync import DISTRIBUTED, AwaitingWeights, refuse_partial

log = logging.getLogger("rollway.gateway")


class Publisher:
    def __init__(self, pool: BackendPool, leases: Leases, metrics: Metrics) -> None:
        self.pool = pool
        self.leases = leases
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self.awaiting: set[str] = set()
        """Backends kept out because they lack a version published over process groups (or hold part of one): a
        catch-up sync brings them to it (gateway/weight_sync.py); listed by `GET /v1/weights/sync`."""
        self.adapters = Adapters(pool, leases)
        pool.adapters = self.adapters

    async def publish(self, version: int, model_path: str, batch_ids: list[str], results: dict[str, str | int]) -> dict[str, Any]:
        await self.leases.check_publishable(version, batch_ids)
        if is_adapter(model_path):
            return await self._publish_adapter(version, model_path, batch_ids, results)
        async with self._lock:
            t0 = time.perf_counter()
            backends = [b for b in self.pool.backends() if b.healthy]
            # By id as it stands now: the registry may drop a backend from the pool while it loads.
            by_id = {b.id: b for b in self.pool.backends()}
            await self.pool.pause_all("abort")
            try:
                errors = await self.pool.update_all(model_path, str(version))
            finally:
                await self.pool.continue_all()
            failed = {bid: str(e) for bid, e in errors.items() if e is not None}
            if backends and len(failed) >= len(backends):
                raise ServiceUnavailable(f"no backend could load {model_path}: {failed}", retry_after=10)
            for bid in failed:
                self.pool.mark_failed(by_id[bid], f"weight load failed: {failed[bid]}")
                log.error("backend %s failed to load version %d: %s", bid, version, failed[bid])
            await self.leases.publish(version, model_path, batch_ids, results, failed)
            self.adapters.full_published()  # full weights replace any adapter: generation goes to the base again
            seconds = time.perf_counter() - t0
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.weight_version.set(version)
        return {"version": version, "model_path": model_path, "seconds": round(seconds, 4), "failed_backends": failed}

    async def _publish_adapter(self, version: int, model_path: str, batch_ids: list[str],
                               results: dict[str, str | int]) -> dict[str, Any]:
        """A LoRA adapter (`lora:<folder>`): loaded as `v{version}` on every backend while they keep generating
        (no pause), committed, then routed to (gateway/adapters.py). A backend that cannot load it leaves the
        rotation until it has, as with full weights."""
        async with self._lock:
            t0 = time.perf_counter()
            backends = [b for b in self.pool.backends() if b.healthy]
            errors = await self.adapters.load(version, model_path, backends)
            failed = {bid: str(e) for bid, e in errors.items() if e is not None}
            if backends and len(failed) >= len(backends):
                raise ServiceUnavailable(f"no backend could load adapter {model_path}: {failed}", retry_after=10)
            for b in backends:
                if b.id in failed:
                    self.pool.mark_failed(b, f"adapter load failed: {failed[b.id]}")
            await self.leases.publish(version, model_path, batch_ids, results, failed)
            evicted = self.adapters.committed(version, model_path)
            seconds = time.perf_counter() - t0
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.weight_version.set(version)
        return {"version": version, "model_path": model_path, "seconds": round(seconds, 4), "failed_backends": failed,
                "kind": "lora", "paused": False, "evicted_versions": evicted}

    async def sync_backend(self, backend: Backend) -> None:
        """Bring a backend to the current version, then put it in rotation (start, recovery, added).

        Under the publish lock: a publish picks the backends it updates among those in rotation, so one that
        read the version before a publish committed the next and joined the rotation after the publish
        picked its backends would serve the old weights until it fails (seen: a backend another gateway
        added, recovered by the health loop during a publish). Waiting for the publish, it reads the version
        that publish stored."""
        async with self._lock:
            version, path = await self.leases.current_weights()
            if version == 0 or path is None:  # nothing to load: only a half-received update keeps it out
                try:
                    await refuse_partial(backend)
                except AwaitingWeights:
                    self.awaiting.add(backend.id)
                    raise
            if version != 0 and path is not None and is_adapter(path):
                await self.adapters.sync_backend(backend, version, path)  # base weights + adapters (gateway/adapters.py)
            elif version != 0 and path is not None:
                info = await backend.client.model_info()
                if str(info.get("weight_version")) != str(version) and path.startswith(DISTRIBUTED):
                    self.awaiting.add(backend.id)  # no folder to load (gateway/weight_sync.py): the trainer sends it
                    raise AwaitingWeights(f"version {version} was published over process groups: the backend gets "
                                          "it from the trainer's next catch-up or publish")
                if str(info.get("weight_version")) != str(version):
                    log.info("loading version %d into backend %s", version, backend.url)
                    await backend.client.update_weights_from_disk(path, str(version))
                backend.weight_version = str(version)
            self.awaiting.discard(backend.id)
            self.pool.mark_healthy(backend)

    async def sync_all(self) -> None:
        for b in self.pool.backends():
            try:
                await self.sync_backend(b)
            except BackendError as e:  # it stays out of rotation until the health loop recovers it
                self.pool.mark_failed(b, f"could not load the current weights: {e}")


class Admission:
    """Staleness control: refuse a new training group once (η + v + 1)·B groups count
    (docs/architecture.md "Staleness admission")."""

    def __init__(self, leases: Leases, settings: Settings, metrics: Metrics) -> None:
        self.leases = leases
        self.settings = settings
        self.metrics = metrics
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Check the budget and hold it until the caller has inserted the group it admits: concurrent
        creations passed the same count and one more group than the budget started (seen at eta = 0). Per
        process; gateways sharing a PostgreSQL store can still overshoot by one group each, and the
        lease-side staleness check stays."""
        async with self._lock:
            await self.check()
            yield

    async def check(self) -> None:
        ok, counted, limit = await self.leases.admission(
            self.settings.default_groups_per_step, self.settings.max_head_offpolicyness
        )
        if not ok:  # counted in rollway_admission_refused_total by the route, once per 429 it answers
            raise TooManyRequests(
                f"staleness control: {counted} groups started for at most {limit} at this weight version; "
                "retry after the trainer publishes", code="staleness_limit", retry_after=1,
            )
