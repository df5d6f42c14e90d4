"""The loss mask of constrained turns (gateway/samples.py): a turn decoded under a grammar keeps its tokens as
context but out of the loss, unless `train_constrained` asks for them."""

from __future__ import annotations

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from gateway.wire import pack


def turn(tid: str, parent: str | None, prompt: list[int], completion: list[int], *, constrained: bool) -> TurnRow:
    n = len(completion)
    return TurnRow(
        id=tid, seq=0, parent_id=parent, request={}, reply={}, prompt_ids=pack(prompt, "int32"),
        completion_ids=pack(completion, "int32"), logprobs=pack([-0.5] * n, "float32"),
        versions=pack([3] * n, "int32"), temperature=1.0, finish_reason="stop", continuity="extends",
        chain_reason=None, client_disconnected=False, reward=None, prompt_len=len(prompt), timings={},
        constrained=constrained,
    )


ROWS = [turn("a", None, [1, 2], [10, 11], constrained=False), turn("b", "a", [3], [20, 21, 22], constrained=True)]


def test_a_constrained_turn_is_out_of_the_loss() -> None:
    (seq,) = session_sequences(ROWS, 1.0, 1.0)
    assert seq.token_ids == [1, 2, 10, 11, 3, 20, 21, 22]
    assert seq.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0]
    assert seq.versions == [-1, -1, 3, 3, -1, -1, -1, -1]
    assert seq.logprobs[5:] == [0.0, 0.0, 0.0]


def test_train_constrained_puts_it_back() -> None:
    (seq,) = session_sequences(ROWS, 1.0, 1.0, train_constrained=True)
    assert seq.loss_mask == [0, 0, 1, 1, 0, 1, 1, 1]
    assert seq.logprobs[5:] == [-0.5, -0.5, -0.5] and seq.returns[5:] == [1.0, 1.0, 1.0]


def test_a_session_of_constrained_turns_only_gives_no_sample() -> None:
    assert session_sequences([turn("c", None, [1], [5], constrained=True)], 1.0, 1.0) == []
