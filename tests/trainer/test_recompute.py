"""Activation checkpointing per decoder layer (trainer/recompute.py) and long rows without a dense mask.

What must hold: a checkpointed pass gives the same loss and gradients as a plain one (plain module and FSDP2);
it keeps a fraction of the activations (counted exactly: the bytes autograd saves for the backward); `auto` pays
the recompute only on long passes; a micro-batch with a row over PACK_MAX_LEN runs unpacked (causal attention,
no (L, L) mask).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.trainer.test_packing import row
from trainer import recompute
from trainer.batching import PACK_MAX_LEN, Minibatch, Row, collate
from trainer.config import TrainConfig, load_config
from trainer.fsdp import decoder_layers, init_distributed, load_sharded_model, shard_model
from trainer.loss import PPOParams
from trainer.step import forward_logprobs, rl_step


def rows(n: int = 4, length: int = 40, seed: int = 0) -> list[Row]:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 500) for _ in range(8)]
    return [row(prompt, [rng.randrange(1, 500) for _ in range(length - 8 - i)], rng) for i in range(n)]


def model_from(path: Path, mode: recompute.Mode, min_tokens: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    recompute.install(model, decoder_layers(model), mode, min_tokens)
    return model


def loss_and_grads(model: nn.Module, batch: list[Row]) -> tuple[float, dict[str, torch.Tensor]]:
    mb = collate(batch)
    with recompute.active(model, mb.n_tokens):
        logp, _ = forward_logprobs(model, mb, with_entropy=True)
        loss = -(logp * mb.advantages * mb.loss_mask).sum() / mb.loss_mask.sum()
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def saved_bytes(model: nn.Module, batch: list[Row]) -> int:
    """Bytes of the tensors autograd keeps from the forward for the backward (exact, device-independent)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    mb = collate(batch)
    with recompute.active(model, mb.n_tokens), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = forward_logprobs(model, mb)
    (logp * mb.loss_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return total


def count_layer_forwards(model: nn.Module) -> list[int]:
    """Runs of each layer's body (its MLP's hook: inside the checkpoint, so a recompute counts too)."""
    calls = [0]
    for layer in decoder_layers(model):
        layer.get_submodule("mlp").register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_checkpointed_pass_equals_plain(tiny_model: Path) -> None:
    batch = rows()
    loss_plain, grads_plain = loss_and_grads(model_from(tiny_model, "off"), batch)
    on = model_from(tiny_model, "on")
    loss_on, grads_on = loss_and_grads(on, batch)
    assert loss_on == pytest.approx(loss_plain, rel=1e-6)
    assert grads_on.keys() == grads_plain.keys()
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_checkpointing_keeps_a_fraction_of_the_activations(tiny_model: Path) -> None:
    batch = rows(n=2, length=300)
    plain = saved_bytes(model_from(tiny_model, "off"), batch)
    checkpointed = saved_bytes(model_from(tiny_model, "on"), batch)
    assert checkpointed * 3 < plain, (checkpointed, plain)


def test_auto_recomputes_only_long_passes(tiny_model: Path) -> None:
    model = model_from(tiny_model, "auto", min_tokens=200)
    calls = count_layer_forwards(model)
    n_layers = len(decoder_layers(model))
    short, long = rows(n=2, length=40), rows(n=2, length=150)  # 2 x 39 and 2 x 149 padded tokens
    loss_and_grads(model, short)
    assert calls[0] == n_layers  # one forward per layer, no recompute
    calls[0] = 0
    loss_and_grads(model, long)
    assert calls[0] == 2 * n_layers  # each layer ran again in the backward
    calls[0] = 0
    with torch.no_grad(), recompute.active(model, 10_000):  # proximal/reference passes: nothing to recompute
        forward_logprobs(model, collate(long))
    assert calls[0] == n_layers


def test_off_installs_nothing(tiny_model: Path) -> None:
    model = model_from(tiny_model, "off")
    assert recompute.installed(model) is None
    with recompute.active(model, 10**9) as on:
        assert not on


def test_rl_step_under_fsdp2_with_checkpointing_equals_without(tiny_model: Path, dist_env: None) -> None:
    """The real step, FSDP2-wrapped (one CPU rank, wrapped anyway): checkpointing moves the weights the same."""
    info = init_distributed(force_cpu=True)
    batch = rows(n=4, length=60)
    plan = [Minibatch([batch], float(sum(r.n_loss_tokens for r in batch)))]
    after = {}
    for mode in ("off", "on"):
        model = model_from(tiny_model, mode)
        model = shard_model(model, info, wrap_one_cpu_rank=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        calls = count_layer_forwards(model)
        metrics = rl_step(model, opt, plan, PPOParams(), max_grad_norm=0.0, device=info.device)
        assert calls[0] == (2 if mode == "on" else 1) * len(decoder_layers(model))
        after[mode] = (metrics["loss"], {n: p.full_tensor().detach() for n, p in model.named_parameters()})
    assert after["on"][0] == pytest.approx(after["off"][0], rel=1e-6)
    for name, p in after["off"][1].items():
        torch.testing.assert_close(after["on"][1][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_load_sharded_model_installs_from_config(tiny_model: Path, dist_env: None) -> None:
    info = init_distributed(force_cpu=True)
    cfg = load_config(overrides={"model": str(tiny_model), "gateway": "http://x", "activation_checkpointing": "auto"})
    model = load_sharded_model(str(tiny_model), info, recompute=cfg.activation_checkpointing,
                               recompute_min_tokens=cfg.activation_checkpointing_min_tokens)  # fmt: skip
    state = recompute.installed(model)
    assert state is not None and state.min_tokens == TrainConfig().activation_checkpointing_min_tokens
    ref = load_sharded_model(str(tiny_model), info, trainable=False, recompute="on")
    assert recompute.installed(ref) is None  # a frozen reference model has no backward
    with pytest.raises(ValueError, match="activation_checkpointing"):
        load_config(overrides={"model": "m", "gateway": "http://x", "activation_checkpointing": "sometimes"})


def test_a_row_longer_than_the_pack_limit_is_not_packed() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(1, 500) for _ in range(64)]
    short = [row(prompt, [rng.randrange(1, 500) for _ in range(20)], rng) for _ in range(3)]
    assert collate(short).packed is not None  # shared prompt: packed
    long = row(prompt, [rng.randrange(1, 500) for _ in range(PACK_MAX_LEN)], rng)
    mb = collate([*short, long])
    assert mb.packed is None  # no (L, L) mask for a row over the limit: causal attention, unpacked
