"""Lease format 2 (docs/http-api.md "POST /v1/batches"): samples carry their turns and per-turn rewards and the
trainer computes returns. Pinned to format 1, the gateway's per-token returns, on the same stored turns: the
trainer's returns and a GRPO step's advantages are the ones format 1 gave. And the trainer's side of the
versioning: an older gateway, malformed turns, which gamma applies."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import orjson
import pytest

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from rollway_common.wire import pack
from trainer.advantages import chain_returns, score_group
from trainer.client import GatewayClient, Lease, parse_group, parse_sample
from trainer.config import TrainConfig
from trainer.train import lease_gamma


def tree(rng: random.Random, n: int) -> list[TurnRow]:
    """A session's turns: each extends an earlier one or starts a chain; some disconnected, constrained,
    rewarded per turn."""
    rows: list[TurnRow] = []
    for i in range(n):
        parent = rows[rng.randrange(len(rows))].id if rows and rng.random() < 0.8 else None
        k = rng.randint(1, 5)
        rows.append(TurnRow(
            id=f"t{i}", seq=i + 1, parent_id=parent, request={}, reply={},
            prompt_ids=pack([rng.randrange(1000) for _ in range(rng.randint(1, 4))], "int32"),
            completion_ids=pack([rng.randrange(1000) for _ in range(k)], "int32"),
            logprobs=pack([-rng.random() for _ in range(k)], "float32"), versions=pack([i] * k, "int32"),
            temperature=1.0, finish_reason="stop", continuity="extends" if parent else "new-chain",
            chain_reason=None, client_disconnected=rng.random() < 0.2,
            reward=rng.choice([None, None, 1.0, -0.3, 0.1]) if rng.random() < 0.5 else None, prompt_len=0,
            timings={}, constrained=rng.random() < 0.2))
    return rows


def leased(sessions: dict[str, tuple[list[TurnRow], float | None]], lease_format: int, gamma: float) -> Any:
    """The group a lease of `lease_format` hands out, through JSON, as the trainer parses it."""
    group: dict[str, Any] = {"group_id": "g", "task": None, "samples": [], "sessions": []}
    for sid, (rows, reward) in sessions.items():
        group["sessions"].append({"session_id": sid, "reward": reward, "state": "finished"})
        group["samples"] += [seq.wire("g", sid, reward, lease_format, gamma) for seq in session_sequences(rows)]
    return parse_group(orjson.loads(orjson.dumps(group)))


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_trainer_returns_equal_the_gateways_on_the_same_turns(gamma: float) -> None:
    rng = random.Random(int(gamma * 10))
    checked = 0
    for _ in range(200):
        sessions = {f"s{k}": (tree(rng, rng.randint(1, 7)), rng.choice([0.0, 1.0, 0.1, 0.7, -2.5]))
                    for k in range(rng.randint(1, 4))}
        one, two = leased(sessions, 1, gamma), leased(sessions, 2, gamma)
        assert [s.session_id for s in one.samples] == [s.session_id for s in two.samples]
        for s1, s2 in zip(one.samples, two.samples, strict=True):
            assert s2.returns is None and s1.returns == chain_returns(s2, gamma)  # bit for bit
            assert (s1.token_ids, s1.loss_mask, s1.logprobs, s1.versions) == (
                s2.token_ids, s2.loss_mask, s2.logprobs, s2.versions)
            checked += 1
        for std_norm in (False, True):
            a, b = score_group(one, std_norm), score_group(two, std_norm, gamma)
            assert a.advantages == b.advantages and a.filtered == b.filtered
    assert checked > 300


def test_format_2_carries_the_turns() -> None:
    rows = [
        TurnRow(id="a", seq=1, parent_id=None, request={}, reply={}, prompt_ids=pack([1, 2], "int32"),
                completion_ids=pack([10, 11], "int32"), logprobs=pack([-0.5, -0.5], "float32"),
                versions=pack([3, 3], "int32"), temperature=1.0, finish_reason="stop", continuity="new-chain",
                chain_reason=None, client_disconnected=False, reward=0.5, prompt_len=2, timings={}),
        TurnRow(id="b", seq=2, parent_id="a", request={}, reply={}, prompt_ids=pack([3], "int32"),
                completion_ids=pack([20, 21, 22], "int32"), logprobs=pack([-1.0] * 3, "float32"),
                versions=pack([4] * 3, "int32"), temperature=1.0, finish_reason="stop", continuity="extends",
                chain_reason=None, client_disconnected=False, reward=None, prompt_len=5, timings={}),
    ]
    (seq,) = session_sequences(rows)
    wire = orjson.loads(orjson.dumps(seq.wire("g", "s", 1.0, 2)))
    assert "returns" not in wire and wire["turn_rewards"] == [0.5, None]
    sample = parse_sample(wire)
    assert sample.turn_ends == [4, 8] and sample.completion_starts == [2, 5]
    assert chain_returns(sample, 0.5) == [0, 0, 0.5, 0.5, 0, 0, 0, 0]  # the reward on the turn that earned it
    assert seq.returns(1.0, 0.5) == chain_returns(sample, 0.5)


def wire_sample(**change: Any) -> dict[str, Any]:
    from rollway_common.wire import encode_array

    d: dict[str, Any] = {"group_id": "g", "session_id": "s", "reward": 1.0, "temperature": 1.0,
                         "token_ids": encode_array([1, 2, 3], "int32"), "loss_mask": encode_array([0, 1, 1], "uint8"),
                         "logprobs": encode_array([0, -1, -1], "float32"), "versions": encode_array([-1, 0, 0], "int32"),
                         "turn_ends": encode_array([3], "int32"), "completion_starts": encode_array([1], "int32"),
                         "turn_rewards": [None]}
    d.update(change)
    return {k: v for k, v in d.items() if v is not ...}


@pytest.mark.parametrize(("change", "message"), [
    ({"turn_ends": [2]}, "turn_ends"),
    ({"turn_ends": [2, 1, 3], "turn_rewards": [None] * 3, "completion_starts": [0, 1, 2]}, "turn_ends"),
    ({"turn_rewards": [None, 1.0]}, "differ in length"),
    ({"turn_rewards": [float("inf")]}, "non-finite"),
    ({"completion_starts": [4]}, "completion_start"),
    ({"turn_ends": ..., "turn_rewards": ...}, "neither returns nor"),
    ({"turn_rewards": "1.0"}, "turn_rewards must be a list"),
])
def test_malformed_turns_are_refused(change: dict[str, Any], message: str) -> None:
    parse_sample(wire_sample())
    with pytest.raises(ValueError, match=message):
        parse_sample(wire_sample(**change))


def lease_call(c: GatewayClient) -> Lease | None:
    return c.lease(max_groups=1, lease_seconds=1, wait_seconds=0, groups_per_step=1, max_head_offpolicyness=0,
                   trainer_version=0)


def test_the_trainer_asks_for_format_2_and_falls_back_once_on_an_older_gateway() -> None:
    bodies: list[dict[str, Any]] = []
    v1 = wire_sample(returns={"dtype": "float32", "b64": "AAAAAAAAgD8AAIA/"}, turn_ends=..., turn_rewards=...,
                     completion_starts=...)
    group = {"group_id": "g", "task": None, "sessions": [], "samples": [v1]}

    def old_gateway(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        bodies.append(body)
        if "lease_format" in body:  # what a gateway without the field answers (Strict: extra fields forbidden)
            return httpx.Response(400, json={"error": {"type": "invalid_request_error", "param": "lease_format",
                                                       "message": "lease_format: Extra inputs are not permitted"}})
        return httpx.Response(200, json={"batch_id": "b", "expires_at": 0, "groups": [group], "dropped_stale": 0})

    with GatewayClient("http://gw", transport=httpx.MockTransport(old_gateway)) as c:
        lease = lease_call(c)
        assert lease is not None and lease.lease_format == 1 and c.lease_format == 1
        assert lease.groups[0].samples[0].returns == [0.0, 1.0, 1.0]
        lease_call(c)
    assert [b.get("lease_format") for b in bodies] == [2, None, None]  # asked once, then format 1 only


def test_other_400s_are_not_taken_for_an_older_gateway() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "max_groups: too large"}})

    with GatewayClient("http://gw", transport=httpx.MockTransport(refuse)) as c, pytest.raises(Exception, match="max_groups"):
        lease_call(c)
    assert c.lease_format == 2


def test_which_gamma_applies() -> None:
    def lease(fmt: int, gw: float | None) -> Lease:
        return Lease("b", 0, [], 0, fmt, gw)

    unset, set_ = TrainConfig(), TrainConfig(gamma=0.5)
    assert lease_gamma(unset, lease(2, None)) == 1.0
    assert lease_gamma(unset, lease(2, 0.9)) == 0.9  # the gateway's deprecated ROLLWAY_GAMMA keeps its meaning
    assert lease_gamma(set_, lease(2, 0.9)) == 0.5  # the trainer's own wins
    assert lease_gamma(set_, lease(1, None)) is None  # format 1: the gateway discounted already
    with pytest.raises(ValueError, match="gamma"):
        TrainConfig(gateway="http://gw", model="m", gamma=1.5).validate()
