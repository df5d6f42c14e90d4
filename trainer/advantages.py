"""Group-relative advantages, by explicit group id (never by position in the batch: AReaL#1419).

Per group: baseline b = mean of the session rewards, each session counted once however many sequences it
produced; with `std_norm`, s = the population std of those rewards (GRPO), else s = 1 (Dr. GRPO). A token's
advantage is (return_t - b) / s where loss_mask = 1, else 0. The per-token return is computed here from the
lease's turns (`chain_returns`, lease format 2): the session reward on every loss token for outcome rewards,
or, when any turn of the chain carries a reward, each turn's rewards discounted backwards with `gamma`. From a
gateway that speaks only format 1 the sample's `returns` are the gateway's own.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from rollway_common.wire import turn_returns
from trainer.client import Group, Sample

STD_EPS = 1e-6
"""A std below this is treated as zero: no division (it would blow per-turn return differences up)."""


def baseline_and_scale(rewards: list[float], std_norm: bool) -> tuple[float, float]:
    """(mean, divisor) of a group's session rewards."""
    mean = sum(rewards) / len(rewards)
    if not std_norm:
        return mean, 1.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return mean, (std if std > STD_EPS else 1.0)


def token_advantages(
    returns: list[float], loss_mask: list[int], baseline: float, scale: float
) -> list[float]:
    return [(r - baseline) / scale if m else 0.0 for r, m in zip(returns, loss_mask, strict=True)]



def chain_returns(sample: Sample, gamma: float) -> list[float]:
    """Per token of a sample: its turn's return where loss_mask = 1, else 0. Rounded to float32, the precision
    lease format 1 carried them in, so that a step's advantages are the ones that format gave."""
    if sample.returns is not None:
        return sample.returns
    assert sample.turn_ends is not None and sample.turn_rewards is not None  # Sample checks one form is there
    rets = turn_returns(sample.turn_rewards, sample.reward, gamma)
    out: list[float] = []
    start = 0
    for end, ret in zip(sample.turn_ends, rets, strict=True):
        out += [ret if m else 0.0 for m in sample.loss_mask[start:end]]
        start = end
    return array("f", out).tolist()


def session_rewards(group: Group) -> dict[str, float]:
    """Each live, rewarded session once: its reward from the group's session list, else from its samples."""
    from_samples = {s.session_id: s.reward for s in group.samples if s.reward is not None}
    out: dict[str, float] = {}
    listed = {s.session_id for s in group.sessions}
    for s in group.sessions:
        reward = s.reward if s.reward is not None else from_samples.get(s.session_id)
        if s.state != "abandoned" and reward is not None:
            out[s.session_id] = float(reward)
    for sid, reward in from_samples.items():  # a gateway that lists no sessions: take the samples' rewards
        if sid not in listed:
            out[sid] = float(reward)
    return out


@dataclass
class ScoredGroup:
    group_id: str
    samples: list[Sample]
    """The samples that train: of a rewarded live session, with at least one loss token."""
    advantages: list[list[float]]
    """Per sample, per token (0 where loss_mask is 0)."""
    rewards: list[float]
    """Session rewards, one per session."""
    filtered: bool
    """Every advantage is zero (for outcome rewards: all session rewards equal), or nothing trains."""


def score_group(group: Group, std_norm: bool, gamma: float = 1.0) -> ScoredGroup:
    rewards_by_session = session_rewards(group)
    samples = [s for s in group.samples if s.session_id in rewards_by_session and s.n_loss_tokens > 0]
    rewards = list(rewards_by_session.values())
    if not samples or len(rewards) < 1:
        return ScoredGroup(group.group_id, [], [], rewards, True)
    baseline, scale = baseline_and_scale(rewards, std_norm)
    advantages = [token_advantages(chain_returns(s, gamma), s.loss_mask, baseline, scale) for s in samples]
    all_zero = all(abs(a) < 1e-12 for adv in advantages for a in adv)
    return ScoredGroup(group.group_id, samples, advantages, rewards, all_zero)
