"""Group-relative advantages against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from trainer.advantages import baseline_and_scale, score_group, token_advantages
from trainer.client import Group, Sample, SessionInfo


def sample(sid: str, returns: list[float], mask: list[int], reward: float | None = None) -> Sample:
    n = len(mask)
    return Sample("g", sid, reward, 1.0, list(range(n)), mask, [-1.0] * n, [0] * n, returns)


def group(rewards: dict[str, float], samples: list[Sample], states: dict[str, str] | None = None) -> Group:
    states = states or {}
    return Group(
        "g", None, [SessionInfo(s, r, states.get(s, "finished")) for s, r in rewards.items()], samples
    )


def test_each_session_counts_once_in_the_baseline() -> None:
    # Sessions a=1, b=0, c=0; a produced two sequences. Baseline = (1 + 0 + 0) / 3 = 1/3
    # (by sample it would be (1 + 1 + 0 + 0) / 4 = 0.5). a's loss tokens: 1 - 1/3 = 2/3; b, c: -1/3.
    g = group(
        {"a": 1.0, "b": 0.0, "c": 0.0},
        [
            sample("a", [0, 1, 1], [0, 1, 1]),
            sample("a", [0, 0, 1], [0, 0, 1]),
            sample("b", [0, 0], [0, 1]),
            sample("c", [0, 0], [0, 1]),
        ],
    )
    sg = score_group(g, std_norm=False)
    assert sg.rewards == [1.0, 0.0, 0.0]
    assert sg.advantages[0] == pytest.approx([0.0, 2 / 3, 2 / 3])
    assert sg.advantages[1] == pytest.approx([0.0, 0.0, 2 / 3])
    assert sg.advantages[2] == pytest.approx([0.0, -1 / 3])
    assert sg.advantages[3] == pytest.approx([0.0, -1 / 3])
    assert not sg.filtered


def test_std_normalisation() -> None:
    # rewards [1, 0, 0]: mean 1/3, population std = sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2/9) = 0.4714
    # a: (2/3) / sqrt(2/9) = sqrt(2) = 1.4142; b: -(1/3) / sqrt(2/9) = -1/sqrt(2) = -0.7071
    mean, scale = baseline_and_scale([1.0, 0.0, 0.0], std_norm=True)
    assert mean == pytest.approx(1 / 3)
    assert scale == pytest.approx(math.sqrt(2 / 9))
    g = group(
        {"a": 1.0, "b": 0.0, "c": 0.0}, [sample(s, [r, r], [0, 1]) for s, r in (("a", 1), ("b", 0), ("c", 0))]
    )
    sg = score_group(g, std_norm=True)
    assert [adv[1] for adv in sg.advantages] == pytest.approx(
        [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
    )


def test_per_turn_returns_subtract_the_session_baseline_per_token() -> None:
    # Session rewards 1 and 0 -> baseline 0.5. Session a's returns per token (discounted per-turn rewards):
    # [-, 0.25, 1.0] -> advantages [0, 0.25 - 0.5, 1.0 - 0.5] = [0, -0.25, 0.5]; masked tokens stay 0.
    assert token_advantages([9.0, 0.25, 1.0], [0, 1, 1], 0.5, 1.0) == pytest.approx([0.0, -0.25, 0.5])
    g = group({"a": 1.0, "b": 0.0}, [sample("a", [0, 0.25, 1.0], [0, 1, 1]), sample("b", [0, 0], [0, 1])])
    assert score_group(g, std_norm=False).advantages[0] == pytest.approx([0.0, -0.25, 0.5])


def test_all_equal_rewards_are_filtered_and_std_zero_does_not_divide() -> None:
    # rewards [1, 1]: baseline 1, std 0 -> every advantage 0 -> filtered; the divisor stays 1, not 0.
    assert baseline_and_scale([1.0, 1.0], std_norm=True) == (1.0, 1.0)
    g = group({"a": 1.0, "b": 1.0}, [sample("a", [0, 1], [0, 1]), sample("b", [0, 1], [0, 1])])
    assert score_group(g, std_norm=True).filtered
    # Equal session rewards but per-turn returns that differ still carry a gradient: kept.
    # baseline 1; a's returns [0.9, 1.0] -> advantages [-0.1, 0].
    g = group({"a": 1.0, "b": 1.0}, [sample("a", [0.9, 1.0], [1, 1]), sample("b", [1.0], [1])])
    sg = score_group(g, std_norm=False)
    assert not sg.filtered
    assert sg.advantages[0] == pytest.approx([-0.1, 0.0])


def test_abandoned_and_unrewarded_sessions_leave_the_group() -> None:
    # a=1, b=0, c abandoned (reward 1 ignored), d unrewarded: baseline over a, b only = 0.5.
    g = group(
        {"a": 1.0, "b": 0.0, "c": 1.0},
        [sample("a", [1], [1]), sample("b", [0], [1]), sample("c", [1], [1]), sample("d", [1], [1])],
        states={"c": "abandoned"},
    )
    sg = score_group(g, std_norm=False)
    assert [s.session_id for s in sg.samples] == ["a", "b"]
    assert sg.advantages == [[0.5], [-0.5]]


def test_session_reward_falls_back_to_the_samples() -> None:
    # The session list carries no reward: take it from the session's samples. rewards 2, 0 -> baseline 1.
    g = Group(
        "g",
        None,
        [SessionInfo("a", None, "finished"), SessionInfo("b", None, "finished")],
        [sample("a", [2.0], [1], reward=2.0), sample("b", [0.0], [1], reward=0.0)],
    )
    assert score_group(g, std_norm=False).advantages == [[1.0], [-1.0]]
