"""Sampling step against hand-made logits: SGLang's logprob definition, filters, seeds, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import InvalidRequest, SamplingParams, UnknownSamplingKey, adjust_logits, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def test_logprobs_are_log_softmax_over_t_before_filtering() -> None:
    params = SamplingParams(
        temperature=0.5, top_k=1
    )  # top-k 1 forces token 0 but must not change its logprob
    out = sample(LOGITS, [params], [params.make_generator()], [2])
    assert out.tokens == [0]
    expected = torch.log_softmax(LOGITS[0] / 0.5, dim=-1)  # [-0.1455, -2.1455, -4.1455, -6.1455]
    assert out.logprobs[0] == pytest.approx(expected[0].item(), abs=1e-6)
    assert out.logprobs[0] == pytest.approx(
        -math.log(1 + math.exp(-2) + math.exp(-4) + math.exp(-6)), abs=1e-6
    )
    assert [t for _, t in out.top[0] or []] == [0, 1]


def test_greedy_reports_logprobs_at_temperature_one() -> None:
    params = SamplingParams(temperature=0)
    out = sample(LOGITS, [params], [params.make_generator()], [0])
    assert out.tokens == [0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(LOGITS[0], -1)[0].item(), abs=1e-6)
    assert out.top == [None]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # probs at T=1: [0.644, 0.237, 0.087, 0.032]; top_p=0.7 keeps tokens 0 and 1 only
    params = SamplingParams(top_p=0.7)
    gen = torch.Generator().manual_seed(0)
    seen = {sample(LOGITS, [params], [gen], [0]).tokens[0] for _ in range(300)}
    assert seen == {0, 1}


def test_seeded_rows_repeat_and_rows_are_independent() -> None:
    logits = torch.zeros(3, 50)
    params = [SamplingParams(sampling_seed=7), SamplingParams(temperature=0), SamplingParams(sampling_seed=7)]

    def run() -> list[list[int]]:
        gens = [p.make_generator() for p in params]
        return [sample(logits, params, gens, [0, 0, 0]).tokens for _ in range(20)]

    first, second = run(), run()
    assert first == second
    assert all(row[0] == row[2] for row in first)  # same seed, same draws, whatever the other rows do
    assert all(row[1] == 0 for row in first)
    assert len({row[0] for row in first}) > 5


def test_penalties_and_banned_ids() -> None:
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)]
    out = adjust_logits(LOGITS.clone(), params, [[0, 0, 3]], [[1]])
    # token 0: 2.0 / 2 - 0.5 * 2 = 0.0; token 3: -1.0 * 2 - 0.5 = -2.5; token 1 banned
    assert out[0].tolist() == [0.0, -math.inf, 0.0, -2.5]


def test_parameter_parsing() -> None:
    p = SamplingParams.from_request({"temperature": None, "stop": "x", "max_new_tokens": 5})
    assert p.temperature == 1.0 and p.stop == ("x",) and p.max_new_tokens == 5
    with pytest.raises(UnknownSamplingKey, match="bogus"):
        SamplingParams.from_request({"bogus": 1})
    for bad in [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": 0},
        {"max_new_tokens": -1},
        {"json_schema": {"type": "object"}},  # a grammar is a string (engine/grammar.py compiles it)
    ]:
        with pytest.raises(InvalidRequest):
            SamplingParams.from_request(bad)
