"""`rollway rollout`: replicate each task into a group of sessions, run the agent on each, post rewards.

An agent is a plain script defining `async def run(task: dict, client: AsyncOpenAI) -> float` (a sync
`def run(task, client: OpenAI)` also works: it runs in a thread, so it never blocks the event loop).
An agent exception abandons its session (logged with its traceback) and the run goes on; 429 from the
gateway's staleness control is honoured with its Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import json
import logging
import math
import os
import random
import secrets
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from rollway.keys import find_admin_key, missing_key_message

log = logging.getLogger("rollway.rollout")
CANCEL_ABANDON_S = 10.0
"""How long a cancelled run waits for each of its sessions' abandon."""
WAITING_SAY_S = 30.0
"""How often the runner says it is held by the gateway's staleness admission (429)."""


def _error_message(r: httpx.Response) -> str | None:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", required=True, metavar="FILE", help="script defining run(task, client) -> reward")
    p.add_argument("--tasks", required=True, metavar="FILE", help="JSONL (one task object per line) or JSON list")
    p.add_argument("--n-samples", type=int, default=4, help="sessions per task (the GRPO group size)")
    p.add_argument("--concurrency", type=int, default=16, help="sessions running at once")
    p.add_argument("--gateway", default=os.environ.get("ROLLWAY_GATEWAY", "http://127.0.0.1:8000"),
                   help="gateway base URL (env ROLLWAY_GATEWAY)")
    p.add_argument("--data-dir", default=os.environ.get("ROLLWAY_DATA_DIR", "rollway-data"),
                   help="where to find admin_key when ROLLWAY_ADMIN_KEY is unset (env ROLLWAY_DATA_DIR)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the task file (0 = until stopped)")
    p.add_argument("--shuffle", action="store_true", help="shuffle tasks each epoch")
    p.add_argument("--seed", type=int, default=0, help="seed of the task shuffle")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="take every N-th task starting at I (several runners share one task file)")
    p.add_argument("--eval-tasks", default=None, metavar="FILE", help="held-out tasks run as eval groups")
    p.add_argument("--eval-n-samples", type=int, default=1, help="sessions per eval task")
    p.add_argument("--eval-every", type=int, default=0, metavar="V",
                   help="run the eval tasks whenever the weight version reaches a multiple of V (0 = never)")
    p.add_argument("--eval-log", default="rollway-eval.jsonl", help="JSONL of eval results per version")


def load_agent(path: str | Path) -> Callable[..., Any]:
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"no agent file {path}")
    spec = importlib.util.spec_from_file_location(f"rollway_agent_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "run", None)
    if not callable(fn):
        raise SystemExit(f"{path} must define run(task, client) -> float")
    return fn


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        tasks = json.loads(text)
    else:
        tasks = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not tasks:
        raise SystemExit(f"{path} holds no tasks")
    return list(tasks)


@dataclass
class Stats:
    groups_done: int = 0
    sessions_done: int = 0
    sessions_failed: int = 0
    rewards: list[float] = field(default_factory=list)

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


POOL_CONNECTIONS = 32
"""Connections per HTTP pool of the runner. httpcore checks every connection of a pool for expiry on each
request and each response (an anyio attribute lookup apiece), so one pool for 200 concurrent sessions cost the
demo's runner ~20% of its CPU; the sessions are spread over pools of at most this many instead."""


KEEPALIVE_S = 2.0
"""The runner drops a connection idle this long: under uvicorn's keep-alive timeout (5 s), so it never sends on a
connection the server is closing (equal timeouts lost one group creation to a ReadError in a 60 s loop run)."""

ADMISSION_WAIT_S = 30.0
"""How long a group creation may wait on the gateway for room under the staleness budget before its 429 (then
the runner sleeps the Retry-After and asks again). Waiting there, it starts the moment a version is published;
polling on 429s, it started up to a Retry-After (1 s) later, which the trainer waited for."""


def _finite(value: Any) -> float:
    reward = float(value)
    if not math.isfinite(reward):  # the gateway refuses it: the session is abandoned as an agent error
        raise ValueError(f"the agent returned a reward that is not a finite number: {reward}")
    return reward


class Refused(RuntimeError):
    """The gateway answered a runner's call with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _sdk_platform() -> Any:
    """The OpenAI SDK's platform name, read once. An async client computes it on its first request, in a worker
    thread (a thread hop per client): with a client per session that was ~7% of the runner's CPU in the demo's
    loop (py-spy, benchmarks/loop.py). Each session's client gets the value the SDK would compute itself; with an
    SDK that no longer has the attribute, None (the client then reads it as before)."""
    try:
        from openai._base_client import get_platform
    except ImportError:
        return None
    return get_platform()


class Runner:
    """Runs groups against one gateway. Usable in-process (the demo) and from the CLI."""

    def __init__(self, gateway: str, admin_key: str, agent: Callable[..., Any], *, concurrency: int = 16,
                 client_timeout: float = 600.0) -> None:
        import openai

        self.gateway = gateway.rstrip("/")
        self.agent = agent
        self.is_async = inspect.iscoroutinefunction(agent)
        self.slots = asyncio.Semaphore(concurrency)
        self.client_timeout = client_timeout
        self.stats = Stats()
        n_pools = max(1, -(-concurrency // POOL_CONNECTIONS))
        limits = httpx.Limits(max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS,
                              keepalive_expiry=KEEPALIVE_S)
        # httpx's API on aiohttp's connection pool (httpx-aiohttp, the transport behind the SDK's own
        # DefaultAioHttpClient): httpx's pool checked every connection for expiry on each request and response.
        # Measured in the demo's loop (benchmarks/loop.py): the runner's CPU per session fell from ~3.7 ms.
        from httpx_aiohttp import HttpxAiohttpClient

        self._admin_pools = [
            HttpxAiohttpClient(base_url=self.gateway, timeout=60.0, limits=limits,
                               headers={"Authorization": f"Bearer {admin_key}"})
            for _ in range(n_pools)
        ]
        # The SDK's own client class, with the SDK's defaults but for the pool size. Its HTTP package is httpx
        # or, in newer SDKs, httpx2 (same API): its Limits come from whichever it is built on.
        http_pkg = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])
        sdk_limits = http_pkg.Limits(max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS,
                                     keepalive_expiry=KEEPALIVE_S)
        self._agent_pools = [openai.DefaultAioHttpClient(timeout=client_timeout, limits=sdk_limits)
                             for _ in range(n_pools)]
        self._next_pool = 0
        self._waiting_said = -WAITING_SAY_S
        self._platform = _sdk_platform()

    async def close(self) -> None:
        for client in self._admin_pools:
            await client.aclose()
        for agent_client in self._agent_pools:
            await agent_client.aclose()

    def _pool_index(self) -> int:
        self._next_pool = (self._next_pool + 1) % len(self._agent_pools)
        return self._next_pool

    async def _post(self, path: str, body: dict[str, Any], pool: int = 0,
                    headers: dict[str, str] | None = None) -> dict[str, Any]:
        failures = 0
        while True:
            try:
                r = await self._admin_pools[pool].post(path, json=body, headers=headers)
            except httpx.TransportError as e:
                # A dropped connection: reward/finish/abandon are idempotent, and a group creation carries an
                # Idempotency-Key (a retry gets the group the first try created, if it did): retry a few times.
                failures += 1
                if failures > 5:
                    raise RuntimeError(f"POST {path}: gateway unreachable ({e!r})") from e
                await asyncio.sleep(0.5 * failures)
                continue
            if r.status_code == 429:  # staleness control: wait as told
                now = time.monotonic()
                if now - self._waiting_said >= WAITING_SAY_S:  # else a run held by a stopped trainer said nothing
                    self._waiting_said = now
                    log.warning("waiting for the trainer: the gateway admits no new group (%s); a running "
                                "`rollway train` makes room with each version it publishes",
                                _error_message(r) or f"HTTP {r.status_code}")
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status_code >= 400:
                raise Refused(r.status_code, f"POST {path} -> {r.status_code}: {r.text[:500]}")
            return r.json() if r.content else {}

    async def run_group(self, task: dict[str, Any], n_samples: int, *, eval_group: bool = False,
                        sampling: dict[str, Any] | None = None,
                        metadata: dict[str, Any] | None = None) -> list[float | None]:
        """Create a group, run every session; returns each session's reward (None = failed)."""
        body: dict[str, Any] = {"task": task, "n_samples": n_samples, "eval": eval_group}
        if not eval_group:  # the gateway holds the creation until the staleness budget has room (vs 429 + sleep)
            body["wait_seconds"] = ADMISSION_WAIT_S
        if sampling:
            body["sampling"] = sampling
        if metadata:
            body["metadata"] = metadata
        group = await self._post("/v1/groups", body, headers={"Idempotency-Key": secrets.token_hex(16)})
        pool = self._pool_index()
        outcomes = await asyncio.gather(*(self._run_session(task, s) for s in group["sessions"]),
                                        return_exceptions=True)
        rewards = [r if isinstance(r, float) else None for r in outcomes]
        # One request rewards and finishes every session that ran (a failed one was abandoned): the group is
        # trainable only once all of its sessions are done anyway. A request per session was ~12% of the
        # runner's CPU and as large a share of the gateway's requests (benchmarks/loop.py).
        done = [(s["session_id"], r) for s, r in zip(group["sessions"], rewards, strict=True) if r is not None]
        if done:
            await self._reward_group(group["group_id"], done, pool)
        self.stats.groups_done += 1
        for r in outcomes:
            if isinstance(r, BaseException):  # e.g. an abandon the gateway could not take: the rest is stored
                raise r
        return rewards

    async def _reward_group(self, group_id: str, done: list[tuple[str, float]], pool: int) -> None:
        body = {"rewards": [{"session_id": sid, "reward": r} for sid, r in done], "finish": True}
        try:
            await self._post(f"/v1/groups/{group_id}/rewards", body, pool)
        except Refused as e:
            if e.status != 409:
                raise
            # One session refused (abandoned meanwhile, e.g. by the idle sweeper while a sibling ran long) and
            # the request stored nothing: each session on its own, so only that one is lost.
            log.warning("group %s: %s; rewarding its sessions one by one", group_id, e)
            kept: list[tuple[str, float]] = []
            for sid, r in done:
                try:
                    await self._post(f"/v1/sessions/{sid}/reward", {"reward": r, "finish": True}, pool)
                    kept.append((sid, r))
                except Refused as one:
                    log.warning("session %s: %s", sid, one)
            done = kept
        self.stats.sessions_done += len(done)
        self.stats.rewards.extend(r for _, r in done)

    async def _run_session(self, task: dict[str, Any], cred: dict[str, Any]) -> float | None:
        try:
            return await self._run_session_now(task, cred)
        except asyncio.CancelledError:
            # The run is ending (the demo's deadline, Ctrl-C): the session is abandoned, not left active with
            # whatever it did, its group open for good. Best effort, and bounded: the gateway may be going too.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._post(f"/v1/sessions/{cred['session_id']}/abandon",
                                                  {"reason": "run_cancelled"}), CANCEL_ABANDON_S)
            raise

    async def _run_session_now(self, task: dict[str, Any], cred: dict[str, Any]) -> float | None:
        import openai

        sid = cred["session_id"]
        async with self.slots:
            pool = self._pool_index()
            try:
                if self.is_async:
                    # The session's client borrows one of the runner's shared pools (a pool per session costs
                    # a new connection per agent); the client is not closed here for that reason.
                    client = openai.AsyncOpenAI(base_url=cred["base_url"], api_key=cred["api_key"],
                                                timeout=self.client_timeout, max_retries=2,
                                                http_client=self._agent_pools[pool])
                    if self._platform is not None and getattr(client, "_platform", 0) is None:
                        client._platform = self._platform
                    reward = _finite(await self.agent(task, client))
                else:
                    sync_client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"],
                                                timeout=self.client_timeout, max_retries=2)
                    try:
                        reward = _finite(await asyncio.to_thread(self.agent, task, sync_client))
                    finally:
                        sync_client.close()
            except Exception as e:  # an agent's bug must not stop the run: abandon, log, go on
                log.warning("agent failed on session %s:\n%s", sid, traceback.format_exc())
                self.stats.sessions_failed += 1
                await self._post(f"/v1/sessions/{sid}/abandon", {"reason": f"agent_error: {type(e).__name__}"[:120]},
                                 pool)
                return None
            return reward

    async def weight_version(self) -> int:
        r = await self._admin_pools[0].get("/v1/weights")
        r.raise_for_status()
        return int(r.json().get("version", 0))


def shard(tasks: list[dict[str, Any]], spec: str) -> list[dict[str, Any]]:
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--shard wants I/N, got {spec!r}") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard {spec}: I must be in [0, N)")
    return tasks[i::n]


def task_stream(tasks: list[dict[str, Any]], epochs: int, shuffle: bool, seed: int) -> Iterable[dict[str, Any]]:
    rng = random.Random(seed)
    epoch = 0
    while epochs == 0 or epoch < epochs:
        order = list(tasks)
        if shuffle:
            rng.shuffle(order)
        yield from order
        epoch += 1


async def run_eval(runner: Runner, tasks: list[dict[str, Any]], k: int, version: int) -> dict[str, Any]:
    """Held-out tasks as eval groups: greedy when k == 1, else sampled; mean reward and pass@k. The groups carry
    `{"eval_version": version}`, so the gateway's /metrics reports the same figures per version."""
    sampling = {"temperature": 0.0 if k == 1 else 1.0}
    meta = {"eval_version": version}
    results = await asyncio.gather(
        *(runner.run_group(t, k, eval_group=True, sampling=sampling, metadata=meta) for t in tasks)
    )
    flat = [r for rs in results for r in rs if r is not None]
    passed = [any((r or 0) > 0 for r in rs) for rs in results]
    return {"version": version, "eval_mean_reward": sum(flat) / max(1, len(flat)),
            f"pass@{k}": sum(passed) / max(1, len(passed)), "n_tasks": len(tasks), "time": time.time()}


async def rollout(args: argparse.Namespace, admin_key: str) -> Stats:
    agent = load_agent(args.agent)
    tasks = shard(load_tasks(args.tasks), args.shard)
    eval_tasks = load_tasks(args.eval_tasks) if args.eval_tasks else []
    runner = Runner(args.gateway, admin_key, agent, concurrency=args.concurrency)
    total = len(tasks) * args.epochs if args.epochs else None
    bar = tqdm(total=total, unit="group", desc="rollout")
    in_flight: set[asyncio.Future[Any]] = set()
    max_groups_ahead = max(1, args.concurrency // max(1, args.n_samples)) + 1
    last_eval = -1
    try:
        for task in task_stream(tasks, args.epochs, args.shuffle, args.seed):
            while len(in_flight) >= max_groups_ahead:
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    d.result()
                    bar.update(1)
                s = runner.stats
                bar.set_postfix(failed=s.sessions_failed, reward=f"{s.mean_reward:.3f}")
            if eval_tasks and args.eval_every > 0:
                v = await runner.weight_version()
                if v % args.eval_every == 0 and v != last_eval:
                    last_eval = v
                    res = await run_eval(runner, eval_tasks, args.eval_n_samples, v)
                    await asyncio.to_thread(append_line, args.eval_log, json.dumps(res))
                    tqdm.write(f"eval at version {v}: {res}")
            in_flight.add(asyncio.ensure_future(runner.run_group(task, args.n_samples)))
        for d in asyncio.as_completed(in_flight):
            await d
            bar.update(1)
    finally:
        bar.close()
        await runner.close()
    return runner.stats


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a dependency except on Windows), else None: asyncio's default.
    The runner's CPU per session is mostly the agent's SDK, and some of it the event loop's own work
    (benchmarks/runner.py compares the two)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_async(coro: Any) -> Any:
    """`asyncio.run(coro)` on `event_loop_factory()`'s loop: how the runner's commands (`rollway rollout`, the demo)
    run their agents."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(coro)


def main(args: argparse.Namespace) -> int:
    key = find_admin_key(args.data_dir)
    if not key:
        raise SystemExit(missing_key_message(args.data_dir))
    stats = run_async(rollout(args, key))
    print(json.dumps({"groups": stats.groups_done, "sessions": stats.sessions_done,
                      "sessions_failed": stats.sessions_failed, "mean_reward": round(stats.mean_reward, 4)}))
    return 0


def append_line(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")

