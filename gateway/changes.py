"""Wake-ups for the gateway's long-polls: a trainer waiting for complete groups (`POST /v1/batches` with
`wait_seconds`) and a runner waiting for room under the staleness budget (`POST /v1/groups` with
`wait_seconds`).

Every change those waits are for goes through a route of this process, which calls `notify()` on the channel
of that wait: `app.state.completions` when a group may have completed (a session rewarded or finished), which
lease long-polls wait on; `app.state.budget` when a group left the staleness budget or the budget grew (a group
dropped: abandoned or filtered; a version published), which group creations wait on. A wait re-checks the store
at once then, instead of at its next poll. Changes made through another gateway sharing the store are seen by the
periodic re-check alone (`poll_s`). Two channels, because an admission check is a count over the groups table:
woken by every reward (one per session), the waiting creations took a fifth of the gateway's CPU.

Measured on the demo's loop (benchmarks/loop.py, 2 cores): with a 0.25 s lease poll and a runner that slept the
429's `Retry-After: 1` s, the trainer waited ~0.6 s per step for groups the engine could have made in that time.
"""

from __future__ import annotations

import asyncio
import contextlib


class Changes:
    poll_s = 0.25
    """Longest sleep between two checks of a waiter (what other gateways' changes can take to be seen)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Something a waiter may be waiting for happened: every current waiter checks again now."""
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Until the next `notify()`, or `min(timeout, poll_s)` seconds."""
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, min(timeout, self.poll_s)))
