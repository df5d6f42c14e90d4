"""One trainer step on one rank: the passes over its micro-batches and the optimizer steps.

`rl_step` = a no-grad proximal pass with the pre-update weights over every minibatch but the first (and a
reference pass when kl_coef > 0), then per minibatch: forward + backward per micro-batch, clip, optimizer step.
The first minibatch needs no proximal pass: its forward runs before any optimizer step, i.e. with the
proximal weights themselves, so its own logprobs (detached) are the proximal logprobs. With one optimizer
step per batch (the default) that saves a third of the step's compute.
`sft_step` = the same minibatch loop with the NLL loss. Both return metrics summed over all ranks.

FSDP averages gradients over ranks; each rank's loss is its share of the step's global mean, so it is
multiplied by the world size to make the averaged gradient the gradient of that global mean.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer import recompute
from trainer.batching import MicroBatch, Minibatch, collate
from trainer.config import TrainConfig
from trainer.loss import PolicyInputs, PPOParams, ppo_loss, sft_loss, token_logprobs

LossFn = Callable[[int, int, MicroBatch, Tensor, float], tuple[Tensor, dict[str, Tensor]]]
"""(minibatch index, micro index, micro-batch, current logprobs, normalizer) -> (loss, metric sums)."""


PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
"""Model types whose logits are exactly `lm_head(final hidden state)` (no softcapping, no logit scale)."""


def fused_head(model: nn.Module) -> bool:
    """Whether `forward_logprobs` can apply the lm_head itself, a chunk of tokens at a time: a plain head and
    a transformers version whose forward takes `logits_to_keep` (so the model itself makes no logits)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    return (
        getattr(config, "model_type", None) in PLAIN_HEAD_MODELS
        and isinstance(head, nn.Linear)
        and head.bias is None
        and "logits_to_keep" in inspect.signature(model.forward).parameters
    )


def packable(model: nn.Module) -> bool:
    """Whether the model can run a micro-batch's packed layout (`trainer.batching.Packed`): a fused head (its
    hidden states are what is gathered), SDPA attention (it takes the 4D boolean mask as given; flash attention
    takes none) and no sliding window (the mask would override it)."""
    config = getattr(model, "config", None)
    if config is None or not fused_head(model) or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return all(t == "full_attention" for t in getattr(config, "layer_types", None) or ())


def forward_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (B, T) of the targets, and optionally the entropies, under `model`. Only the positions of loss
    tokens (`loss_mask` > 0) are computed on the fused path, and the rest are 0: every use masks them out.

    With a plain head the full (B, T, V) logits are never made: the model runs with no positions to keep,
    and `token_logprobs` applies the head to the final hidden states of the loss positions, a chunk at a time.
    Under FSDP2 the head's weight is then the root module's gathered one: FSDP2 keeps the root's parameters
    gathered after its forward, and reduces their gradients at the end of the backward
    (tests/trainer/test_chunked_logprobs.py). With `mb.packed` and a model that can take it, the model runs the
    packed layout (shared prompts once) and each loss position's hidden state is gathered from there.
    """
    if not fused_head(model) or mb.loss_index is None:
        logits = model(input_ids=mb.input_ids, use_cache=False).logits  # (B, T, V)
        return token_logprobs(logits, mb.targets, mb.temperature, with_entropy)
    head = model.get_submodule("lm_head")
    none = torch.zeros(0, dtype=torch.long, device=mb.input_ids.device)
    packed = mb.packed if mb.packed is not None and packable(model) else None
    inputs: dict[str, Tensor] = {"input_ids": mb.input_ids}
    if packed is not None:
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": packed.attend}
    with warnings.catch_warnings():
        # FSDP2 warns that hidden_states[0] (the embedding output) is a view, unsafe to modify in place;
        # nothing here does
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        out = model(**inputs, use_cache=False, logits_to_keep=none, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # after the final norm
    source = mb.loss_index if packed is None else packed.source
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source)  # (N, H)
    idx = mb.loss_index
    logp_n, ent_n = token_logprobs(
        h[None], mb.targets.reshape(-1)[idx][None], mb.temperature.reshape(-1)[idx][None], with_entropy,
        head_weight=head.get_parameter("weight"),
    )
    b, t = mb.targets.shape
    logp = logp_n.new_zeros(b * t).index_copy(0, idx, logp_n[0]).view(b, t)
    entropy = None if ent_n is None else ent_n.new_zeros(b * t).index_copy(0, idx, ent_n[0]).view(b, t)
    return logp, entropy


@torch.no_grad()
def score_all(model: nn.Module, batches: list[list[MicroBatch]]) -> list[list[Tensor]]:
    """Logprobs of every micro-batch under `model` as it is now (no grad)."""
    return [[forward_logprobs(model, mb)[0] for mb in micro] for micro in batches]


def _set_grad_sync(model: nn.Module, on: bool) -> None:
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2; a plain module has none
    if setter is not None:
        setter(on)


def _all_reduce_sums(sums: dict[str, Tensor], device: torch.device) -> dict[str, float]:
    keys = sorted(sums)
    vec = torch.stack([sums[k].detach().float().to(device) for k in keys])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vec)
    return dict(zip(keys, vec.tolist(), strict=True))


def run_minibatches(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: list[Minibatch],
    batches: list[list[MicroBatch]],
    loss_fn: LossFn,
    *,
    max_grad_norm: float,
    device: torch.device,
) -> dict[str, float]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    sums: dict[str, Tensor] = {}  # metric sums over this rank's micro-batches
    grad_norms = []
    optimizer_s = 0.0  # clip + optimizer step, on this rank (the rest of a step is passes: forward/backward)
    for i, (minibatch, micro) in enumerate(zip(plan, batches, strict=True)):
        optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(micro):
            _set_grad_sync(model, j == len(micro) - 1)
            with recompute.active(model, mb.n_tokens) as recomputed:  # long passes recompute in the backward
                logp, entropy = forward_logprobs(model, mb, with_entropy=True)
                loss, metrics = loss_fn(i, j, mb, logp, minibatch.normalizer)
                (loss * world).backward()
            metrics["loss_sum"] = loss.detach()
            if entropy is not None:
                metrics["entropy_sum"] = (entropy * mb.loss_mask).sum()
            metrics["padded_tokens"] = torch.tensor(float(mb.n_tokens), device=mb.input_ids.device)
            metrics["recomputed_passes"] = torch.tensor(float(recomputed), device=mb.input_ids.device)
            for k, v in metrics.items():  # kept on the device: no sync per micro-batch
                sums[k] = sums[k] + v.detach().float() if k in sums else v.detach().float()
        t_opt = time.perf_counter()
        if max_grad_norm > 0:
            norm: Any = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer_s += time.perf_counter() - t_opt
    out = _all_reduce_sums(sums, device)
    tokens = max(out.pop("tokens"), 1.0)
    result: dict[str, float] = {
        "loss": out.pop("loss_sum") / max(len(plan), 1),
        "loss_tokens": tokens,
        "padded_tokens": out.pop("padded_tokens"),
        "recomputed_passes": out.pop("recomputed_passes"),
        "minibatches": float(len(plan)),
        "optimizer_time_s": optimizer_s,
    }
    names = {"clipped_sum": "clip_frac", "behaviour_capped_sum": "behaviour_capped_frac"}
    for k, total in out.items():  # per loss token: entropy, kl, clip fraction, nll, ...
        result[names.get(k, k.removesuffix("_sum"))] = total / tokens
    if grad_norms:
        result["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return result


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )


def collate_plan(plan: list[Minibatch], device: torch.device) -> list[list[MicroBatch]]:
    return [[collate(rows, mb.loss_agg, device) for rows in mb.micro] for mb in plan]


def rl_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: list[Minibatch],
    params: PPOParams,
    *,
    max_grad_norm: float,
    device: torch.device,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    batches = collate_plan(plan, device)
    # pre-update weights, before the first optimizer step; minibatch 0 uses its own forward (see above)
    proximal: list[list[Tensor] | None] = [None, *score_all(model, batches[1:])]
    reference = score_all(ref_model, batches) if params.kl_coef > 0 and ref_model is not None else None

    def loss_fn(
        i: int,
        j: int,
        mb: MicroBatch,
        logp: Tensor,
        normalizer: float,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        prox = proximal[i]
        inp = PolicyInputs(
            logprobs=logp,
            proximal_logprobs=logp.detach() if prox is None else prox[j],
            behaviour_logprobs=mb.behaviour_logprobs,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            token_weight=mb.token_weight,
            normalizer=normalizer,
            ref_logprobs=None if reference is None else reference[i][j],
        )
        return ppo_loss(inp, params)

    return run_minibatches(
        model, optimizer, plan, batches, loss_fn, max_grad_norm=max_grad_norm, device=device
    )


def sft_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: list[Minibatch],
    *,
    max_grad_norm: float,
    device: torch.device,
) -> dict[str, float]:
    batches = collate_plan(plan, device)

    def loss_fn(
        i: int,
        j: int,
        mb: MicroBatch,
        logp: Tensor,
        normalizer: float,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return sft_loss(logp, mb.loss_mask, mb.token_weight, normalizer)

    return run_minibatches(
        model, optimizer, plan, batches, loss_fn, max_grad_norm=max_grad_norm, device=device
    )
