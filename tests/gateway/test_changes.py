"""gateway.changes: the long polls' wake-ups."""

from __future__ import annotations

import asyncio
import time

from gateway.changes import Changes


def test_wait_says_whether_it_was_woken_and_count_counts_notifications() -> None:
    async def main() -> None:
        changes = Changes(poll_s=0.2)
        t0 = time.monotonic()
        assert await changes.wait(10) is False  # nobody notified: the poll interval ends it
        assert 0.15 <= time.monotonic() - t0 < 2
        waiter = asyncio.ensure_future(changes.wait(10))
        await asyncio.sleep(0.01)
        changes.notify()
        assert await waiter is True
        first, second = asyncio.ensure_future(changes.wait(10)), asyncio.ensure_future(changes.wait(10))
        await asyncio.sleep(0.01)
        changes.notify_one()  # the oldest waiter only
        assert await first is True
        assert await second is False
        assert changes.count == 2

    asyncio.run(main())
