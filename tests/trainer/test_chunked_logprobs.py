"""`token_logprobs` (chunked) against `full_token_logprobs` (the whole (B, T, V) at once): same logprobs,
entropy and gradients, whatever the chunk size, and what the backward keeps is only the logits; and
`forward_logprobs` with the lm_head fused in against the model's own logits (at the loss positions, the only ones
it computes), plain and under FSDP2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.trainer.trainer_fakes import make_tiny_model
from trainer.batching import MicroBatch, Row, collate
from trainer.loss import full_token_logprobs, token_logprobs
from trainer.step import forward_logprobs, fused_head


def inputs(b: int = 3, t: int = 7, v: int = 50, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * 4
    targets = torch.randint(0, v, (b, t), generator=g)
    temperature = torch.rand(b, t, generator=g) * 1.7 + 0.3  # a different T on every token, 0.3..2.0
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    return logits, targets, temperature, mask


def weighted(logp: Tensor, mask: Tensor) -> Tensor:
    """A loss whose gradient differs per token (so a token mixed up between chunks would show)."""
    w = torch.arange(1, logp.numel() + 1, dtype=torch.float32).view_as(logp)
    return (logp * mask * w).sum()


@pytest.mark.parametrize("chunk", [1, 4, 5, 21, 22, 1000, None])  # 21 tokens: one, odd, whole, more
def test_chunked_equals_full(chunk: int | None) -> None:
    logits, targets, temperature, mask = inputs()
    full_in = logits.clone().requires_grad_()
    chunk_in = logits.clone().requires_grad_()
    ref, ref_ent = full_token_logprobs(full_in, targets, temperature, with_entropy=True)
    got, ent = token_logprobs(chunk_in, targets, temperature, with_entropy=True, chunk_tokens=chunk)
    weighted(ref, mask).backward()
    weighted(got, mask).backward()
    torch.testing.assert_close(got, ref)
    assert ent is not None and ref_ent is not None
    torch.testing.assert_close(ent, ref_ent)
    assert chunk_in.grad is not None and full_in.grad is not None
    torch.testing.assert_close(chunk_in.grad, full_in.grad)
    assert full_in.grad[mask == 0].abs().max() == 0  # masked tokens get no gradient, in both
    assert not ent.requires_grad  # a metric


def test_bfloat16_logits_give_float32_logprobs_and_a_bfloat16_gradient() -> None:
    logits, targets, temperature, mask = inputs(seed=1)
    full_in = logits.bfloat16().requires_grad_()
    chunk_in = logits.bfloat16().requires_grad_()
    ref, _ = full_token_logprobs(full_in, targets, temperature)
    got, ent = token_logprobs(chunk_in, targets, temperature, chunk_tokens=4)
    weighted(ref, mask).backward()
    weighted(got, mask).backward()
    assert got.dtype == torch.float32 and ent is None
    torch.testing.assert_close(got, ref)
    assert chunk_in.grad is not None and chunk_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunk_in.grad, full_in.grad)


def test_model_parameter_gradients_match(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    _, targets, temperature, mask = inputs(b=2, t=9, v=512, seed=2)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (full_token_logprobs, lambda *a: token_logprobs(*a, chunk_tokens=5)):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        logp, _ = fn(logits, targets, temperature)
        weighted(logp, mask).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=lambda m, name=name: f"{name}: {m}")


def saved_bytes(fn: object, logits: Tensor, targets: Tensor, temperature: Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of `fn`."""
    seen: dict[tuple[int, int], int] = {}

    def pack(x: Tensor) -> Tensor:
        seen[(x.untyped_storage().data_ptr(), x.storage_offset())] = x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(logits, targets, temperature, True)  # type: ignore[operator]
    return sum(seen.values())


def test_backward_keeps_only_the_logits() -> None:
    # bf16 logits (B*T*V*2 bytes); the full path keeps log_softmax in float32 (B*T*V*4) on top of small things
    logits, targets, temperature, _ = inputs(b=4, t=16, v=1000)
    logits = logits.bfloat16().requires_grad_()
    n, v = 4 * 16, 1000
    chunked = saved_bytes(token_logprobs, logits, targets, temperature)
    full = saved_bytes(full_token_logprobs, logits, targets, temperature)
    assert chunked == n * v * 2 + n * (8 + 4 + 4)  # logits + targets (int64), temperature, log-normaliser
    assert full >= n * v * 4


def microbatch(seed: int = 4) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in (13, 9, 11):
        temps = (torch.rand(n, generator=g) * 1.5 + 0.5).tolist()
        mask = [0] * 3 + [1] * (n - 3)
        rows.append(Row(torch.randint(0, 512, (n,), generator=g).tolist(), mask, [0.0] * n, [1.0] * n, temps))
    return collate(rows)


def reference(model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor | None]:
    """The model's own (B, T, V) logits, then the whole log-softmax."""
    logits = model(input_ids=mb.input_ids, use_cache=False).logits
    return full_token_logprobs(logits, mb.targets, mb.temperature, with_entropy=True)


def assert_close_to_scale(got: Tensor, expected: Tensor, name: str) -> None:
    """Within 1e-6 of the gradient's largest entry: float32 sums over tokens taken in another order
    (a chunk at a time) differ by a few ulps of their largest terms, not of each small result."""
    worst = (got - expected).abs().max().item() / expected.abs().max().item()
    assert worst <= 1e-6, (name, worst)


@pytest.mark.parametrize("tie", [True, False])
def test_fused_head_equals_the_models_logits(tmp_path: Path, tie: bool) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "model", tie=tie)
    mb = microbatch()
    results = []
    for fn in (reference, forward_logprobs):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert fused_head(model)
        logp, ent = fn(model, mb, True) if fn is forward_logprobs else fn(model, mb)
        weighted(logp, mb.loss_mask).backward()
        results.append((logp, ent, {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_ent, ref_grads), (got, ent, grads) = results
    mask = mb.loss_mask
    assert not got[mask == 0].any() and not ent[mask == 0].any()  # only the loss positions are computed
    torch.testing.assert_close(got * mask, ref * mask)
    torch.testing.assert_close(ent * mask, ref_ent * mask)
    assert all(g is not None for g in grads.values()) and (tie or "lm_head.weight" in grads)
    for name, g in grads.items():
        assert_close_to_scale(g, ref_grads[name], name)


def test_fused_head_under_fsdp_equals_a_plain_model(tiny_model: Path, dist_env: None) -> None:
    # the head's weight is the root's gathered one; its gradient must come back to the shards
    from transformers import AutoModelForCausalLM

    from trainer.fsdp import init_distributed, shard_model

    mb = microbatch(seed=5)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ref, _ = reference(plain, mb)
    weighted(ref, mb.loss_mask).backward()
    sharded = shard_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                          init_distributed(force_cpu=True), wrap_one_cpu_rank=True)
    for _ in range(2):  # a second pass: gradients accumulate, as over micro-batches
        got, _ = forward_logprobs(sharded, mb)
        weighted(got, mb.loss_mask).backward()
    torch.testing.assert_close(got * mb.loss_mask, ref * mb.loss_mask)
    for name, p in sharded.named_parameters():
        expected = plain.get_parameter(name).grad
        assert p.grad is not None and expected is not None, name
        assert_close_to_scale(p.grad.full_tensor(), 2 * expected, name)
