"""Prometheus metrics of one gateway process (its own registry: no global state between apps)."""

from __future__ import annotations

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
        self.resubmits = Counter("rollway_resubmits_total", "Generations resubmitted after an abort", registry=r)
        self.sessions = Gauge("rollway_sessions", "Sessions by state", ["state"], registry=r)
        self.groups = Gauge("rollway_groups", "Groups by state", ["state"], registry=r)
        self.weight_version = Gauge("rollway_weight_version", "Current weight version", registry=r)
        self.stale_dropped = Counter("rollway_groups_dropped_stale_total", "Groups dropped as stale", registry=r)
        self.admission_refused = Counter("rollway_admission_refused_total", "429s from staleness control", registry=r)
        self.publish_seconds = Histogram("rollway_weight_publish_seconds", "Weight publish time", registry=r)

    def turn_stored(
        self, *, continuity: str, prompt_tokens: int, completion_tokens: int, disconnected: bool,
        chain_reason: str | None,
    ) -> None:
        self.turns.labels(continuity).inc()
        if chain_reason and continuity != "extends":
            self.chain_breaks.labels(chain_reason).inc()
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("completion").inc(completion_tokens)
        if disconnected:
            self.disconnects.inc()

    def set_counts(self, counts: dict[str, dict[str, int]]) -> None:
        for state, n in counts.get("groups", {}).items():
            self.groups.labels(state).set(n)
        for state, n in counts.get("sessions", {}).items():
            self.sessions.labels(state).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
