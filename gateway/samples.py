"""Training samples from stored turns (docs/architecture.md "Leases and training samples").

Per session, turns that extend each other form one sequence: the leaves of the session's turn tree are
its sequences, and each turn's completion carries loss mask 1 in exactly one of them (the first leaf that
contains it), so a branch point is never trained twice. A broken chain starts a new sequence, never a
silent all-zero mask. Each sequence carries its turns' boundaries (`turn_ends`, `completion_starts`) and
per-turn rewards: the trainer computes returns from them (lease format 2, docs/http-api.md "POST /v1/batches").
Per-token returns (the session reward, or per-turn rewards discounted backwards with the gateway's deprecated
`gamma` when any turn carries one) are built here only for a trainer that asks for lease format 1.

A constrained turn (decoded under a grammar: a forced tool_choice, a response_format) has loss mask 0 on its
completion: its tokens were drawn from the grammar-masked distribution, not from the policy the trainer
recomputes, and training on them would push up tokens the policy itself may not have chosen. They stay in
the sequence as context. `train_constrained=True` (the trainer's `train_constrained_turns`, sent with the
lease) trains them anyway, with the masked distribution's logprobs as the behaviour logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.store.leases import LeaseRequest
from gateway.store.store import TurnRow
from rollway_common.wire import LEASE_FORMAT, encode_array, turn_returns, unpack


@dataclass(slots=True)
class Sequence:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    temperatures: list[float]
    """Per token: the sampling temperature of the turn it belongs to (a client allowed to override it may
    change it between turns; the trainer divides each token's logits by its own)."""
    turn_ends: list[int]
    """Per turn of the chain: the index after its last token (its prompt delta, then its completion)."""
    completion_starts: list[int]
    """Per turn of the chain: the index of its completion's first token."""
    turn_rewards: list[float | None]
    """Per turn of the chain: its own reward (`POST /v1/sessions/{id}/reward` with `turn_rewards`), or None."""

    @property
    def temperature(self) -> float | list[float]:
        """One number when every token shares it (the usual case, and the compact wire form), else the list."""
        first = self.temperatures[0] if self.temperatures else 1.0
        return first if all(t == first for t in self.temperatures) else self.temperatures

    def wire(self, group_id: str, session_id: str, reward: float | None, lease_format: int = LEASE_FORMAT,
             gamma: float = 1.0) -> dict[str, Any]:
        """The sample as a lease carries it: format 2 with the turns, format 1 with per-token returns."""
        temp = self.temperature
        out: dict[str, Any] = {
            "group_id": group_id, "session_id": session_id, "reward": reward,
            "temperature": temp if isinstance(temp, float) else encode_array(temp, "float32"),
            "token_ids": encode_array(self.token_ids, "int32"),
            "loss_mask": encode_array(self.loss_mask, "uint8"),
            "logprobs": encode_array(self.logprobs, "float32"),
            "versions": encode_array(self.versions, "int32"),
        }
        if lease_format == 1:
            out["returns"] = encode_array(self.returns(reward, gamma), "float32")
        else:
            out["turn_ends"] = encode_array(self.turn_ends, "int32")
            out["completion_starts"] = encode_array(self.completion_starts, "int32")
            out["turn_rewards"] = self.turn_rewards
        return out

    def returns(self, session_reward: float | None, gamma: float) -> list[float]:
        """Lease format 1's per-token returns: each loss token gets its turn's return (`turn_returns`), every other
        token 0."""
        rets = turn_returns(self.turn_rewards, session_reward, gamma)
        out: list[float] = []
        start = 0
        for cstart, end, ret in zip(self.completion_starts, self.turn_ends, rets, strict=True):
            # a turn's mask is 0 on its prompt delta and one value on its whole completion
            learned = end > cstart and self.loss_mask[cstart]
            out += [0.0] * (cstart - start) + [ret if learned else 0.0] * (end - cstart)
            start = end
        return out

    @property
    def oldest_version(self) -> int | None:
        vs = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(vs) if vs else None



def session_sequences(rows: list[TurnRow], *, train_constrained: bool = False) -> list[Sequence]:
    by_id = {r.id: r for r in rows}
    extended = {r.parent_id for r in rows if r.parent_id}
    leaves = [r for r in rows if r.id not in extended]
    trained: set[str] = set()
    out: list[Sequence] = []
    for leaf in leaves:
        chain: list[TurnRow] = []
        node: TurnRow | None = leaf
        while node is not None:
            chain.append(node)
            node = by_id.get(node.parent_id) if node.parent_id else None
        chain.reverse()
        seq = Sequence([], [], [], [], [], [], [], [])
        for i, turn in enumerate(chain):
            delta: list[int] = unpack(turn.prompt_ids, "int32")  # type: ignore[assignment]
            completion: list[int] = unpack(turn.completion_ids, "int32")  # type: ignore[assignment]
            n = len(completion)
            # A client-disconnected partial is trained only when a later turn extends it
            # (docs/architecture.md "Leases and training samples").
            learn = turn.id not in trained and (not turn.client_disconnected or i < len(chain) - 1)
            learn = learn and (train_constrained or not turn.constrained)
            trained.add(turn.id)
            seq.token_ids += delta + completion
            seq.loss_mask += [0] * len(delta) + [1 if learn else 0] * n
            seq.logprobs += [0.0] * len(delta) + (unpack(turn.logprobs, "float32") if learn else [0.0] * n)  # type: ignore[operator]
            seq.versions += [-1] * len(delta) + (unpack(turn.versions, "int32") if learn else [-1] * n)  # type: ignore[operator]
            seq.temperatures += [float(turn.temperature)] * (len(delta) + n)
            seq.completion_starts.append(len(seq.token_ids) - n)
            seq.turn_ends.append(len(seq.token_ids))
            seq.turn_rewards.append(None if turn.reward is None else float(turn.reward))
        if any(seq.loss_mask):
            out.append(seq)
    return out


DEPRECATED_GAMMA = (
    "the gateway's gamma (ROLLWAY_GAMMA=%g) is deprecated: returns are computed by the trainer (`rollway train "
    "--gamma`). It still discounts the returns of lease format 1 (a trainer that asks for no lease_format) and is "
    "sent with format 2's leases, which a trainer without its own gamma uses")


class LeaseSamples:
    """The lease's sample builder (`gateway.store.leases.SampleBuilder`): a finished session's sequences in the
    wire shape the lease request asked for, each with its oldest trained weight version (the η check)."""

    def __init__(self, gamma: float = 1.0) -> None:
        self.gamma = gamma
        """The gateway's deprecated `gamma` setting: the discount of lease format 1's returns only."""

    def __call__(self, group_id: str, session_id: str, reward: float | None, turns: list[TurnRow],
                 req: LeaseRequest) -> list[tuple[dict[str, Any], int | None]]:
        return [(seq.wire(group_id, session_id, reward, req.lease_format, self.gamma), seq.oldest_version)
                for seq in session_sequences(turns, train_constrained=req.train_constrained)]
