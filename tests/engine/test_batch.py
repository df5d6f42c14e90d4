"""The batched KV cache against plain forward passes: left-padded prefill, joins, leaves, decode steps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.batch import DecodeBatch, prefill

SEQS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18], [40], [90, 91, 92, 93, 94]]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    # Scoped to each test: a process-wide set_grad_enabled(False) would leak into the trainer's tests.
    with torch.no_grad():
        yield


def last_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]


def test_rows_join_step_and_leave_like_separate_sequences(model: PreTrainedModel) -> None:
    running, first = prefill(model, SEQS[:2])  # two rows of different lengths, left-padded together
    for row, seq in enumerate(SEQS[:2]):
        assert (first[row] - last_logits(model, seq)).abs().max() <= 1e-4
    seqs = [list(s) for s in SEQS[:2]]
    for step in range(6):
        if step == 2:  # two more rows join mid-way, one longer than the running width
            joined, _ = prefill(model, SEQS[2:])
            running.extend(joined)
            seqs += [list(s) for s in SEQS[2:]]
        if step == 4:  # the second row leaves
            running.keep([0, 2, 3])
            del seqs[1]
        next_tokens = [100 + step + i for i in range(len(seqs))]
        logits = model(**running.step_inputs(next_tokens)).logits[:, -1]
        running.stepped()
        for row, seq in enumerate(seqs):
            seq.append(next_tokens[row])
            assert not torch.isnan(logits[row]).any()
            assert (logits[row] - last_logits(model, seq)).abs().max() <= 1e-4, (step, row)
        assert running.lengths == [len(s) for s in seqs]
        assert running.width == max(running.lengths)  # padding no row needs is cut


def test_empty_batch_takes_rows(model: PreTrainedModel) -> None:
    batch = DecodeBatch()
    joined, _ = prefill(model, [SEQS[0]])
    batch.extend(joined)
    assert batch.lengths == [3]
    batch.keep([])
    assert len(batch) == 0 and batch.cache is None


def test_identical_sequences_are_computed_once_and_decode_like_separate_ones(model: PreTrainedModel) -> None:
    seqs = [SEQS[1], SEQS[0], SEQS[1], SEQS[1], SEQS[3], SEQS[0]]  # 3 distinct among 6 rows
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, args, kw: calls.append(kw["input_ids"].shape[0]),
                                             with_kwargs=True)
    try:
        running, first = prefill(model, seqs)
    finally:
        handle.remove()
    assert calls == [3]  # one forward over the distinct sequences
    assert running.lengths == [len(s) for s in seqs]
    for row, seq in enumerate(seqs):
        assert (first[row] - last_logits(model, seq)).abs().max() <= 1e-4
    grown = [list(s) for s in seqs]
    for step in range(3):  # the copied rows decode on their own, with different tokens
        next_tokens = [200 + 7 * step + i for i in range(len(seqs))]
        logits = model(**running.step_inputs(next_tokens)).logits[:, -1]
        running.stepped()
        for row, seq in enumerate(grown):
            seq.append(next_tokens[row])
            assert (logits[row] - last_logits(model, seq)).abs().max() <= 1e-4, (step, row)
