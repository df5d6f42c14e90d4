"""The trainer's side of the gateway: a small synchronous httpx client, and the lease records it returns.

    GatewayClientError            any failure talking to the gateway
    ├── GatewayUnreachable        connection refused / timed out: the message names the URL
    └── GatewayHTTPError          the gateway answered 4xx/5xx: status, type, code and its message

Arrays arrive in the compact wire form and are decoded here with `rollway_common.wire.decode_array` (the trainer
imports nothing from the gateway: it reaches it only over HTTP), so the rest of the trainer sees plain lists
(`Sample`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollway_common.wire import LEASE_FORMAT, decode_array

log = logging.getLogger(__name__)


class GatewayClientError(RuntimeError):
    pass


class GatewayUnreachable(GatewayClientError):
    pass


class GatewayHTTPError(GatewayClientError):
    def __init__(self, method: str, url: str, status: int, body: Any) -> None:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        self.status = status
        self.type = str(err.get("type") or "")
        self.code = err.get("code")
        self.message = str(err.get("message") or body)
        super().__init__(f"{method} {url} -> {status} {self.type or ''}: {self.message}")


@dataclass
class Sample:
    """One sequence of a session (docs/architecture.md "Leases and training samples"); all arrays have the
    same length."""

    group_id: str
    session_id: str
    reward: float | None
    temperature: float | list[float]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    returns: list[float] | None = None
    """Per token, from a lease of format 1 (the gateway's returns); None in format 2, whose turns give them."""
    turn_ends: list[int] | None = None
    """Format 2: per turn of the chain, the index after its last token (increasing, the last = the length)."""
    completion_starts: list[int] | None = None
    """Format 2: per turn, the index of its completion's first token."""
    turn_rewards: list[float | None] | None = None
    """Format 2: per turn, its own reward or None (trainer/advantages.py `chain_returns`)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        arrays: list[list[Any]] = [self.loss_mask, self.logprobs, self.versions]
        if self.returns is not None:
            arrays.append(self.returns)
        if isinstance(self.temperature, list):
            arrays.append(self.temperature)
        if any(len(a) != n for a in arrays):
            raise ValueError(f"sample of session {self.session_id}: arrays differ in length")
        # Refused, never trained on: one inf return or reward makes every advantage of its group NaN. The
        # gateway refuses rewards beyond 1e6, so only a broken or foreign gateway can send these.
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"sample of session {self.session_id}: non-finite reward {self.reward}")
        if self.returns is not None and not all(map(math.isfinite, self.returns)):
            raise ValueError(f"sample of session {self.session_id}: non-finite values in returns")
        if self.returns is None:
            self._check_turns(n)

    def _check_turns(self, n: int) -> None:
        ends, starts, rewards = self.turn_ends, self.completion_starts, self.turn_rewards
        if ends is None or rewards is None:
            raise ValueError(f"sample of session {self.session_id}: neither returns nor turn_ends and turn_rewards")
        if len(rewards) != len(ends) or (starts is not None and len(starts) != len(ends)):
            raise ValueError(f"sample of session {self.session_id}: turn arrays differ in length")
        if (ends and ends[-1] != n) or any(b < a for a, b in zip([0, *ends], ends, strict=False)):
            raise ValueError(f"sample of session {self.session_id}: turn_ends must not fall and end at the sample's length {n}")
        if starts is not None and any(not a <= c <= b for a, c, b in zip([0, *ends], starts, ends, strict=False)):
            raise ValueError(f"sample of session {self.session_id}: a completion_start lies outside its turn")
        if not all(r is None or math.isfinite(r) for r in rewards):
            raise ValueError(f"sample of session {self.session_id}: non-finite values in turn_rewards")

    @property
    def n_loss_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m)


@dataclass
class SessionInfo:
    session_id: str
    reward: float | None
    state: str


@dataclass
class Group:
    group_id: str
    task: Any
    sessions: list[SessionInfo]
    samples: list[Sample]

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@dataclass
class Lease:
    batch_id: str
    expires_at: Any
    groups: list[Group] = field(default_factory=list)
    dropped_stale: int = 0
    lease_format: int = 1
    """2: the samples carry their turns and the trainer computes returns; 1: a gateway older than format 2
    sent per-token returns, discounted with its own gamma."""
    gateway_gamma: float | None = None
    """The gateway's deprecated gamma, sent (format 2) only where it was set: used when the trainer has none."""


def _array(obj: Any) -> list[Any]:
    """A wire array, or a plain JSON list (the readable form of GET /v1/sessions)."""
    return list(obj) if isinstance(obj, list) else decode_array(obj)


def parse_sample(d: dict[str, Any]) -> Sample:
    temp = d.get("temperature", 1.0)
    temperature: float | list[float] = float(temp) if isinstance(temp, int | float) else _array(temp)
    reward = d.get("reward")
    return Sample(
        group_id=str(d["group_id"]),
        session_id=str(d["session_id"]),
        reward=None if reward is None else float(reward),
        temperature=temperature,
        token_ids=_array(d["token_ids"]),
        loss_mask=_array(d["loss_mask"]),
        logprobs=_array(d["logprobs"]),
        versions=_array(d["versions"]),
        returns=_array(d["returns"]) if "returns" in d else None,
        turn_ends=_array(d["turn_ends"]) if "turn_ends" in d else None,
        completion_starts=_array(d["completion_starts"]) if "completion_starts" in d else None,
        turn_rewards=_rewards(d["turn_rewards"]) if "turn_rewards" in d else None,
    )


def _rewards(raw: Any) -> list[float | None]:
    if not isinstance(raw, list):
        raise ValueError(f"turn_rewards must be a list of numbers or nulls, got {type(raw).__name__}")
    return [None if r is None else float(r) for r in raw]


def parse_group(d: dict[str, Any]) -> Group:
    sessions = [
        SessionInfo(
            str(s["session_id"]),
            None if s.get("reward") is None else float(s["reward"]),
            str(s.get("state", "")),
        )
        for s in d.get("sessions", [])
    ]
    for info in sessions:
        if info.reward is not None and not math.isfinite(info.reward):
            raise ValueError(f"group {d['group_id']}: session {info.session_id} has a non-finite reward")
    return Group(str(d["group_id"]), d.get("task"), sessions, [parse_sample(s) for s in d.get("samples", [])])


class GatewayClient:
    """Admin-key client for the trainer's endpoints. Thread-safe (httpx.Client is), so the lease renewer
    shares it with the training loop."""

    def __init__(
        self,
        base_url: str,
        admin_key: str = "",
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.lease_format = LEASE_FORMAT
        """What `lease` asks for; 1 once a gateway older than format 2 refused the field."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, *, json: Any = None, params: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        try:
            r = self._http.request(
                method, path, json=json, params=params, timeout=self.timeout if timeout is None else timeout
            )
        except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError) as e:
            raise GatewayUnreachable(
                f"gateway {self.base_url} unreachable ({method} {path}: {type(e).__name__}: {e}); "
                "is `rollway serve` running at that URL?"
            ) from e
        if r.status_code >= 400:
            try:
                body: Any = r.json()
            except ValueError:
                body = r.text
            raise GatewayHTTPError(method, path, r.status_code, body)
        return r

    # --- leases ---
    def lease(
        self,
        *,
        max_groups: int,
        min_groups: int = 1,
        lease_seconds: float,
        wait_seconds: float,
        groups_per_step: int,
        max_head_offpolicyness: int,
        trainer_version: int,
        train_constrained_turns: bool = False,
    ) -> Lease | None:
        """`POST /v1/batches`; None on 204. A Lease with no groups (only `dropped_stale`) holds nothing."""
        body = {
            "max_groups": max_groups,
            **({"min_groups": min_groups} if min_groups > 1 else {}),
            "lease_seconds": lease_seconds,
            "wait_seconds": wait_seconds,
            "groups_per_step": groups_per_step,
            "max_head_offpolicyness": max_head_offpolicyness,
            "trainer_version": trainer_version,
            # Only when set: a gateway without the option refuses the unknown field.
            **({"train_constrained_turns": True} if train_constrained_turns else {}),
        }
        if self.lease_format != 1:
            body["lease_format"] = self.lease_format
        try:
            r = self._request("POST", "/v1/batches", json=body, timeout=self.timeout + wait_seconds)
        except GatewayHTTPError as e:
            if "lease_format" not in body or e.status != 400 or "lease_format" not in e.message:
                raise
            # A gateway older than format 2 refuses the unknown field before leasing anything: ask again for
            # format 1, whose returns it discounts with its own gamma (the trainer's gamma does not apply).
            log.warning("gateway %s speaks lease format 1 only: returns come discounted with its gamma (this "
                        "trainer's gamma does not apply); upgrade the gateway", self.base_url)
            self.lease_format = 1
            del body["lease_format"]
            r = self._request("POST", "/v1/batches", json=body, timeout=self.timeout + wait_seconds)
        if r.status_code == 204 or not r.content:
            return None
        d = r.json()
        groups = [parse_group(g) for g in d.get("groups") or []]
        gamma = d.get("gamma")
        return Lease(
            str(d.get("batch_id") or ""), d.get("expires_at"), groups, int(d.get("dropped_stale") or 0),
            int(d.get("lease_format") or 1), None if gamma is None else float(gamma),
        )

    def renew(self, batch_id: str, lease_seconds: float) -> None:
        self._request("POST", f"/v1/batches/{batch_id}/renew", json={"lease_seconds": lease_seconds})

    def ack(self, batch_id: str, results: Mapping[str, str | int]) -> None:
        """Close the named groups of a batch without publishing ("filtered", or "trained" for a batch whose
        update is in a checkpoint but that is not the one carried by the publish)."""
        self._request("POST", f"/v1/batches/{batch_id}/ack", json={"results": dict(results)})

    # --- weights ---
    def current_weights(self) -> tuple[int, str | None]:
        """`GET /v1/weights` -> (version, model_path or None)."""
        d = self._request("GET", "/v1/weights").json()
        return int(d.get("version", 0)), d.get("model_path") or None

    def publish(
        self, version: int, model_path: str, batch_ids: list[str] | str | None, results: dict[str, str | int]
    ) -> int:
        """`POST /v1/weights`: the gateway loads the weights and acks the batches in one transaction.
        Raises GatewayHTTPError with status 409 when `version` is not above the gateway's."""
        ids = [batch_ids] if isinstance(batch_ids, str) else list(batch_ids or [])
        body = {"version": version, "model_path": model_path, "batch_ids": ids, "results": results}
        return int(
            self._request("POST", "/v1/weights", json=body, timeout=max(self.timeout, 600.0))
            .json()
            .get("version", version)
        )

    # --- step reports (the viewer's figures) ---
    def report_step(self, report: dict[str, Any]) -> None:
        """`POST /v1/training/steps`: a step's figures and trained sessions (a retry of a version replaces it)."""
        self._request("POST", "/v1/training/steps", json=report)

    def sync_init(self, version: int, master_address: str, backend: str, timeout_s: float,
                  catch_up: bool = False, host_id: str | None = None) -> dict[str, Any]:
        """`POST /v1/weights/sync/init`: the gateway picks the backends of a process-group publish, one group each
        (`{sync_id, groups: [{group_name, world_size, backend_id}]}`; trainer/weight_sync.py). `catch_up`: the
        current version again, to the backends that lack it only (no groups: none does)."""
        body: dict[str, Any] = {"version": version, "master_address": master_address, "backend": backend,
                                "timeout_s": timeout_s, "catch_up": catch_up}
        if host_id is not None and backend == "tensor":  # the tensor path: the gateway checks it is this machine
            body["host_id"] = host_id
        return dict(self._request("POST", "/v1/weights/sync/init", json=body).json())

    def sync_status(self) -> dict[str, Any]:
        """`GET /v1/weights/sync`: `{version, awaiting_backends, sync}`."""
        return dict(self._request("GET", "/v1/weights/sync").json())

    def sync(self, sync_id: str, version: int, ports: dict[str, int], buckets: list[dict[str, Any]],
             batch_ids: list[str], results: dict[str, str | int], timeout: float,
             tensors: dict[str, list[list[str]]] | None = None,
             load_format: str | None = "flattened_bucket") -> dict[str, Any]:
        """`POST /v1/weights/sync`: answered once every backend received the buckets (or failed), the version is
        published and the batches acked; the caller broadcasts meanwhile. The tensor path: `load_format` None when
        the entries are named tensors rather than flattened buckets."""
        body: dict[str, Any] = {"sync_id": sync_id, "version": version, "ports": ports, "buckets": buckets,
                                "batch_ids": batch_ids, "results": results}
        if tensors:  # the tensor path: per group, per bucket, one payload per TP rank
            body["tensors"] = tensors
            body["load_format"] = load_format
        return dict(self._request("POST", "/v1/weights/sync", json=body, timeout=max(self.timeout, timeout)).json())

    def memory(self, action: str, tags: list[str] | None) -> dict[str, Any]:
        """`POST /v1/weights/memory/{release,resume}`: every server pauses and frees `tags` (SGLang's
        `/release_memory_occupation`), or takes them back and continues (a colocated trainer's step)."""
        return dict(self._request("POST", f"/v1/weights/memory/{action}", json={"tags": tags}).json())

    # --- SFT export ---
    def sessions(self, state: str = "finished", after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """`GET /v1/sessions?include_turns=true`: one page `{data: [session with turns], next_after}`."""
        params: dict[str, Any] = {"state": state, "limit": limit, "include_turns": "true"}
        if after:
            params["after"] = after
        return dict(self._request("GET", "/v1/sessions", params=params).json())


class LeaseRenewer:
    """Background thread that renews every held batch each `lease_seconds / 3` until it is released.
    A failed renew is logged and kept in `errors` (the loop reports it); it never kills training."""

    def __init__(self, client: GatewayClient, lease_seconds: float) -> None:
        self.client = client
        self.lease_seconds = lease_seconds
        self.errors: list[str] = []
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
        self._thread.start()

    def hold(self, batch_id: str) -> None:
        with self._lock:
            self._held.add(batch_id)

    def release(self, batch_id: str) -> None:
        with self._lock:
            self._held.discard(batch_id)

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def renew_now(self) -> None:
        for batch_id in self.held():
            try:
                self.client.renew(batch_id, self.lease_seconds)
            except GatewayClientError as e:  # deliberate: report and keep training
                log.warning("renewing lease %s failed: %s", batch_id, e)
                self.errors.append(f"{batch_id}: {e}")

    def _run(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            self.renew_now()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.client.timeout + 5)


def step_report(step: int, version: int, metrics: dict[str, Any], groups: list[Any]) -> dict[str, Any]:
    """The body of `POST /v1/training/steps`: the figures (non-finite ones as null: JSON has no NaN) and, per
    trained session, the token mean of its advantages over its loss tokens. `groups`: trainer.advantages'
    ScoredGroup (samples and per-token advantages)."""
    import time

    figures = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    sessions: dict[str, dict[str, Any]] = {}
    for g in groups:
        for sample, adv in zip(g.samples, g.advantages, strict=True):
            row = sessions.setdefault(sample.session_id, {
                "session_id": sample.session_id, "group_id": sample.group_id, "reward": sample.reward,
                "sequences": 0, "loss_tokens": 0, "sum": 0.0})
            row["sequences"] += 1
            row["loss_tokens"] += sample.n_loss_tokens
            row["sum"] += sum(a for a, m in zip(adv, sample.loss_mask, strict=True) if m)
    samples = []
    for row in sessions.values():
        total = row.pop("sum")
        row["advantage"] = total / row["loss_tokens"] if row["loss_tokens"] else 0.0
        if row["reward"] is not None and not math.isfinite(row["reward"]):
            row["reward"] = None
        samples.append(row)
    return {"step": step, "version": version, "time": time.time(), "metrics": figures, "samples": samples}


class StepReporter:
    """Sends each step's report to the gateway on a thread of its own, in order, so the training loop never
    waits for it. A failed report is retried a few times, then skipped with a warning: the figures are for
    looking at (they are in metrics.jsonl too), never a reason to stop training. A gateway without the route
    (404: older than the viewer) turns reporting off after one warning."""

    def __init__(self, client: GatewayClient, retries: int = 3, backoff_s: float = 1.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.client = client
        self.retries = retries
        self.backoff_s = backoff_s
        self.sent = 0
        self.failed = 0
        self._off = False
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="report")
        self._last: Any = None

    def report(self, step: int, version: int, metrics: dict[str, Any], groups: list[Any]) -> None:
        """Queue the report of a step (built on the reporter's thread: a pass over the step's tokens)."""
        if not self._off:
            self._last = self._pool.submit(self._send, step, version, dict(metrics), list(groups))

    def _send(self, step: int, version: int, metrics: dict[str, Any], groups: list[Any]) -> None:
        if self._off:
            return
        try:
            body = step_report(step, version, metrics, groups)
        except Exception as e:  # a report is never worth a crash
            log.warning("step %d: building its report failed (skipped): %s", step, e)
            self.failed += 1
            return
        for attempt in range(self.retries):
            try:
                self.client.report_step(body)
                self.sent += 1
                return
            except GatewayHTTPError as e:
                if e.status == 404:
                    log.warning("the gateway has no POST /v1/training/steps (an older version): step figures "
                                "are not reported to it; they stay in metrics.jsonl")
                    self._off = True
                    return
                if e.status < 500 and e.status not in (408, 429):
                    log.warning("step %d: the gateway refused its report (skipped): %s", step, e)
                    break
                error: Exception = e
            except GatewayClientError as e:
                error = e
            if attempt + 1 < self.retries and not self._stop.wait(self.backoff_s * 2**attempt):
                continue
            log.warning("step %d: reporting it to the gateway failed (skipped): %s", step, error)
            break
        self.failed += 1

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued (one try each, no more retries), waiting at most `timeout_s`, then stop."""
        from concurrent.futures import wait

        self._stop.set()
        if self._last is not None:
            wait([self._last], timeout=timeout_s)  # one thread, in order: the last done means all done
        self._pool.shutdown(wait=False, cancel_futures=True)
