"""`token_logprobs` (chunked) against `full_token_logprobs` (the whole (B, T, V) at once): same logprobs,
entropy and gradients, whatever the chunk size, and what the backward keeps is only the logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from trainer.loss import full_token_logprobs, token_logprobs


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
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


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
