"""Publishing weights over torch process groups: the gateway coordinates, the trainer broadcasts (docs/http-api.md
"Weight sync over process groups"; the trainer's side is trainer/weight_sync.py; the routes are
gateway/routes/weight_sync.py).

    POST /v1/weights/sync/init {version, master_address, backend, timeout_s}
        -> {sync_id, groups: [{group_name, world_size, backend_id}]}     the publish lock is now held for the trainer
    POST /v1/weights/sync {sync_id, version, ports, buckets, batch_ids, results}
        pause the backends; on each, concurrently with the others and with the trainer's broadcasts:
        mark it "<v>-partial" (/update_weight_version), join its group (/init_weights_update_group), open a
        weight-update session (/begin_weight_update, SGLang 0.5.21+), one /update_weights_from_distributed per bucket
        (the version named on the last), close the session (/end_weight_update), leave the group; then continue
        the backends, record the version and ack the batches in one transaction.

Why one group per backend: a backend that dies mid-update breaks only its own group, so the others still finish and
serve the new version, and the agents see nothing. A backend that failed is never left serving a mix: it reports
"<v>-partial" until it has received a whole version, its queued requests are aborted (the gateway resubmits them
elsewhere), and it stays out of rotation until it is sent every bucket of the current version. With no shared disk
there is no folder to load it from, so such backends (and those added or restarted at run time) are listed in
`GET /v1/weights/sync` as `awaiting_backends`, and the trainer sends them the version it last published with a
**catch-up** (`catch_up: true` on init): the same steps on those backends alone, the others generating on, no new
version recorded and no batch acked. The next publish includes them too.

**The tensor path** (`backend: "tensor"`, trainer/tensor_sync.py): a trainer on the servers' machine sends, instead
of ports, one `/update_weights_from_tensor` payload per bucket and TP rank for each backend (`tensors`; SGLang's
serialized handles to the trainer's shared memory or CUDA IPC memory, a few hundred bytes each; `load_format` says
whether they are flattened buckets or named tensors, and is passed on to the servers as it is). The same steps
without a group: mark, begin, one `/update_weights_from_tensor` per bucket, end, name the version (its own call,
after the last read answered), each backend within `server_deadline` (rollway_common/sync_deadline.py): one given up
on may still be reading and stays "<v>-partial". The sync runs apart from the trainer's request and stays listed in
`GET /v1/weights/sync` until every backend's update ended or was given up on: the trainer changes the memory the
servers read only after that (docs/scaling.md "Ways to publish"). Such
handles open only on the machine that made them, so init refuses (400) a trainer whose `host_id` (its kernel's
boot id) is not this gateway's, and a backend whose URL is not an address of this host.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.errors import BadRequest, Conflict, ServiceUnavailable
from gateway.pool import Backend
from gateway.sglang import BackendError
from rollway_common.sync_deadline import call_timeout, server_deadline

log = logging.getLogger("rollway.gateway")
DISTRIBUTED = "distributed:"
"""`model_path` prefix of a version published over process groups: there is no folder to load it from."""


class AwaitingWeights(BackendError):
    """The current version came over process groups and this backend lacks it: a catch-up or the next publish sends
    it (listed in `awaiting_backends` meanwhile)."""


async def refuse_partial(backend: Backend) -> None:
    """AwaitingWeights when the server says it holds a half-received update ("<v>-partial"): at version 0 there is
    nothing to load into it, and its old version number must not let it back with a mix."""
    try:
        reported = str((await backend.client.model_info()).get("weight_version"))
    except BackendError:  # not answering is the health loop's business, as before this check
        return
    if reported.endswith("-partial"):
        raise AwaitingWeights(f"it holds part of an update ({reported}): it gets a whole version at the next publish")


@cache
def host_id() -> str:
    """This machine's kernel boot id (the same in every container on one host: what shared memory and CUDA IPC
    need); empty where the system has none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@cache
def _own_addresses() -> frozenset[str]:
    found: set[str] = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            found.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return frozenset(found)


async def is_local(url: str) -> bool:
    """Whether `url`'s host is this machine: a loopback address or one of this host's own addresses."""
    host = urlsplit(url).hostname or ""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in _own_addresses()
                                   for a in addresses)


async def check_same_machine(trainer_host_id: str | None, targets: list[Target]) -> None:
    """BadRequest unless the trainer and every target backend are on this gateway's machine (the tensor path)."""
    mine = host_id()
    if not trainer_host_id or not mine or trainer_host_id != mine:
        raise BadRequest(f"--weight-sync tensor needs the trainer on the servers' machine: the trainer's host_id "
                         f"{trainer_host_id or '(none)'} is not this gateway's ({mine or 'unknown'}); use "
                         "--weight-sync distributed or disk across machines", param="host_id")
    remote = [t.backend for t, ok in zip(targets, await asyncio.gather(*(is_local(t.backend.url) for t in targets)),
                                         strict=True) if not ok]
    if remote:
        raise BadRequest("--weight-sync tensor hands memory handles to servers on this machine only; not local: "
                         + ", ".join(f"{b.id} ({b.url})" for b in remote), param="backend")


@dataclass(eq=False)
class Target:
    backend: Backend
    group_name: str
    world_size: int
    stage: str = "planned"
    buckets_done: int = 0
    error: str | None = None

    def json(self) -> dict[str, Any]:
        return {"backend_id": self.backend.id, "group_name": self.group_name, "world_size": self.world_size,
                "stage": self.stage, "buckets_done": self.buckets_done, "error": self.error}


@dataclass(eq=False)
class Plan:
    sync_id: str
    version: int
    master_address: str
    backend: str
    timeout: float
    targets: list[Target]
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)
    released: bool = False
    catch_up: bool = False
    """The current version again, to the backends that lack it only: nothing recorded, the others untouched."""
    tensors: dict[str, list[list[str]]] = field(default_factory=dict, repr=False)
    """The tensor path: per group, per bucket, one serialized payload per TP rank."""
    load_format: str | None = "flattened_bucket"
    """The tensor path: what the payloads are (SGLang's `load_format`: flattened buckets, or None: named tensors)."""


class ProcessGroupSync:
    """One publish over process groups at a time, under the publisher's lock (held from init to the end of sync)."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher  # gateway.weights.Publisher (not imported: it imports this module)
        self.plan: Plan | None = None
        self.finished: dict[str, Any] | None = None
        """The last sync that ended: its sync_id and its answer or error (a trainer whose call failed asks)."""
        self._tasks: set[asyncio.Task[Any]] = set()

    async def init(self, version: int, master_address: str, backend: str, timeout: float,
                   catch_up: bool = False, host_id: str | None = None) -> dict[str, Any]:
        if not catch_up:
            await self.publisher.leases.check_publishable(version, [])
        lock = self.publisher._lock
        try:
            await asyncio.wait_for(lock.acquire(), timeout)
        except TimeoutError:
            raise ServiceUnavailable("another publish is in progress", retry_after=5) from None
        try:
            if catch_up:
                await self._check_current(version)  # under the lock: no publish can commit a newer one meanwhile
                targets = await self._awaiting(version, uuid.uuid4().hex[:8])
                if not targets:  # nothing to do: the lock goes back at once
                    lock.release()
                    return {"sync_id": None, "version": version, "catch_up": True, "groups": []}
            else:
                targets = await self._targets(version, uuid.uuid4().hex[:8])
                if not targets:
                    raise ServiceUnavailable("no backend answers /health: nothing to publish to", retry_after=10)
            if backend == "tensor":
                await check_same_machine(host_id, targets)
        except BaseException:
            if lock.locked():
                lock.release()
            raise
        plan = Plan(uuid.uuid4().hex, version, master_address, backend, timeout, targets, catch_up=catch_up)
        # A trainer that never sends its sync must not hold the lock for ever.
        plan.expiry = asyncio.get_running_loop().call_later(timeout + 30, self._release, plan)
        self.plan = plan
        return {"sync_id": plan.sync_id, "version": version, "catch_up": catch_up,
                "groups": [{"group_name": t.group_name, "world_size": t.world_size, "backend_id": t.backend.id}
                           for t in targets]}

    async def _targets(self, version: int, tag: str) -> list[Target]:
        """Every backend in rotation, and every one out of it that answers /health (it failed, or was added, or
        recovered without the current weights: a whole version brings it back). World size 1 + its TP ranks."""
        candidates = self.publisher.pool.backends()
        # Only those out of rotation are probed: one in rotation is chosen whatever a probe says (a dead one fails
        # its update and is taken out then), and SGLang's /health is a one-token generation, tens of ms a server.
        out = [b for b in candidates if not b.healthy]
        alive = dict(zip(out, await asyncio.gather(*(b.client.probe() for b in out)), strict=True))
        chosen = [b for b in candidates if b.healthy or alive.get(b, False)]
        return await self._sized(chosen, version, tag)

    async def _sized(self, chosen: list[Backend], version: int, tag: str) -> list[Target]:
        async def tp_size(b: Backend) -> int:
            try:
                return max(1, int((await b.client.server_info()).get("tp_size") or 1))
            except (BackendError, TypeError, ValueError):  # an older server: one rank
                return 1

        sizes = await asyncio.gather(*(tp_size(b) for b in chosen))
        return [Target(b, f"rollway-v{version}-{b.id}-{tag}", 1 + n) for b, n in zip(chosen, sizes, strict=True)]

    async def _check_current(self, version: int) -> None:
        current, path = await self.publisher.leases.current_weights()
        if version != current or path is None or not path.startswith(DISTRIBUTED):
            raise Conflict(f"a catch-up sends the current version, and version {version} is not it (the current is "
                           f"{current}, {path or 'the starting weights'}): only a version published over process "
                           "groups is caught up this way", param="version")

    def awaiting(self) -> list[Backend]:
        """Backends out of rotation that lack the current version (it came over process groups) and answered the
        health loop since their last failure (it lists them in `sync_backend`): what a catch-up would send it to.
        A dead one is not listed, so the trainer's catch-up does not keep the publish lock on its health check."""
        awaiting = self.publisher.awaiting
        return [b for b in self.publisher.pool.backends() if not b.healthy and b.id in awaiting]

    async def _awaiting(self, version: int, tag: str) -> list[Target]:
        candidates = self.awaiting()
        alive = await asyncio.gather(*(b.client.probe() for b in candidates))
        chosen = [b for b, ok in zip(candidates, alive, strict=True) if ok]
        return await self._sized(chosen, version, tag)

    def _release(self, plan: Plan) -> None:
        if not plan.released:
            plan.released = True
            if plan.expiry is not None:
                plan.expiry.cancel()
            if self.plan is plan:
                self.plan = None
            self.publisher._lock.release()

    async def sync(self, sync_id: str, version: int, ports: dict[str, int], buckets: list[dict[str, Any]],
                   batch_ids: list[str], results: dict[str, str | int],
                   tensors: dict[str, list[list[str]]] | None = None,
                   load_format: str | None = "flattened_bucket") -> dict[str, Any]:
        plan = self.plan
        if plan is None or plan.sync_id != sync_id or plan.released:
            raise Conflict(f"no pending weight sync {sync_id} (expired, or another one started)", param="sync_id")
        if plan.expiry is not None:
            plan.expiry.cancel()
        try:
            if version != plan.version:
                raise BadRequest(f"version {version} is not the planned {plan.version}", param="version")
            if plan.backend == "tensor":
                tensors = tensors or {}
                for t in plan.targets:
                    got = tensors.get(t.group_name)
                    if got is None or len(got) != len(buckets) or any(len(e) != t.world_size - 1 for e in got):
                        raise BadRequest(f"group {t.group_name} needs one payload per TP rank ({t.world_size - 1}) for "
                                         f"each of the {len(buckets)} buckets", param="tensors")
                ports = {t.group_name: 0 for t in plan.targets}
                plan.tensors = tensors
                plan.load_format = load_format
            missing = [t.group_name for t in plan.targets if t.group_name not in ports]
            if missing:
                raise BadRequest(f"no port for groups {missing}", param="ports")
            if plan.catch_up:
                if batch_ids or results:
                    raise BadRequest("a catch-up acks no batches: publish them with a new version", param="batch_ids")
                await self._check_current(version)
            else:
                await self.publisher.leases.check_publishable(version, batch_ids)
        except BaseException:
            self._release(plan)
            raise
        # The servers' updates run in a task of their own, not the request's: a trainer whose call timed out or whose
        # connection dropped does not cut them short, and the plan stays listed (`GET /v1/weights/sync`) until every
        # server's update has ended or been given up on. Only then may the trainer change what they read.
        work = self._run_catch_up(plan, ports, buckets) if plan.catch_up else self._run(plan, ports, buckets,
                                                                                       batch_ids, results)
        task = asyncio.ensure_future(self._drive(plan, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _drive(self, plan: Plan, work: Any) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = await work
            self.finished = {"sync_id": plan.sync_id, "version": plan.version, "catch_up": plan.catch_up,
                             "answer": answer}
            return answer
        except Exception as e:
            self.finished = {"sync_id": plan.sync_id, "version": plan.version, "catch_up": plan.catch_up,
                             "error": {"status": getattr(e, "status", 500), "message": str(e)}}
            raise
        finally:
            self._release(plan)

    async def _run(self, plan: Plan, ports: dict[str, int], buckets: list[dict[str, Any]], batch_ids: list[str],
                   results: dict[str, str | int]) -> dict[str, Any]:
        pool, version = self.publisher.pool, plan.version
        t0 = time.perf_counter()
        await _each(plan.targets, lambda t: t.backend.client.pause("abort"))
        await asyncio.gather(*(self._update_within(t, plan, ports[t.group_name], buckets) for t in plan.targets))
        failed = {t.backend.id: t.error or "" for t in plan.targets if t.error is not None}
        for t in plan.targets:
            if t.error is not None:  # its waiting requests come back aborted and are resubmitted elsewhere
                pool.mark_failed(t.backend, f"weight sync of version {version} failed: {t.error}")
                log.error("backend %s failed to take version %d: %s", t.backend.id, version, t.error)
        await _each([t for t in plan.targets if t.error is not None],
                    lambda t: t.backend.client.abort("", abort_all=True))
        await _each(plan.targets, lambda t: t.backend.client.continue_())
        ok = [t for t in plan.targets if t.error is None]
        if not ok:
            raise ServiceUnavailable(f"no backend took version {version}: {failed}", retry_after=10)
        model_path = f"{DISTRIBUTED}v{version}"
        await self.publisher.leases.publish(version, model_path, batch_ids, results, failed)
        for t in ok:
            t.backend.weight_version = str(version)
            self.publisher.awaiting.discard(t.backend.id)
            pool.mark_healthy(t.backend)  # one that was out of rotation is current again
        seconds = time.perf_counter() - t0
        self.publisher.metrics.publish_seconds.observe(seconds)
        self.publisher.metrics.weight_version.set(version)
        return {"version": version, "model_path": model_path, "seconds": round(seconds, 4),
                "failed_backends": failed, "backends": [t.backend.id for t in ok]}

    async def _run_catch_up(self, plan: Plan, ports: dict[str, int], buckets: list[dict[str, Any]]) -> dict[str, Any]:
        """The current version to backends out of rotation that lack it: the same steps on them alone (the backends
        in rotation keep generating), then each that took it comes back; nothing is recorded."""
        pool, version = self.publisher.pool, plan.version
        t0 = time.perf_counter()
        await _each(plan.targets, lambda t: t.backend.client.pause("abort"))
        await asyncio.gather(*(self._update_within(t, plan, ports[t.group_name], buckets) for t in plan.targets))
        await _each([t for t in plan.targets if t.error is not None],
                    lambda t: t.backend.client.abort("", abort_all=True))
        await _each(plan.targets, lambda t: t.backend.client.continue_())
        failed = {t.backend.id: t.error or "" for t in plan.targets if t.error is not None}
        ok = [t for t in plan.targets if t.error is None]
        for t in ok:
            if t.backend.id in {b.id for b in pool.backends()}:  # a DELETE may have taken it out meanwhile
                t.backend.weight_version = str(version)
                self.publisher.awaiting.discard(t.backend.id)
                pool.mark_healthy(t.backend)
                log.info("backend %s caught up to version %d over a process group", t.backend.id, version)
        for t in plan.targets:
            if t.error is not None:  # listed again once it answers a health probe (`sync_backend`), not before
                self.publisher.awaiting.discard(t.backend.id)
                log.error("backend %s failed to catch up to version %d: %s", t.backend.id, version, t.error)
        return {"version": version, "catch_up": True, "seconds": round(time.perf_counter() - t0, 4),
                "failed_backends": failed, "backends": [t.backend.id for t in ok]}

    async def _update_within(self, t: Target, plan: Plan, port: int, buckets: list[dict[str, Any]]) -> None:
        """One server's update; on the tensor path given up on at `server_deadline`. A server given up on may still
        be reading the trainer's memory, which the trainer changes once the gateway answers: it was marked
        "<v>-partial" before its first read and is named the version only by a call after its last read answered
        (`_update_from_tensor`), so it keeps saying "<v>-partial" (out of rotation, `awaiting_backends`) until a whole
        version is sent to it, whatever that read still does."""
        if plan.backend != "tensor":
            return await self._update(t, plan, port, buckets)
        deadline = server_deadline(plan.timeout, len(buckets))
        try:
            await asyncio.wait_for(self._update(t, plan, port, buckets), deadline)
        except TimeoutError:
            t.error = (f"{t.stage}: given up after {deadline:.0f} s (it may still be reading; it is sent a whole "
                       "version before it serves again)")

    async def _update(self, t: Target, plan: Plan, port: int, buckets: list[dict[str, Any]]) -> None:
        if plan.backend == "tensor":
            return await self._update_from_tensor(t, plan, buckets)
        client, timeout, joined, session = t.backend.client, plan.timeout + 10, False, False
        try:
            t.stage = "mark"  # until every bucket is in, the server says so in /model_info (survives our restart)
            await client.weight_call("/update_weight_version",
                                     {"new_version": f"{plan.version}-partial", "abort_all_requests": False}, timeout)
            t.stage = "init"
            await client.weight_call("/init_weights_update_group", {
                "master_address": plan.master_address, "master_port": port, "rank_offset": 1,
                "world_size": t.world_size, "group_name": t.group_name, "backend": plan.backend}, timeout)
            joined = True
            t.stage = "begin"  # SGLang 0.5.21+ refuses the buckets outside a weight-update session
            session = await client.weight_session_open(timeout)
            t.stage = "buckets"
            for i, bucket in enumerate(buckets):
                body = {**bucket, "group_name": t.group_name, "load_format": "flattened_bucket",
                        "flush_cache": i == len(buckets) - 1, "abort_all_requests": False}
                if i == len(buckets) - 1:
                    body["weight_version"] = str(plan.version)
                await client.weight_call("/update_weights_from_distributed", body, timeout)
                t.buckets_done = i + 1
            if session:
                t.stage, session = "end", False
                await client.weight_session_close(timeout)
            t.stage = "done"
        except BackendError as e:  # reported per backend; the others go on in their own groups
            t.error = f"{t.stage}: {e}"
        finally:
            if session:  # closed on failure too: a session left open refuses the next publish's begin
                try:
                    await client.weight_session_close(10.0)
                except BackendError as e:  # a dead server has no session left either
                    log.debug("ending the weight-update session on %s: %s", t.backend.id, e)
            if joined:
                try:
                    await client.weight_call("/destroy_weights_update_group", {"group_name": t.group_name}, 10.0)
                except BackendError as e:  # a dead server has nothing left to destroy
                    log.debug("destroying group %s: %s", t.group_name, e)

    async def _update_from_tensor(self, t: Target, plan: Plan, buckets: list[dict[str, Any]]) -> None:
        """The tensor path on one backend: mark, begin, one `/update_weights_from_tensor` per bucket, end, then name
        the version (`/update_weight_version`), and only then: not on the last bucket, whose call may be given up on
        while the server still reads, and must not leave it claiming a version it may hold a torn copy of."""
        client, timeout, session = t.backend.client, call_timeout(plan.timeout), False
        payloads = plan.tensors[t.group_name]
        try:
            t.stage = "mark"
            await client.weight_call("/update_weight_version",
                                     {"new_version": f"{plan.version}-partial", "abort_all_requests": False}, timeout)
            t.stage = "begin"
            session = await client.weight_session_open(timeout)
            t.stage = "buckets"
            for i, entries in enumerate(payloads):
                last = i == len(payloads) - 1
                body: dict[str, Any] = {"serialized_named_tensors": entries, "load_format": plan.load_format,
                                        "flush_cache": last, "abort_all_requests": False}
                await client.weight_call("/update_weights_from_tensor", body, timeout)
                t.buckets_done = i + 1
            if session:
                t.stage, session = "end", False
                await client.weight_session_close(timeout)
            t.stage = "version"  # every read has answered: the server holds the whole version
            await client.weight_call("/update_weight_version",
                                     {"new_version": str(plan.version), "abort_all_requests": False}, timeout)
            t.stage = "done"
        except BackendError as e:
            t.error = f"{t.stage}: {e}"
        finally:
            if session:
                try:
                    await client.weight_session_close(10.0)
                except BackendError as e:
                    log.debug("ending the weight-update session on %s: %s", t.backend.id, e)

    async def progress(self) -> dict[str, Any]:
        plan = self.plan
        current, path = await self.publisher.leases.current_weights()
        awaiting = [b.id for b in self.awaiting()] if path is not None and path.startswith(DISTRIBUTED) else []
        out: dict[str, Any] = {"version": current, "awaiting_backends": awaiting, "sync": None}
        if plan is not None:
            out["sync"] = {"sync_id": plan.sync_id, "version": plan.version, "backend": plan.backend,
                           "catch_up": plan.catch_up, "targets": [t.json() for t in plan.targets]}
        if self.finished is not None:  # the last sync that ended: a trainer whose call failed reads its answer here
            out["finished"] = self.finished
        return out


async def _each(targets: list[Target], fn: Any) -> None:
    """fn(target) on every target at once, best effort: a failure here is the update's to report, not this call's."""

    async def one(t: Target) -> None:
        try:
            await fn(t)
        except BackendError as e:
            log.warning("backend %s: %s", t.backend.id, e)

    await asyncio.gather(*(one(t) for t in targets))
