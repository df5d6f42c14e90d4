"""Shared prompts computed once (`trainer.batching.pack`, `Packed`): the packed layout gives the logprobs, entropies
and gradients of the unpacked rows; what it leaves out (rows with no loss token) and where it is not used (models
that cannot take the mask); a whole `rl_step` moves the weights as the unpacked one does."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.trainer.trainer_fakes import make_tiny_model
from trainer.batching import PACK_MAX_LEN, MicroBatch, Minibatch, Row, collate
from trainer.loss import PPOParams
from trainer.step import forward_logprobs, packable, rl_step


def row(prompt: list[int], completion: list[int], rng: random.Random, loss: list[int] | None = None) -> Row:
    ids = prompt + completion
    n = len(ids)
    mask = [0] * len(prompt) + (loss if loss is not None else [1] * len(completion))
    return Row(ids, mask, [rng.uniform(-3, -0.1) for _ in range(n)], [rng.uniform(-1, 1)] * n,
               [rng.choice([0.7, 1.0, 1.3]) for _ in range(n)])


def groups(seed: int = 0) -> list[Row]:
    """Two groups with their own prompts and completions of 1..6 tokens, a multi-turn row (a tool result between
    two answers: no loss on it), a row with no loss token and a row alone with its prompt."""
    rng = random.Random(seed)
    rows = []
    for plen, k in ((9, 5), (6, 4)):
        prompt = [rng.randrange(1, 500) for _ in range(plen)]
        for i in range(k):
            rows.append(row(prompt, [rng.randrange(1, 500) for _ in range(1 + (i * 3) % 6)], rng))
    prompt = rows[0].token_ids[:9]
    rows.append(row(prompt, [7, 8, 9, 10, 11, 12, 13], rng, loss=[1, 1, 0, 0, 0, 1, 1]))  # answer, tool, answer
    rows.append(row([3, 4, 5], [6, 7], rng, loss=[0, 0]))  # nothing to train
    rows.append(row([1, 2, 3, 4], [5, 6, 7], rng))  # a prompt no other row has
    return rows


def test_layout_shares_each_prompt_once() -> None:
    rows = groups()
    mb = collate(rows)
    assert mb.packed is not None and mb.loss_index is not None
    # a packed row per prompt with a loss token: the 9-token group (and its multi-turn row), the 6-token group,
    # the lone row; the row with no loss token is not there
    assert mb.packed.input_ids.shape[0] == 3
    needed = sum(len(r.token_ids) - 1 for r in rows if any(r.loss_mask[1:]))
    assert mb.packed.input_ids.shape[1] * 3 < needed
    assert mb.loss_index.numel() == sum(sum(r.loss_mask[1:]) for r in rows) == mb.packed.source.numel()
    # every loss position reads the packed token it would have read unpacked, at the same position id
    flat_ids = mb.packed.input_ids.reshape(-1)[mb.packed.source]
    flat_pos = mb.packed.position_ids.reshape(-1)[mb.packed.source]
    assert torch.equal(flat_ids, mb.input_ids.reshape(-1)[mb.loss_index])
    assert torch.equal(flat_pos, mb.loss_index % mb.input_ids.shape[1])


def test_nothing_shared_means_no_packing() -> None:
    rng = random.Random(1)
    rows = [row([1, 2, 3], [4, 5], rng), row([1, 2, 9], [4, 5], rng), row([7], [8], rng)]
    assert collate(rows).packed is None
    assert collate([]).packed is None  # the no-op pass of a rank with nothing to train


def test_a_group_too_long_for_one_packed_row_is_split() -> None:
    rng = random.Random(2)
    prompt = [5] * 100
    rows = [row(prompt, [rng.randrange(1, 500) for _ in range(PACK_MAX_LEN // 3)], rng) for _ in range(5)]
    packed = collate(rows).packed
    assert packed is not None
    ids, attend = packed.input_ids, packed.attend
    # 100 + 2 x 1,364 fits, a third suffix would not: 2 + 2 + 1 suffixes, each packed row with its own prompt
    assert ids.shape[1] == 100 + 2 * 1364 and ids.shape[0] == 3
    assert attend.shape == (3, 1, ids.shape[1], ids.shape[1])


def unpacked(mb: MicroBatch) -> MicroBatch:
    return dataclasses.replace(mb, packed=None)


def reference(model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    """The model's own (B, T, V) logits over the unpacked rows, then the whole log-softmax."""
    from trainer.loss import full_token_logprobs

    logits = model(input_ids=mb.input_ids, use_cache=False).logits
    logp, ent = full_token_logprobs(logits, mb.targets, mb.temperature, with_entropy=True)
    assert ent is not None
    return logp, ent


def weighted(logp: Tensor, mask: Tensor) -> Tensor:
    w = torch.arange(1, logp.numel() + 1, dtype=torch.float32).view_as(logp)
    return (logp * mask * w).sum()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_packed_equals_the_models_own_logits(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if kind == "qwen2":
        path = make_tiny_model(tmp_path / "model")
    else:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)).save_pretrained(
            tmp_path / "model")
        path = tmp_path / "model"
    mb = collate(groups())
    mask = mb.loss_mask
    results = []
    for fn in ("reference", "unpacked", "packed"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert packable(model)
        if fn == "reference":
            logp, ent = reference(model, mb)
        else:
            logp, ent_or_none = forward_logprobs(model, mb if fn == "packed" else unpacked(mb), with_entropy=True)
            assert ent_or_none is not None
            ent = ent_or_none
            assert not logp[mask == 0].any() and not ent[mask == 0].any()  # only loss positions are computed
        weighted(logp, mask).backward()
        results.append((logp * mask, ent * mask, {n: p.grad for n, p in model.named_parameters()}))
    ref_logp, ref_ent, ref_grads = results[0]
    for logp, ent, grads in results[1:]:
        torch.testing.assert_close(logp, ref_logp, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
        for name, g in grads.items():
            expected = ref_grads[name]
            assert g is not None and expected is not None, name
            worst = (g - expected).abs().max().item() / expected.abs().max().item()
            assert worst <= 1e-5, (name, worst)


def test_models_that_cannot_take_the_mask_run_unpacked(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert packable(model)
    model.config.sliding_window, model.config.use_sliding_window = 4, True
    assert not packable(model)
    model.config.use_sliding_window = False
    assert packable(model)
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    assert not packable(eager)
    mb = collate(groups())
    logp, _ = forward_logprobs(eager, mb)  # falls back to the unpacked rows
    ref, _ = reference(eager, mb)
    torch.testing.assert_close(logp * mb.loss_mask, ref * mb.loss_mask, atol=2e-5, rtol=1e-5)


def test_rl_step_moves_the_weights_as_unpacked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    import trainer.step

    path = make_tiny_model(tmp_path / "model")
    start = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = groups(seed=3)
    plan = [Minibatch([rows], normalizer=float(sum(sum(r.loss_mask[1:]) for r in rows)))]
    after = []
    for use_packing in (False, True):
        monkeypatch.setattr(trainer.step, "packable", lambda model, on=use_packing: on)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW's first step is ~lr * sign(g): noise at g ~ 0
        metrics = rl_step(model, opt, plan, PPOParams(), max_grad_norm=1.0, device=torch.device("cpu"))
        assert metrics["loss_tokens"] == plan[0].normalizer
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, p in after[1].items():
        torch.testing.assert_close(p, after[0][name], atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(p, start.get_parameter(n)) for n, p in after[1].items())


def test_packed_under_fsdp_equals_a_plain_model(tiny_model: Path, dist_env: None) -> None:
    # the sharded model (wrapped even at one rank) runs the packed layout: its gradients come back to the shards
    from transformers import AutoModelForCausalLM

    from trainer.fsdp import init_distributed, shard_model

    mb = collate(groups(seed=5))
    assert mb.packed is not None
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ref, _ = reference(plain, mb)
    weighted(ref, mb.loss_mask).backward()
    sharded = shard_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                          init_distributed(force_cpu=True), wrap_one_cpu_rank=True)
    assert packable(sharded)
    got, _ = forward_logprobs(sharded, mb)
    weighted(got, mb.loss_mask).backward()
    torch.testing.assert_close(got * mb.loss_mask, ref * mb.loss_mask, atol=2e-5, rtol=1e-5)
    for name, p in sharded.named_parameters():
        expected = plain.get_parameter(name).grad
        assert p.grad is not None and expected is not None, name
        worst = (p.grad.full_tensor() - expected).abs().max().item() / expected.abs().max().item()
        assert worst <= 1e-5, (name, worst)
