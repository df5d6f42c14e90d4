"""Training samples from stored turns (docs/architecture.md "Leases and training samples").

Per session, turns that extend each other form one sequence: the leaves of the session's turn tree are
its sequences, and each turn's completion carries loss mask 1 in exactly one of them (the first leaf that
contains it), so a branch point is never trained twice. A broken chain starts a new sequence, never a
silent all-zero mask. Returns are the session reward, or per-turn rewards discounted backwards with
gamma when any turn carries one.

A constrained turn (decoded under a grammar: a forced tool_choice, a response_format) has loss mask 0 on its
completion: its tokens were drawn from the grammar-masked distribution, not from the policy the trainer
recomputes, and training on them would push up tokens the policy itself may not have chosen. They stay in
the sequence as context. `train_constrained=True` (the trainer's `train_constrained_turns`, sent with the
lease) trains them anyway, with the masked distribution's logprobs as the behaviour logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.store.store import TurnRow
from rollway_common.wire import encode_array, unpack


@dataclass(slots=True)
class Sequence:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    returns: list[float]
    temperatures: list[float]
    """Per token: the sampling temperature of the turn it belongs to (a client allowed to override it may
    change it between turns; the trainer divides each token's logits by its own)."""

    @property
    def temperature(self) -> float | list[float]:
        """One number when every token shares it (the usual case, and the compact wire form), else the list."""
        first = self.temperatures[0] if self.temperatures else 1.0
        return first if all(t == first for t in self.temperatures) else self.temperatures

    def wire(self, group_id: str, session_id: str, reward: float | None) -> dict[str, Any]:
        temp = self.temperature
        return {
            "group_id": group_id, "session_id": session_id, "reward": reward,
            "temperature": temp if isinstance(temp, float) else encode_array(temp, "float32"),
            "token_ids": encode_array(self.token_ids, "int32"),
            "loss_mask": encode_array(self.loss_mask, "uint8"),
            "logprobs": encode_array(self.logprobs, "float32"),
            "versions": encode_array(self.versions, "int32"),
            "returns": encode_array(self.returns, "float32"),
        }

    @property
    def oldest_version(self) -> int | None:
        vs = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(vs) if vs else None


def turn_returns(chain: list[TurnRow], session_reward: float | None, gamma: float) -> list[float]:
    """Per turn of one chain: the discounted sum of later per-turn rewards, else the session reward."""
    if not any(t.reward is not None for t in chain):
        return [float(session_reward or 0.0)] * len(chain)
    out = [0.0] * len(chain)
    acc = 0.0
    for i in range(len(chain) - 1, -1, -1):
        acc = float(chain[i].reward or 0.0) + gamma * acc
        out[i] = acc
    return out


def session_sequences(
    rows: list[TurnRow], session_reward: float | None, gamma: float, *, train_constrained: bool = False
) -> list[Sequence]:
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
        rets = turn_returns(chain, session_reward, gamma)
        seq = Sequence([], [], [], [], [], [])
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
            seq.returns += [0.0] * len(delta) + [rets[i] if learn else 0.0] * n
            seq.temperatures += [float(turn.temperature)] * (len(delta) + n)
        if any(seq.loss_mask):
            out.append(seq)
    return out
