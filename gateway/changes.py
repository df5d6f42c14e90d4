"""Wake-ups for the gateway's long-polls: a trainer waiting for complete groups (`POST /v1/batches` with
`wait_seconds`) and a runner waiting for room under the staleness budget (`POST /v1/groups` with
`wait_seconds`).

Two channels, on `Serving` (gateway/services.py):
- `completions`: a group completed (the store's `on_group_end`). Every waiting lease looks again (`notify`).
- `budget`: room may have opened under the staleness budget (a version published, a group dropped: filtered,
  abandoned, too few sessions). One waiting creation at a time looks (`notify_one`, oldest first); one that gets
  in passes the wake-up on, one that finds no room keeps it. Woken all at once, a few dozen waiting creations,
  each checking admission (then a count over the groups table), took a fifth of the gateway's CPU (py-spy on
  benchmarks/loop.py).
A wake-up saves the wait for the next poll; changes made through another gateway sharing the store are seen by
the periodic re-check alone (`poll_s`).

Measured on the demo's loop (benchmarks/loop.py, 2 cores): with a 0.25 s lease poll and a runner that slept the
429's `Retry-After: 1` s, the trainer waited ~0.6 s per step for groups the engine could have made in that time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Changes:
    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        """Longest sleep between two checks of a waiter (what other gateways' changes can take to be seen)."""
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.count = 0
        """Notifications so far (`notify` and `notify_one`): a waiter that needs k more changes before a check can
        succeed compares it with the count it saw, and skips the checks in between."""

    def notify(self) -> None:
        """Every current waiter checks again now."""
        self.count += 1
        while self._waiters:
            self._wake_one()

    def notify_one(self) -> None:
        """The oldest current waiter checks again now."""
        self.count += 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait(self, timeout: float) -> bool:
        """Until woken (True), or `min(timeout, poll_s)` seconds (False)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, min(timeout, self.poll_s)))
            return True
        except TimeoutError:
            return False
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
