"""The viewer's sign-in limits: how long a sign-in lasts and how many failed ones a client address may make
(`SignInLimiter`, one per process on `Services`). The routes that use them are gateway/routes/ui_sign_in.py."""

from __future__ import annotations

import collections
import time

from gateway.errors import TooManyRequests

SESSION_TTL_S = 12 * 3600.0
"""How long a sign-in lasts (override per app: `Services.ui_session_ttl_s`)."""
MAX_FAILURES, FAILURE_WINDOW_S = 10, 60.0
"""Failed sign-ins one client address may make in the window before its wrong keys get 429s until the window
passes. A right key still signs in: on a shared machine every local user is 127.0.0.1, and ten wrong keys must
not lock the admin out. (Guessing is not what this stops: keys are 256-bit random, and the API checks bearer
keys unthrottled anyway; it keeps a flood of failures out of the log and shows a client it is failing.)"""


class SignInLimiter:
    """Failed sign-ins per client address in a sliding window (in memory, per process)."""

    def __init__(self, max_failures: int = MAX_FAILURES, window_s: float = FAILURE_WINDOW_S) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._failures: dict[str, collections.deque[float]] = {}

    def _recent(self, client: str) -> collections.deque[float]:
        q = self._failures.setdefault(client, collections.deque())
        cutoff = time.monotonic() - self.window_s
        while q and q[0] < cutoff:
            q.popleft()
        return q

    def check(self, client: str) -> None:
        q = self._recent(client)
        if len(q) >= self.max_failures:
            raise TooManyRequests(f"too many failed sign-ins from {client}; wait and retry",
                                  code="sign_in_rate_limited", retry_after=q[0] + self.window_s - time.monotonic())

    def failed(self, client: str) -> int:
        if len(self._failures) > 10_000:  # a flood of addresses: forget the old ones rather than grow
            self._failures.clear()
        q = self._recent(client)
        q.append(time.monotonic())
        return len(q)
