"""From scored groups to padded tensors: which rank trains which group, in which pass.

Every rank receives the whole step (rank 0 broadcasts it) and computes the same plan:
groups -> `optimizer_steps` minibatches (whole groups, balanced by tokens) -> in each minibatch, the
data-parallel ranks (whole groups, balanced by tokens) -> per rank, micro-batches of at most
`micro_batch_tokens` padded tokens. Every rank runs the same number of passes per minibatch (FSDP's
collectives must line up): a rank with fewer gets empty micro-batches, which train nothing.

Rows are right-padded; with causal attention, padding after a row's end changes none of its logits,
so no attention mask is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.advantages import ScoredGroup


@dataclass
class Row:
    """One training sequence; every list has the sequence's length."""

    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantages: list[float]
    temperature: list[float]

    @property
    def n_loss_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m)


def rows_of(group: ScoredGroup) -> list[Row]:
    rows = []
    for s, adv in zip(group.samples, group.advantages, strict=True):
        n = len(s.token_ids)
        temp = s.temperature if isinstance(s.temperature, list) else [float(s.temperature)] * n
        temp = [t if t > 0 else 1.0 for t in temp]  # greedy turns: the server reports T = 1 logprobs
        rows.append(Row(list(s.token_ids), [int(m) for m in s.loss_mask], list(s.logprobs), adv, temp))
    return rows


def balanced_split(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices of `sizes` into `parts` lists with near-equal sums: largest first onto the lightest part
    (LPT). Deterministic (ties by index), and each part keeps its indices in ascending order."""
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(parts), key=lambda k: (loads[k], k))
        out[k].append(i)
        loads[k] += sizes[i]
    return [sorted(p) for p in out]


def micro_batches(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """Longest first; a micro-batch grows while rows x its longest row stays within max_tokens."""
    out: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: -len(r.token_ids)):
        if out and (len(out[-1]) + 1) * len(out[-1][0].token_ids) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


@dataclass
class Minibatch:
    micro: list[list[Row]]
    """This rank's micro-batches; an empty list is a pass that trains nothing (keeps ranks in step)."""
    normalizer: float
    """Loss tokens (token_mean) or sequences (seq_mean) in the minibatch over all ranks."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"


def plan_step(
    rows_by_group: list[list[Row]],
    *,
    world_size: int,
    rank: int,
    optimizer_steps: int,
    micro_batch_tokens: int,
    loss_agg: Literal["token_mean", "seq_mean"],
) -> list[Minibatch]:
    """This rank's share of a step; `rows_by_group` keeps each group's rows together (never split)."""
    tokens = [sum(len(r.token_ids) for r in rows) for rows in rows_by_group]
    plan = []
    for mb_groups in balanced_split(tokens, optimizer_steps):
        if not mb_groups:  # fewer groups than optimizer steps: no empty step (AdamW would still move)
            continue
        mb_rows = [r for gi in mb_groups for r in rows_by_group[gi]]
        if loss_agg == "token_mean":
            normalizer = float(sum(r.n_loss_tokens for r in mb_rows))
        else:
            normalizer = float(len(mb_rows))
        per_rank = balanced_split([tokens[gi] for gi in mb_groups], world_size)
        micro_per_rank = [
            micro_batches([r for j in part for r in rows_by_group[mb_groups[j]]], micro_batch_tokens)
            for part in per_rank
        ]
        n_passes = max(1, *(len(m) for m in micro_per_rank))
        mine = micro_per_rank[rank]
        plan.append(
            Minibatch(mine + [[] for _ in range(n_passes - len(mine))], max(normalizer, 1.0), loss_agg)
        )
    return plan


@dataclass
class MicroBatch:
    """Padded tensors; the targets are shifted: position t of every (B, T) field scores token t+1."""

    input_ids: Tensor  # (B, T) = token_ids[:, :-1]
    targets: Tensor  # (B, T) = token_ids[:, 1:]
    loss_mask: Tensor  # (B, T) float
    behaviour_logprobs: Tensor  # (B, T)
    advantages: Tensor  # (B, T)
    temperature: Tensor  # (B, T)
    token_weight: Tensor  # (B, T): token_mean 1; seq_mean 1 / loss tokens of the row (see loss.py)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())


def collate(
    rows: list[Row],
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean",
    device: torch.device | str = "cpu",
) -> MicroBatch:
    """Right-padded tensors; an empty `rows` gives one 2-token row with no loss tokens (a no-op pass)."""
    if not rows:
        rows = [Row([0, 0], [0, 0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0])]
    length = max(len(r.token_ids) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, length, dtype=torch.long)
    mask = torch.zeros(b, length)
    behav = torch.zeros(b, length)
    adv = torch.zeros(b, length)
    temp = torch.ones(b, length)
    weight = torch.ones(b, length)
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        ids[i, :n] = torch.tensor(r.token_ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        behav[i, :n] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        adv[i, :n] = torch.tensor(r.advantages, dtype=torch.float32)
        temp[i, :n] = torch.tensor(r.temperature, dtype=torch.float32)
        if loss_agg == "seq_mean":
            weight[i, :] = 1.0 / max(r.n_loss_tokens, 1)
    mask[:, 0] = 0.0  # the first token has no context to be scored from
    return MicroBatch(
        input_ids=ids[:, :-1].to(device),
        targets=ids[:, 1:].to(device),
        loss_mask=mask[:, 1:].to(device),
        behaviour_logprobs=behav[:, 1:].to(device),
        advantages=adv[:, 1:].to(device),
        temperature=temp[:, 1:].to(device),
        token_weight=weight[:, 1:].to(device),
    )
