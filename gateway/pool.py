"""The backend pool: in-memory routing state over the SGLang servers (the registry itself is the store's).

Routing, in `pick`:
1. A session stays on the backend it used last while that backend is healthy (its prefix cache holds
   the session's earlier turns; docs/architecture.md "Backends and routing").
2. A new session of a group goes where the group's first session went (the siblings share the task
   prompt, slime#1469) unless that backend has more than `affinity_slack` requests in flight above the
   least-loaded one.
3. Otherwise the least-loaded healthy backend: fewest requests in flight, then fewest sticky sessions.

`run_with_failover` (and `stream_with_failover`, which fails over only before the first chunk) retries
on another healthy backend when one raises `BackendUnavailable`, marking it failed; the health loop
brings it back once `/health` answers 200 and the optional `on_recover` hook (e.g. loading the current
weights) succeeded. The health loop probes liveness by one policy (`SGLangClient.probe`, docs/architecture.md
"Liveness"): never `/health` on a server the gateway paused. When every backend was tried: `NoBackendAvailable` (the app answers 503 +
Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Container
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from gateway.sglang import BackendError, BackendUnavailable, GenChunk, PauseMode, SGLangClient

__all__ = ["Backend", "BackendPool", "NoBackendAvailable"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class NoBackendAvailable(BackendError):
    """Every healthy backend was tried (or there is none)."""


@dataclass(slots=True, eq=False)
class Backend:
    id: str
    url: str
    client: SGLangClient
    healthy: bool = True
    in_flight: int = 0
    """Requests running on it through the pool."""
    sessions: int = 0
    """Sessions that stick to it."""
    weight_version: str | None = None
    """Last version `update_all` loaded (or the `on_recover` hook set); None = unknown."""
    last_error: str | None = field(default=None, repr=False)
    health_misses: int = 0
    """Health probes failed in a row (reset by one that passes)."""


class BackendPool:
    """Routing over the backends. `client_options` go to each `SGLangClient` (timeouts)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        health_interval: float = 5.0,
        affinity_slack: int = 4,
        max_sticky: int = 200_000,
        on_recover: Callable[[Backend], Awaitable[None]] | None = None,
        client_options: dict[str, Any] | None = None,
        health_misses: int = 3,
    ) -> None:
        self._session = session
        self._backends: dict[str, Backend] = {}
        self._by_session: OrderedDict[str, str] = OrderedDict()  # LRU: session id -> backend id
        self._by_group: OrderedDict[str, str] = OrderedDict()
        self._max_sticky = max_sticky
        self.health_interval = health_interval
        self.affinity_slack = affinity_slack
        # A busy server can miss a probe (a CPU engine under load answered /health in over 5 s and both
        # were taken out at once): a probe takes a backend out only after this many misses in a row. A
        # request that fails takes it out at once (`run_with_failover`), so a dead server is still caught fast.
        self.health_misses = health_misses
        self._on_recover = on_recover
        self._client_options = client_options or {}
        self._health_task: asyncio.Task[None] | None = None
        self.adapters: Any = None
        """gateway/adapters.py `Adapters` (set by the publisher): the LoRA adapter each request is routed to."""

    # -- registry ----------------------------------------------------------------------------------

    def add(self, url: str, *, backend_id: str | None = None, healthy: bool = True) -> Backend:
        """Add a server; a URL already present returns its entry. `healthy=False` keeps it out of
        routing until the health loop (and `on_recover`) admits it."""
        url = url.rstrip("/")
        for b in self._backends.values():
            if b.url == url:
                return b
        backend_id = backend_id or uuid.uuid4().hex[:12]
        if backend_id in self._backends:
            raise ValueError(f"backend id {backend_id!r} is taken")
        client = SGLangClient(self._session, url, **self._client_options)
        backend = Backend(id=backend_id, url=url, client=client, healthy=healthy)
        self._backends[backend_id] = backend
        return backend

    def remove(self, backend_id: str) -> Backend:
        """Take a server out; requests running on it finish there. KeyError if unknown."""
        backend = self._backends.pop(backend_id)
        backend.healthy = False
        backend.client.close()
        return backend

    def get(self, backend_id: str) -> Backend:
        return self._backends[backend_id]

    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    # -- routing -----------------------------------------------------------------------------------

    def pick(self, session_id: str, group_id: str | None = None) -> Backend:
        backend = self._pick(session_id, group_id, ())
        if backend is None:
            raise NoBackendAvailable("no healthy backend")
        return backend

    def _pick(self, session_id: str, group_id: str | None, exclude: Container[str]) -> Backend | None:
        live = [b for b in self._backends.values() if b.healthy and b.id not in exclude]
        if not live:
            return None
        sticky = self._usable(self._by_session.get(session_id), exclude)
        if sticky is not None:
            self._by_session.move_to_end(session_id)
            return sticky
        least = min(live, key=lambda b: (b.in_flight, b.sessions))
        chosen = least
        if group_id is not None:
            home = self._usable(self._by_group.get(group_id), exclude)
            if home is not None and home.in_flight <= least.in_flight + self.affinity_slack:
                chosen = home
            # First session of the group, or its home is gone or too busy: this one is the new home.
            self._remember(self._by_group, group_id, chosen.id)
        self._stick(session_id, chosen)
        return chosen

    def _usable(self, backend_id: str | None, exclude: Container[str]) -> Backend | None:
        backend = None if backend_id is None else self._backends.get(backend_id)
        if backend is None or not backend.healthy or backend.id in exclude:
            return None
        return backend

    def _stick(self, session_id: str, backend: Backend) -> None:
        old = self._by_session.get(session_id)
        if old is not None and old in self._backends:
            self._backends[old].sessions -= 1
        backend.sessions += 1
        evicted = self._remember(self._by_session, session_id, backend.id)
        if evicted is not None and evicted in self._backends:
            self._backends[evicted].sessions -= 1

    def _remember(self, table: OrderedDict[str, str], key: str, backend_id: str) -> str | None:
        """Set key -> backend id as the most recent entry; returns the backend id of an evicted entry."""
        table[key] = backend_id
        table.move_to_end(key)
        if len(table) > self._max_sticky:
            return table.popitem(last=False)[1]
        return None

    def forget_session(self, session_id: str) -> None:
        """Drop a finished session's stickiness (optional: old entries are evicted anyway)."""
        old = self._by_session.pop(session_id, None)
        if old is not None and old in self._backends:
            self._backends[old].sessions -= 1

    # -- failover ----------------------------------------------------------------------------------

    def mark_failed(self, backend: Backend, reason: str = "") -> None:
        if backend.healthy:
            log.warning("backend %s (%s) marked failed: %s", backend.id, backend.url, reason)
        backend.healthy = False
        backend.last_error = reason or backend.last_error

    def mark_healthy(self, backend: Backend) -> None:
        if backend.id in self._backends:
            backend.healthy = True
            backend.last_error = None

    async def run_with_failover(
        self, session_id: str, group_id: str | None, fn: Callable[[Backend], Awaitable[T]]
    ) -> T:
        """`await fn(backend)` on the picked backend; on BackendUnavailable mark it failed and try the
        next healthy one, each at most once. Other errors propagate unchanged."""
        tried: set[str] = set()
        last: BackendUnavailable | None = None
        while True:
            backend = self._pick(session_id, group_id, tried)
            if backend is None:
                raise NoBackendAvailable(f"no healthy backend left (tried {len(tried)})") from last
            tried.add(backend.id)
            backend.in_flight += 1
            try:
                return await fn(backend)
            except BackendUnavailable as e:  # recovery: retry on another backend
                self.mark_failed(backend, str(e))
                last = e
            finally:
                backend.in_flight -= 1

    async def stream_with_failover(
        self, session_id: str, group_id: str | None, payload: dict[str, Any],
        on_backend: Callable[[Backend], None] | None = None,
    ) -> AsyncGenerator[GenChunk, None]:
        """`generate_stream` through the pool. Fails over only until the first chunk arrived (nothing
        was sent on yet); a backend lost later (BackendUnavailable) is marked failed and the error
        propagates, for the caller to resubmit what it has elsewhere (`generation.generate`). Counts as in
        flight until the stream is closed; `on_backend` learns which backend serves it."""

        async def first(b: Backend) -> tuple[Backend, AsyncGenerator[GenChunk, None], GenChunk]:
            stream = b.client.generate_stream(payload)
            try:
                chunk = await anext(stream, None)
            except BaseException:
                await stream.aclose()
                raise
            if chunk is None:
                raise BackendUnavailable(f"{b.url}/generate: empty stream")
            return b, stream, chunk

        backend, stream, chunk = await self.run_with_failover(session_id, group_id, first)
        if on_backend is not None:
            on_backend(backend)
        backend.in_flight += 1
        try:
            yield chunk
            try:
                async for chunk in stream:
                    yield chunk
            except BackendUnavailable as e:
                self.mark_failed(backend, f"lost mid-stream: {e}")
                raise
        finally:
            backend.in_flight -= 1
            await stream.aclose()

    # -- health ------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="backend-health")

    async def stop(self) -> None:
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for backend in self._backends.values():
            backend.client.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_health()
            except Exception:  # recovery: the loop must outlive a bad round (e.g. a buggy on_recover)
                log.exception("backend health round failed")

    async def check_health(self) -> None:
        """One round: probe every backend (`SGLangClient.probe`: /ping while we have it paused, /health otherwise);
        fail the silent ones, resume those whose continue failed, admit the recovered ones."""
        backends = self.backends()
        results = await asyncio.gather(*(b.client.probe() for b in backends))
        back, resume = [], []
        for backend, ok in zip(backends, results, strict=True):
            if not ok:
                backend.health_misses += 1
                if backend.health_misses >= self.health_misses:
                    self.mark_failed(backend, f"{backend.health_misses} health checks failed in a row")
                continue
            backend.health_misses = 0
            if backend.client.resume_pending:  # a publish ended while it did not answer: resume it now
                resume.append(backend)
            elif not backend.healthy and not backend.client.paused and backend.id in self._backends:
                back.append(backend)
        await asyncio.gather(*(self._resume(b) for b in resume))
        await asyncio.gather(*(self._recover(b) for b in back))

    async def _resume(self, backend: Backend) -> None:
        try:
            await backend.client.continue_()
        except BackendError as e:  # recovery: the next round tries again
            backend.last_error = f"continue_generation: {e}"

    async def admit(self, backends: list[Backend]) -> None:
        """Admit these (new, unhealthy) backends now rather than at the next health round: each that answers
        /health is brought up by `on_recover` and put in rotation; the others are left to the health loop."""
        results = await asyncio.gather(*(b.client.probe() for b in backends))
        await asyncio.gather(*(self._recover(b) for b, ok in zip(backends, results, strict=True)
                               if ok and not b.healthy and not b.client.paused and b.id in self._backends))

    async def _recover(self, backend: Backend) -> None:
        if self._on_recover is not None:
            try:
                await self._on_recover(backend)
            except BackendError as e:  # recovery: stays out; the next round tries again
                backend.last_error = f"on_recover: {e}"
                return
        log.info("backend %s (%s) is back", backend.id, backend.url)
        self.mark_healthy(backend)

    # -- weight-update fan-out ---------------------------------------------------------------------

    async def pause_all(self, mode: PauseMode = "abort") -> dict[str, BackendError | None]:
        return await self._fan_out(lambda b: b.client.pause(mode))

    async def continue_all(self) -> dict[str, BackendError | None]:
        """Resume every backend we paused, in rotation or not: one taken out during the pause (a missed probe, a
        failed load) would otherwise stay paused, and the agents' calls parked on it hang."""
        return await self._fan_out(lambda b: b.client.continue_(), every_paused=True)

    async def update_all(self, model_path: str, version: str) -> dict[str, BackendError | None]:
        """Load weights on every healthy backend in parallel. A backend that failed keeps serving the
        old version: the caller decides (e.g. `mark_failed` it so `on_recover` resyncs it)."""

        async def update(b: Backend) -> None:
            await b.client.update_weights_from_disk(model_path, version)
            b.weight_version = version

        return await self._fan_out(update)

    async def _fan_out(self, fn: Callable[[Backend], Awaitable[None]],
                       every_paused: bool = False) -> dict[str, BackendError | None]:
        """fn on every healthy backend at once (and, with `every_paused`, on every one we paused); backend id -> its
        error, or None on success."""

        async def one(b: Backend) -> BackendError | None:
            try:
                await fn(b)
            except BackendError as e:  # recovery: reported per backend, the others go on
                return e
            return None

        targets = [b for b in self._backends.values() if b.healthy or (every_paused and b.client.paused)]
        results = await asyncio.gather(*(one(b) for b in targets))
        return {b.id: err for b, err in zip(targets, results, strict=True)}
