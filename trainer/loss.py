"""Losses as pure functions over small typed inputs, returning (loss, metrics) (prime-rl style).

Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL): the clip is
taken around the proximal policy pi_prox (the weights before this batch's first optimizer step,
recomputed by the trainer), and the off-policyness between the behaviour policy mu (the inference
server's logprobs, possibly several versions old) and pi_prox is corrected by an importance weight
w = pi_prox / mu, capped. Per loss token t:

    w_t     = exp(prox_t - behav_t)                       (capped: min(w, cap), or the token dropped)
    r_t     = exp(logp_t - prox_t)
    pg_t    = -w_t * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (k3 estimator, Schulman 2020), if kl_coef > 0
    loss    = sum_t weight_t * (pg_t + kl_coef * kl_t) / normalizer

`weight_t` and `normalizer` carry the aggregation over the whole step (all micro-batches, all ranks):
token_mean: weight 1, normalizer = loss tokens of the step; seq_mean: weight 1/len(seq's loss tokens),
normalizer = sequences of the step. So summing micro-batch losses gives the step's mean exactly.
When behav == prox, w = 1 and this is plain PPO with pi_old = pi_prox.

Metrics are sums over loss tokens (`*_sum`) plus `tokens`, so callers add them across micro-batches and
ranks and divide once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class PPOParams:
    clip_low: float = 0.2
    clip_high: float = 0.28
    behaviour_weight_cap: float = 5.0
    """0 = no cap."""
    cap_mode: Literal["truncate", "mask"] = "truncate"
    kl_coef: float = 0.0


@dataclass
class PolicyInputs:
    """All (B, T), aligned so position t scores token t+1 of the sequence (already shifted)."""

    logprobs: Tensor
    """Current policy, with grad."""
    proximal_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    """1.0 on tokens that train, else 0.0."""
    token_weight: Tensor
    """Aggregation weight per token (see module docstring)."""
    normalizer: float
    ref_logprobs: Tensor | None = None


def ppo_loss(inp: PolicyInputs, p: PPOParams) -> tuple[Tensor, dict[str, Tensor]]:
    mask = inp.loss_mask.float()
    prox = inp.proximal_logprobs.detach()
    w = torch.exp(prox - inp.behaviour_logprobs)
    capped = torch.zeros_like(mask)
    if p.behaviour_weight_cap > 0:
        capped = (w > p.behaviour_weight_cap).float() * mask
        if p.cap_mode == "mask":
            mask = mask * (1.0 - capped)
            w = torch.where(capped > 0, torch.zeros_like(w), w)
        else:
            w = w.clamp(max=p.behaviour_weight_cap)
    ratio = torch.exp(inp.logprobs - prox)
    surr1 = ratio * inp.advantages
    surr2 = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high) * inp.advantages
    pg = -w * torch.minimum(surr1, surr2)
    per_token = pg
    kl = torch.zeros_like(pg)
    if p.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = inp.ref_logprobs.detach() - inp.logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = pg + p.kl_coef * kl
    loss = (per_token * mask * inp.token_weight).sum() / inp.normalizer
    with torch.no_grad():
        metrics = {
            "tokens": mask.sum(),
            "pg_loss_sum": (pg * mask).sum(),
            "clipped_sum": ((surr2 < surr1).float() * mask).sum(),
            "kl_sum": (kl * mask).sum(),
            "behaviour_capped_sum": capped.sum(),
            "ratio_sum": (ratio * mask).sum(),
        }
    return loss, metrics


def sft_loss(
    logprobs: Tensor,
    loss_mask: Tensor,
    token_weight: Tensor,
    normalizer: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the loss tokens (assistant tokens), same aggregation as ppo_loss."""
    mask = loss_mask.float()
    nll = -logprobs
    loss = (nll * mask * token_weight).sum() / normalizer
    with torch.no_grad():
        metrics = {"tokens": mask.sum(), "nll_sum": (nll.detach() * mask).sum()}
    return loss, metrics


CHUNK_ELEMENTS = 1 << 25
"""Vocabulary-sized float32 work per chunk of `token_logprobs`: 2^25 values = 128 MiB, i.e. 220 tokens at a
151,936 vocabulary, and every token at once for a small one (one chunk: no loop)."""


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: Tensor,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    head_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[target] per position, and optionally the entropy of that distribution.

    logits (B, T, V), targets (B, T) int, temperature (B, T) (one value per token, > 0). With `head_weight`
    (V, H), `logits` are the hidden states (B, T, H) and the logits are `hidden @ head_weight.T`, made a
    chunk at a time (the lm_head fused in: the (B, T, V) logits never exist).
    Computed in float32 whatever the logits' dtype, as the inference server does, `chunk_tokens`
    positions at a time (default: CHUNK_ELEMENTS // V): no (B, T, V) float32 copy is made in the forward
    or kept for the backward, which recomputes each chunk's softmax. The values and the gradients are
    those of `full_token_logprobs` (tests/trainer/test_chunked_logprobs.py). The entropy is a metric: it
    carries no gradient.
    """
    b, t, d = logits.shape
    v = d if head_weight is None else head_weight.shape[0]
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // v)
    logp, entropy = _ChunkedLogprobs.apply(
        logits.reshape(b * t, d),
        head_weight,
        targets.reshape(-1),
        temperature.reshape(-1),
        chunk,
        with_entropy,
    )
    return logp.view(b, t), entropy.view(b, t) if with_entropy else None


class _ChunkedLogprobs(torch.autograd.Function):
    """(N, V) logits, or (N, H) hidden states and a (V, H) head -> (N,) logprobs of the targets and (N,)
    entropies, a chunk of rows at a time.

    d logp_n / d logits_n = (onehot(target_n) - softmax(logits_n / T_n)) / T_n; the backward recomputes each
    chunk's logits (with a head) and softmax from what the forward saved: its inputs, which exist anyway,
    and one float per token (the log-normaliser).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        targets: Tensor,
        temperature: Tensor,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=x.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=x.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logp_all = _logits(x[s:e], weight).float() / temperature[s:e, None]  # (c, V) float32
            lse[s:e] = torch.logsumexp(logp_all, dim=-1)
            logp_all -= lse[s:e, None]  # in place: log_softmax of the chunk
            logp[s:e] = logp_all.gather(-1, targets[s:e, None]).squeeze(-1)
            if with_entropy:
                entropy[s:e] = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(x, weight, targets, temperature, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, targets, temperature, lse = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        # the head's gradient: each chunk's product in the weight's dtype (as the one product autograd would
        # make), summed over the chunks in float32
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        scale = grad_logp.float() / temperature  # (N,) d loss / d logp / T
        for s in range(0, x.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, x.shape[0])
            g = (_logits(x[s:e], weight).float() / temperature[s:e, None]).sub_(lse[s:e, None]).exp_()
            # d loss / d logits = scale * (onehot - softmax)
            g.mul_(-scale[s:e, None]).scatter_add_(-1, targets[s:e, None], scale[s:e, None])
            if weight is None:
                grad_x[s:e] = g
            else:
                g = g.to(x.dtype)  # the dtype autograd would give the logits' gradient
                torch.mm(g, weight, out=grad_x[s:e])
                if grad_w is not None:
                    grad_w += g.T @ x[s:e]
        # x @ weight.T needs one dtype for both, so x's is the weight's
        return grad_x, None if grad_w is None else grad_w.to(x.dtype), None, None, None, None


def _logits(x: Tensor, weight: Tensor | None) -> Tensor:
    return x if weight is None else x @ weight.T


def full_token_logprobs(
    logits: Tensor, targets: Tensor, temperature: Tensor, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` computed whole: the reference it is tested against, and the benchmark's "before"
    (it makes several (B, T, V) float32 tensors and keeps one for the backward)."""
    scaled = logits.float() / temperature.unsqueeze(-1)
    logp_all = torch.log_softmax(scaled, dim=-1)  # (B, T, V)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, T)
    return logp, entropy
