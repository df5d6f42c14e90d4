"""How long the gateway may spend on one server during a tensor-path publish or catch-up, shared by both ends so the
trainer's wait is derived from it (docs/scaling.md "Ways to publish").

On each server the gateway makes at most `n_buckets + 6` calls, each limited to `timeout_s + CALL_SLACK_S`: mark
"<v>-partial", begin the weight-update session (up to three calls: a session left open is ended and begun again),
one `/update_weights_from_tensor` per bucket, end the session, name the version. The gateway gives up on a server at
`server_deadline` (it may still be reading: it stays "<v>-partial", out of rotation, until a whole version is sent),
and answers only after every server's update ended or was given up on. The trainer waits longer than that for the
answer, and on any failure of that call asks the gateway whether the publish is over before its weights may change.
Standard library only: the gateway imports it."""

from __future__ import annotations

CALL_SLACK_S = 10.0
"""Added to the trainer's `timeout_s` for each call to a server (the gateway's `weight_call` limit)."""
CALLS_BEYOND_BUCKETS = 6
ANSWER_MARGIN_S = 60.0
"""What the gateway does besides the servers' updates (pause, abort, continue, the version's record)."""


def call_timeout(timeout_s: float) -> float:
    return timeout_s + CALL_SLACK_S


def server_deadline(timeout_s: float, n_buckets: int) -> float:
    """The most seconds the gateway spends on one server's update before it gives up on it."""
    return (max(1, n_buckets) + CALLS_BEYOND_BUCKETS) * call_timeout(timeout_s)


def answer_timeout(timeout_s: float, n_buckets: int) -> float:
    """How long the trainer waits for the gateway's answer: longer than `server_deadline` (the servers' updates run
    at once) plus the rest of the publish."""
    return server_deadline(timeout_s, n_buckets) + CALL_SLACK_S + ANSWER_MARGIN_S
