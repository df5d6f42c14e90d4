"""Balanced split of whole groups over ranks, micro-batching, and the shifted padded tensors."""

from __future__ import annotations

import torch

from trainer.batching import Row, balanced_split, collate, micro_batches, plan_step


def row(n: int, n_loss: int = 1) -> Row:
    mask = [0] * (n - n_loss) + [1] * n_loss
    return Row(list(range(1, n + 1)), mask, [-0.5] * n, [1.0] * n, [1.0] * n)


def test_balanced_split_by_tokens() -> None:
    # sizes 10, 7, 5, 4, 2 over 2 parts, largest first onto the lighter part:
    # 10 -> A(10); 7 -> B(7); 5 -> B(12); 4 -> A(14); 2 -> B(14). A = {0, 3}, B = {1, 2, 4}, sums 14 / 14.
    assert balanced_split([10, 7, 5, 4, 2], 2) == [[0, 3], [1, 2, 4]]
    assert balanced_split([3], 2) == [[0], []]


def test_micro_batches_respect_the_token_budget() -> None:
    # lengths 8, 5, 4, 4, 3 with budget 12, longest first: [8] (2 x 8 = 16 > 12), [5, 4] (2 x 5 = 10;
    # a third row would make 3 x 5 = 15 > 12), then [4, 3] (2 x 4 = 8).
    mbs = micro_batches([row(5), row(8), row(4), row(3), row(4)], 12)
    assert [[len(r.token_ids) for r in mb] for mb in mbs] == [[8], [5, 4], [4, 3]]


def test_plan_keeps_ranks_in_step_and_groups_whole() -> None:
    # Group 0: one row of 20 tokens; group 1: two rows of 4. Two ranks: group 0 -> rank 0, group 1 -> rank 1.
    # With a budget of 8 tokens rank 1 needs one pass ([4, 4]), rank 0 one ([20] alone): same count.
    groups = [[row(20, 3)], [row(4, 2), row(4, 2)]]
    p0 = plan_step(
        groups, world_size=2, rank=0, optimizer_steps=1, micro_batch_tokens=8, loss_agg="token_mean"
    )
    p1 = plan_step(
        groups, world_size=2, rank=1, optimizer_steps=1, micro_batch_tokens=4, loss_agg="token_mean"
    )
    assert [len(r.token_ids) for r in p0[0].micro[0]] == [20]
    # budget 4 on rank 1: [4], [4] -> 2 passes; normaliser = loss tokens of the whole step = 3 + 2 + 2 = 7
    assert len(p1[0].micro) == 2 and p1[0].normalizer == 7
    # a rank with fewer passes gets empty (no-op) micro-batches so FSDP's collectives line up
    p0b = plan_step(
        groups, world_size=2, rank=0, optimizer_steps=1, micro_batch_tokens=4, loss_agg="token_mean"
    )
    assert len(p0b[0].micro) == 2 and p0b[0].micro[1] == []
    # seq_mean normalises by sequences: 3
    seq = plan_step(
        groups, world_size=2, rank=0, optimizer_steps=1, micro_batch_tokens=8, loss_agg="seq_mean"
    )
    assert seq[0].normalizer == 3


def test_plan_splits_minibatches_by_group() -> None:
    groups = [[row(6)], [row(6)], [row(6)]]
    plan = plan_step(
        groups, world_size=1, rank=0, optimizer_steps=2, micro_batch_tokens=100, loss_agg="token_mean"
    )
    assert [sum(len(mb) for mb in m.micro) for m in plan] == [2, 1]
    # more optimizer steps than groups: no empty step
    assert (
        len(
            plan_step(
                groups[:1],
                world_size=1,
                rank=0,
                optimizer_steps=3,
                micro_batch_tokens=100,
                loss_agg="token_mean",
            )
        )
        == 1
    )


def test_collate_shifts_and_pads() -> None:
    # row a: ids [1, 2, 3], mask [0, 1, 1]; row b: ids [1, 2], mask [0, 1]. Position t scores token t + 1:
    # b is padded to [1, 2, 0]; input = ids[:, :-1] = [[1, 2], [1, 2]], targets = ids[:, 1:] = [[2, 3], [2, 0]],
    # mask = mask[:, 1:] = [[1, 1], [1, 0]] (padding never trains).
    a = Row([1, 2, 3], [0, 1, 1], [0.0, -1.0, -2.0], [0.0, 0.5, 0.5], [1.0, 0.7, 0.7])
    b = Row([1, 2], [0, 1], [0.0, -3.0], [0.0, -1.0], [1.0, 1.0])
    mb = collate([a, b], loss_agg="seq_mean")
    assert mb.input_ids.tolist() == [[1, 2], [1, 2]]
    assert mb.targets.tolist() == [[2, 3], [2, 0]]
    assert mb.loss_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb.behaviour_logprobs.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]
    assert torch.allclose(mb.temperature, torch.tensor([[0.7, 0.7], [1.0, 1.0]]))
    assert mb.token_weight[:, 0].tolist() == [0.5, 1.0]  # 1 / loss tokens of the row
    empty = collate([])
    assert empty.loss_mask.sum() == 0
