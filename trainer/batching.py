"""From scored groups to padded tensors: which rank trains which group, in which pass.

Every rank receives the whole step (rank 0 broadcasts it) and computes the same plan:
groups -> `optimizer_steps` minibatches (whole groups, balanced by tokens) -> in each minibatch, the
data-parallel ranks (whole groups, balanced by tokens) -> per rank, micro-batches of at most
`micro_batch_tokens` padded tokens. Every rank runs the same number of passes per minibatch (FSDP's
collectives must line up): a rank with fewer gets empty micro-batches, which train nothing.

Rows are right-padded; with causal attention, padding after a row's end changes none of its logits,
so no attention mask is needed.

Shared prompts are computed once (`Packed`): the rows of a group start with the same prompt, and up to its
first loss token every row's hidden states are the same. `collate` also lays the micro-batch out as packed rows
`[prompt, suffix_1, suffix_2, ...]`, each suffix attending to the prompt and to itself only (a 4D mask) at its
own positions (position ids continue the prompt's), and records where in that layout each loss position's
hidden state is. The trainer uses it when the model can take such a mask (`trainer.step.packable`): on the
demo's task (13-token prompts, 1-8 token answers, 8 samples a group) a step's forward/backward computes ~360
tokens instead of ~1,090. Same tokens, same positions, same attended keys per query: the logprobs and gradients
equal the unpacked ones within float rounding (tests/trainer/test_packing.py).
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


PACK_MAX_LEN = 4096
"""Longest packed row. A packed row's mask is (L, L) and its attention is computed over the whole row (the mask
skips nothing), so a group whose prompt and suffixes exceed this is split over several packed rows, each with its
own copy of the prompt. A micro-batch with a row longer than this is not packed at all: its packed row would need
a dense mask of the square of its length (forward + backward of a 16k-token row: ~1.3 GiB with the mask against
~27 MiB under plain causal attention, torch 2.13 on CPU), while unpacked rows run with causal attention and no
mask, memory linear in length. Such a row is alone in its micro-batch or nearly so (`micro_batches`), so there is
little prompt to share there anyway."""


@dataclass
class Packed:
    """A micro-batch's rows with their shared prompts computed once (see the module docstring)."""

    input_ids: Tensor  # (Bp, Lp)
    position_ids: Tensor  # (Bp, Lp)
    attend: Tensor  # (Bp, 1, Lp, Lp) bool: query i attends key j
    source: Tensor  # (N,) for each loss position of the micro-batch (in `loss_index` order): its index in (Bp * Lp)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())


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
    loss_index: Tensor | None = None
    """(N,) the positions (in B * T) where loss_mask > 0: the only ones the trainer computes logprobs for."""
    packed: Packed | None = None
    """The same rows with shared prompts once; None when no two rows share one."""

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
    loss_mask = mask[:, 1:]
    loss_index = torch.nonzero(loss_mask.reshape(-1) > 0).reshape(-1)
    packed = pack(rows, loss_mask > 0)
    return MicroBatch(
        input_ids=ids[:, :-1].to(device),
        targets=ids[:, 1:].to(device),
        loss_mask=loss_mask.to(device),
        behaviour_logprobs=behav[:, 1:].to(device),
        advantages=adv[:, 1:].to(device),
        temperature=temp[:, 1:].to(device),
        token_weight=weight[:, 1:].to(device),
        loss_index=loss_index.to(device),
        packed=None if packed is None else Packed(*(x.to(device) for x in packed)),
    )


def _first_loss(row: Row) -> int | None:
    """Index of the row's first loss token (never token 0, which nothing scores), None if it has none."""
    for i in range(1, len(row.loss_mask)):
        if row.loss_mask[i]:
            return i
    return None


def pack(rows: list[Row], trained: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """The packed layout of `rows` (`trained`: collate's (B, T) loss positions): (input_ids, position_ids, attend, source),
    or None when no two rows share their prompt (then packing saves nothing) or a row is longer than PACK_MAX_LEN.

    A row's prompt is its tokens before its first loss token; the hidden state at the prompt's last position scores
    that token, so it is shared too. A suffix is the rest of the row's inputs (its last token is no input). Rows
    with no loss token are left out: nothing of theirs is computed.
    """
    if any(len(r.token_ids) - 1 > PACK_MAX_LEN for r in rows):
        return None  # a dense mask quadratic in that row's length (see PACK_MAX_LEN)
    clusters: dict[tuple[int, ...], list[int]] = {}
    for b, r in enumerate(rows):
        first = _first_loss(r)
        if first is not None:
            clusters.setdefault(tuple(r.token_ids[:first]), []).append(b)
    if all(len(members) < 2 for members in clusters.values()):
        return None
    # packed rows: (prompt, [(row, suffix start in the packed row)]), split at PACK_MAX_LEN
    layout: list[tuple[tuple[int, ...], list[tuple[int, int]]]] = []
    for prompt, members in clusters.items():
        p = len(prompt)
        current: list[tuple[int, int]] = []
        end = p
        for b in members:
            n = len(rows[b].token_ids) - 1 - p  # this suffix's inputs
            if current and end + n > PACK_MAX_LEN:
                layout.append((prompt, current))
                current, end = [], p
            current.append((b, end))
            end += n
        layout.append((prompt, current))
    lengths = [len(prompt) + sum(len(rows[b].token_ids) - 1 - len(prompt) for b, _ in placed)
               for prompt, placed in layout]
    lp = max(lengths)
    ids = torch.zeros(len(layout), lp, dtype=torch.long)
    pos = torch.zeros(len(layout), lp, dtype=torch.long)
    attend = torch.eye(lp, dtype=torch.bool).repeat(len(layout), 1, 1)  # padding attends to itself only
    source = torch.full(trained.shape, -1, dtype=torch.long)  # (row, t) -> index in Bp * Lp, where needed
    for k, (prompt, placed) in enumerate(layout):
        p = len(prompt)
        ids[k, :p] = torch.tensor(prompt, dtype=torch.long)
        pos[k, :p] = torch.arange(p)
        attend[k, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        for b, start in placed:
            suffix = rows[b].token_ids[p:-1]
            n = len(suffix)
            if n:
                ids[k, start:start + n] = torch.tensor(suffix, dtype=torch.long)
                pos[k, start:start + n] = torch.arange(p, p + n)
                attend[k, start:start + n, :p] = True
                attend[k, start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            source[b, p - 1] = k * lp + p - 1  # the prompt's last position scores the first loss token
            source[b, p:p + n] = torch.arange(k * lp + start, k * lp + start + n)
    src = source[trained]
    assert bool((src >= 0).all()), "a loss position outside the packed layout"
    return ids, pos, attend.unsqueeze(1), src
