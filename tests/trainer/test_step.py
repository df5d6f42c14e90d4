"""rl_step takes the first minibatch's proximal logprobs from its own forward pass (no separate no-grad pass):
the update must be exactly the one a full proximal pass gives (same weights before the first optimizer step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.test_fsdp_equivalence import fixed_groups
from trainer.batching import MicroBatch, plan_step, rows_of
from trainer.loss import PolicyInputs, PPOParams, ppo_loss
from trainer.step import collate_plan, rl_step, run_minibatches, score_all


def _reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, plan: list, params: PPOParams) -> dict:
    """The textbook order: score every minibatch with the pre-update weights, then train."""
    batches = collate_plan(plan, torch.device("cpu"))
    proximal = score_all(model, batches)

    def loss_fn(i: int, j: int, mb: MicroBatch, logp: torch.Tensor, normalizer: float) -> tuple:
        return ppo_loss(PolicyInputs(logp, proximal[i][j], mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                                     mb.token_weight, normalizer), params)

    return run_minibatches(model, opt, plan, batches, loss_fn, max_grad_norm=1.0, device=torch.device("cpu"))


@pytest.mark.parametrize("optimizer_steps", [1, 2])
def test_first_minibatch_proximal_from_its_own_forward_equals_a_full_proximal_pass(
    tiny_model: Path, optimizer_steps: int
) -> None:
    plan = plan_step([rows_of(g) for g in fixed_groups()], world_size=1, rank=0, optimizer_steps=optimizer_steps,
                     micro_batch_tokens=48, loss_agg="token_mean")
    # clip_high small enough that the second minibatch's ratios leave the clip range: the proximal values matter
    params = PPOParams(clip_low=0.2, clip_high=0.28)
    results = []
    for step in (rl_step, None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if step is None:
            metrics = _reference_step(model, opt, plan, params)
        else:
            metrics = step(model, opt, plan, params, max_grad_norm=1.0, device=torch.device("cpu"))
        results.append((metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (m_fast, w_fast), (m_ref, w_ref) = results
    assert m_fast["minibatches"] == optimizer_steps
    for k in ("loss", "ratio", "clip_frac", "pg_loss", "grad_norm"):
        assert m_fast[k] == pytest.approx(m_ref[k], rel=1e-6, abs=1e-9), k
    moved = max((w_ref[k] - w_fast[k]).abs().max().item() for k in w_ref)
    assert moved <= 1e-7
    # and the step did change the weights (lr 1e-3): the comparison above is not between two no-ops
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert max((fresh[k] - w_fast[k]).abs().max().item() for k in fresh) > 1e-4
