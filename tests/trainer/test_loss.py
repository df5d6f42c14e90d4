"""Losses against numbers worked out by hand; the decoupled loss against a plain PPO reference."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import PolicyInputs, PPOParams, ppo_loss, sft_loss, token_logprobs

LN = math.log


def inputs(
    logp: list[float],
    prox: list[float],
    behav: list[float],
    adv: list[float],
    mask: list[float],
    weight: list[float] | None = None,
    normalizer: float | None = None,
    ref: list[float] | None = None,
) -> PolicyInputs:
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731  (B=1, T)
    return PolicyInputs(
        logprobs=t(logp).requires_grad_(), proximal_logprobs=t(prox), behaviour_logprobs=t(behav),
        advantages=t(adv), loss_mask=t(mask), token_weight=t(weight or [1.0] * len(mask)),
        normalizer=normalizer if normalizer is not None else sum(mask), ref_logprobs=None if ref is None else t(ref),
    )  # fmt: skip


def test_ppo_clip_by_hand() -> None:
    # token 1: ratio = exp(ln 1.5) = 1.5, A = +1: min(1.5 * 1, clip(1.5, 0.8, 1.28) * 1) = 1.28 -> pg = -1.28 (clipped)
    # token 2: ratio 0.5, A = -2: min(0.5 * -2, 0.8 * -2) = min(-1.0, -1.6) = -1.6 -> pg = +1.6 (clipped)
    # token 3: ratio 1.1, A = +1: min(1.1, 1.1) = 1.1 -> pg = -1.1 (not clipped)
    # token 4: masked. behaviour == proximal -> w = 1.
    # token_mean = (-1.28 + 1.6 - 1.1) / 3 = -0.78 / 3 = -0.26; clipped 2 of 3.
    prox = [-1.0, -1.0, -1.0, -1.0]
    logp = [-1.0 + LN(1.5), -1.0 + LN(0.5), -1.0 + LN(1.1), 5.0]
    loss, m = ppo_loss(inputs(logp, prox, prox, [1.0, -2.0, 1.0, 9.0], [1, 1, 1, 0]), PPOParams(0.2, 0.28))
    assert loss.item() == pytest.approx(-0.26)
    assert m["clipped_sum"].item() == 2 and m["tokens"].item() == 3
    assert m["pg_loss_sum"].item() == pytest.approx(-0.78)


def test_behaviour_weight_cap() -> None:
    # prox - behav = ln 2 -> w = 2; ratio 1, A = 1 -> pg = -w * 1.
    # no cap: -2; truncate at 1.5: -1.5; mask at 1.5: the token drops out, so the loss is 0 / 1 = 0.
    # second token: w = exp(0) = 1, ratio 1, A = 1 -> pg -1. token_mean over 2 tokens:
    # no cap (-2 - 1) / 2 = -1.5; truncate (-1.5 - 1) / 2 = -1.25; mask (0 - 1) / 2 = -0.5.
    x = dict(logp=[-1.0, -1.0], prox=[-1.0, -1.0], behav=[-1.0 - LN(2), -1.0], adv=[1.0, 1.0], mask=[1, 1])
    assert ppo_loss(inputs(**x), PPOParams(behaviour_weight_cap=0))[0].item() == pytest.approx(-1.5)
    assert ppo_loss(inputs(**x), PPOParams(behaviour_weight_cap=1.5))[0].item() == pytest.approx(-1.25)
    loss, m = ppo_loss(inputs(**x), PPOParams(behaviour_weight_cap=1.5, cap_mode="mask"))
    assert loss.item() == pytest.approx(-0.5)
    assert m["behaviour_capped_sum"].item() == 1


def test_k3_kl_by_hand() -> None:
    # ref - logp = ln 2: k3 = exp(ln 2) - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853. A = 0 -> pg = 0.
    # loss = kl_coef * k3 = 0.1 * 0.306853 = 0.0306853
    loss, m = ppo_loss(inputs([-1.0], [-1.0], [-1.0], [0.0], [1], ref=[-1.0 + LN(2)]), PPOParams(kl_coef=0.1))
    assert loss.item() == pytest.approx(0.1 * (2 - LN(2) - 1))
    assert m["kl_sum"].item() == pytest.approx(0.306853, abs=1e-6)


def test_seq_mean_and_token_mean_aggregation() -> None:
    # Row 1 has 1 loss token with pg -1 (ratio 1, A 1); row 2 has 2 tokens with pg -2 and -4 (A = 2, 4).
    # token_mean = (-1 - 2 - 4) / 3 = -7/3; seq_mean = (-1 / 1 + (-2 - 4) / 2) / 2 = (-1 - 3) / 2 = -2.
    z = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, 0.0], [2.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    tok = PolicyInputs(z.clone().requires_grad_(), z, z, adv, mask, torch.ones_like(mask), normalizer=3)
    seqw = torch.tensor([[1.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    seq = PolicyInputs(z.clone().requires_grad_(), z, z, adv, mask, seqw, normalizer=2)
    assert ppo_loss(tok, PPOParams())[0].item() == pytest.approx(-7 / 3)
    assert ppo_loss(seq, PPOParams())[0].item() == pytest.approx(-2.0)


def plain_ppo(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> torch.Tensor:
    """Reference: PPO-clip (Schulman et al. 2017) with pi_old, token mean."""
    ratio = torch.exp(logp - old)
    obj = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return -(obj * mask).sum() / mask.sum()


def test_decoupled_equals_plain_ppo_when_behaviour_is_proximal() -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 4
    logp = (old + 0.4 * torch.randn(3, 7, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 7, generator=g) > 0.3).double()
    inp = PolicyInputs(logp, old, old.clone(), adv, mask, torch.ones_like(mask), normalizer=mask.sum().item())
    loss, m = ppo_loss(inp, PPOParams(0.2, 0.28, behaviour_weight_cap=5.0))
    (grad,) = torch.autograd.grad(loss, logp)
    ref = plain_ppo(logp, old, adv, mask, 0.2, 0.28)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert m["clipped_sum"].item() > 0  # the clip is exercised
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_sft_loss_by_hand() -> None:
    # NLL of loss tokens: logp [-1, -2, -3], mask [1, 0, 1] -> (1 + 3) / 2 = 2
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, m = sft_loss(logp, mask, torch.ones_like(mask), 2.0)
    assert loss.item() == pytest.approx(2.0) and m["tokens"].item() == 2


def test_token_logprobs_divide_by_temperature() -> None:
    # logits [2, 0, 0] at T = 2 -> [1, 0, 0]; log p(0) = 1 - log(e + 2) = 1 - 1.551445 = -0.551445
    # at T = 1: 2 - log(e^2 + 2) = 2 - 2.253856 = -0.253856. Entropy at T=2: p = [e, 1, 1] / (e + 2).
    logits = torch.tensor([[[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]]])
    logp, ent = token_logprobs(logits, torch.tensor([[0, 0]]), torch.tensor([[2.0, 1.0]]), with_entropy=True)
    assert logp[0, 0].item() == pytest.approx(1 - math.log(math.e + 2), abs=1e-6)
    assert logp[0, 1].item() == pytest.approx(2 - math.log(math.e**2 + 2), abs=1e-6)
    p = [math.e / (math.e + 2), 1 / (math.e + 2), 1 / (math.e + 2)]
    assert ent is not None and ent[0, 0].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)
