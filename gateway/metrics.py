"""Prometheus metrics of one gateway process (its own registry: no global state between apps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rollway_requests_total", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram(
            "rollway_request_seconds", "Request latency", ["route"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.tokens = Counter("rollway_tokens_total", "Tokens through the gateway", ["kind"], registry=r)
        self.turns = Counter("rollway_turns_total", "Stored turns by continuity", ["continuity"], registry=r)
        self.chain_breaks = Counter("rollway_chain_breaks_total", "New chains by reason", ["reason"], registry=r)
        self.disconnects = Counter("rollway_client_disconnects_total", "Turns cut short by the client", registry=r)
        self.backend_errors = Counter("rollway_backend_errors_total", "Backend failures", ["kind"], registry=r)
        self.resubmits = Counter("rollway_resubmits_total", "Resubmissions of stored replies after an abort (a publish) or a lost backend", registry=r)
        self.sessions = Gauge("rollway_sessions", "Sessions by state", ["state"], registry=r)
        self.groups = Gauge("rollway_groups", "Groups by state", ["state"], registry=r)
        self.weight_version = Gauge("rollway_weight_version", "Current weight version", registry=r)
        self.stale_dropped = Counter("rollway_groups_dropped_stale_total", "Groups dropped as stale", registry=r)
        self.admission_refused = Counter("rollway_admission_refused_total", "429s from staleness control", registry=r)
        self.eval_reward = Gauge(
            "rollway_eval_mean_reward", "Mean session reward of complete eval groups", ["version"], registry=r
        )
        self.eval_pass = Gauge(
            "rollway_eval_pass_at_k", "Share of eval groups with a rewarded session (k = group size)",
            ["version", "k"], registry=r,
        )
        self.eval_groups = Gauge("rollway_eval_groups", "Complete eval groups", ["version"], registry=r)
        self.publish_seconds = Histogram("rollway_weight_publish_seconds", "Weight publish time", registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: prometheus_client's `labels` takes a lock and builds its key on every
        call (~2 us, several times a call). As many entries as the metrics have label values (routes, statuses,
        reasons: a few dozen)."""
        key = (metric, *labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def turn_stored(
        self, *, continuity: str, prompt_tokens: int, completion_tokens: int, disconnected: bool,
        chain_reason: str | None, resubmits: int = 0,
    ) -> None:
        self.child(self.turns, continuity).inc()
        if resubmits:
            self.resubmits.inc(resubmits)
        if chain_reason and continuity != "extends":
            self.child(self.chain_breaks, chain_reason).inc()
        self.child(self.tokens, "prompt").inc(prompt_tokens)
        self.child(self.tokens, "completion").inc(completion_tokens)
        if disconnected:
            self.disconnects.inc()

    def set_counts(self, counts: dict[str, dict[str, int]]) -> None:
        for state, n in counts.get("groups", {}).items():
            self.groups.labels(state).set(n)
        for state, n in counts.get("sessions", {}).items():
            self.sessions.labels(state).set(n)

    def set_eval(self, summary: dict[str, dict[str, float]]) -> None:
        for version, s in summary.items():
            self.eval_reward.labels(version).set(s["mean_reward"])
            self.eval_pass.labels(version, str(int(s["k"]))).set(s["pass_at_k"])
            self.eval_groups.labels(version).set(s["groups"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """ASGI middleware: counts every HTTP request by route template and status, and times it (a stream to
    its last chunk). Routes are templates (`/v1/sessions/{session_id}`), so labels stay few. `find_metrics`
    gives the app's metrics for a request's scope (None while there are none)."""

    def __init__(self, app: Any, find_metrics: Callable[[Any], Metrics | None]) -> None:
        self.app = app
        self.find_metrics = find_metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics = self.find_metrics(scope)
            if metrics is not None:
                route = getattr(scope.get("route"), "path", "unmatched")
                metrics.child(metrics.requests, route, str(status)).inc()
                metrics.child(metrics.latency, route).observe(time.perf_counter() - t0)
