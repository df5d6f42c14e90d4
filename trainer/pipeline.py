"""Rank 0's gateway work, taken off the training thread: the next step's lease runs while this step trains,
and a publish runs while the next step trains.

    step k:   [ lease k+1 ............ ]                      (background: `prefetch`)
              [ train k ][ export k ]
                                    [ publish k ........... ]  (background: `publish`)
    step k+1:           [ train k+1 ][ export k+1 ]
                                                 ^ waits here for publish k: one publish in flight, in order

Measured on the demo's loop (benchmarks/loop.py, 2 cores): the trainer spent ~0.1-0.6 s of each step leasing
and ~0.05-0.25 s publishing, with the training thread idle; overlapped, its core trains back to back.

What does not move:
- A prefetched lease asks with `trainer_version` = the version the trainer will have when it trains that batch
  (this step's version + 1), so the gateway's staleness check (<= eta versions behind) holds for the version the
  batch is trained at. A batch that ends up trained at a lower version (an empty step in between) is only
  fresher than it was checked for.
- Groups are still acked inside the publish of a step whose update is in a durable checkpoint (the checkpoint
  is written before the publish is handed over), and the trainer waits for that publish before it goes on
  (`train.py`), as it did before: a trainer killed between a checkpoint and its publish would train that
  step's groups again after its restart (their leases expire unacked), so that window stays within the step.
  Only the publishes of the other steps (49 of 50 in the demo, `checkpoint_every` 50) overlap the next step.
- Versions are published in order: a publish waits for the one before it.
- No lease is prefetched past the last step of a run with `steps` set, so a run that ends normally holds
  nothing. A trainer stopped mid-run leaves its prefetched lease to expire, as it leaves the lease of a step it
  was training (the groups go back to the queue after `lease_seconds`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

log = logging.getLogger("trainer")

T = TypeVar("T")


class Timed(Generic[T]):
    """A background job's result and how long the job itself ran."""

    def __init__(self, value: T, seconds: float) -> None:
        self.value = value
        self.seconds = seconds


def _timed(fn: Callable[..., T], *args: Any) -> Timed[T]:
    t0 = time.perf_counter()
    value = fn(*args)
    return Timed(value, time.perf_counter() - t0)


class GatewayPipeline(Generic[T]):
    """`collect(version) -> batch` and `commit(held, version, path, durable) -> still held` run on two worker
    threads (one each: leases in order, publishes in order). Errors surface in the training thread at the next
    call that waits for that job."""

    def __init__(self, collect: Callable[[int], T], commit: Callable[..., dict[str, dict[str, int]]]) -> None:
        self._collect = collect
        self._commit = commit
        self._leaser = ThreadPoolExecutor(1, thread_name_prefix="lease")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._lease: tuple[int, Future[Timed[T]]] | None = None
        self._publish: Future[Timed[dict[str, dict[str, int]]]] | None = None
        self.last_publish_s = 0.0
        """How long the last finished publish took on its thread (the gateway's pause/load/continue/commit)."""

    def prefetch(self, version: int) -> None:
        """Start leasing the batch that will be trained at `version`."""
        if self._lease is None:
            self._lease = (version, self._leaser.submit(_timed, self._collect, version))

    def next_batch(self, version: int) -> tuple[T, float]:
        """The batch for `version` (prefetched, else leased now) and how long the caller waited for it."""
        t0 = time.perf_counter()
        if self._lease is None:
            self.prefetch(version)
        assert self._lease is not None
        _, future = self._lease
        self._lease = None
        batch = future.result().value
        return batch, time.perf_counter() - t0

    def publish(self, held: dict[str, dict[str, int]], version: int, path: Path | Any,
                durable: bool) -> tuple[dict[str, dict[str, int]], float]:
        """Hand the publish of `version` to the publish thread, after the previous one finished. Returns the
        leases still held once this publish is done (as `commit` decides: all of them acked when `durable`) and
        how long the caller waited for the previous publish."""
        waited = self.wait_publish()
        still_held = {} if durable and held else held
        self._publish = self._publisher.submit(_timed, self._commit, dict(held), version, path, durable)
        return still_held, waited

    def wait_publish(self) -> float:
        """Wait for the publish in flight (raising its error); returns the seconds waited."""
        t0 = time.perf_counter()
        if self._publish is not None:
            future, self._publish = self._publish, None
            self.last_publish_s = future.result().seconds
        return time.perf_counter() - t0

    def close(self) -> None:
        """After an error or a stop: let a publish in flight finish (a version the trainer already exported; its
        acks are durable) without raising, and drop a prefetched lease (it expires on the gateway)."""
        if self._publish is not None:
            try:
                self.wait_publish()
            except Exception as e:  # already unwinding from another error or a stop: report, don't mask it
                log.warning("the last publish failed while stopping: %s", e)
        if self._lease is not None:
            self._lease[1].cancel()
            self._lease = None
        self._leaser.shutdown(wait=False, cancel_futures=True)
        self._publisher.shutdown(wait=True)
