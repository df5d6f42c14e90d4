"""The loss mask of constrained turns (gateway/samples.py): a turn decoded under a grammar keeps its tokens as
context but out of the loss, unless `train_constrained` asks for them."""

from __future__ import annotations

from typing import Any

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from rollway_common.wire import pack


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
    (seq,) = session_sequences(ROWS)
    assert seq.token_ids == [1, 2, 10, 11, 3, 20, 21, 22]
    assert seq.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0]
    assert seq.versions == [-1, -1, 3, 3, -1, -1, -1, -1]
    assert seq.logprobs[5:] == [0.0, 0.0, 0.0]


def test_train_constrained_puts_it_back() -> None:
    (seq,) = session_sequences(ROWS, train_constrained=True)
    assert seq.loss_mask == [0, 0, 1, 1, 0, 1, 1, 1]
    assert seq.logprobs[5:] == [-0.5, -0.5, -0.5] and seq.returns(1.0, 1.0)[5:] == [1.0, 1.0, 1.0]


def test_a_session_of_constrained_turns_only_gives_no_sample() -> None:
    assert session_sequences([turn("c", None, [1], [5], constrained=True)]) == []


def test_migration_0002_matches_the_model(db_url: str) -> None:
    """Alembic finds nothing to change for turns.constrained between the migrated store and the models."""
    import asyncio

    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from gateway.store.db import create_engine
    from gateway.store.models import Base

    def compare(conn: Any) -> tuple[list[Any], list[str]]:
        columns = [c["name"] for c in sa.inspect(conn).get_columns("turns")]
        return compare_metadata(MigrationContext.configure(conn), Base.metadata), columns

    async def run() -> tuple[list[Any], list[str]]:
        engine = create_engine(db_url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(compare)  # type: ignore[no-any-return]
        finally:
            await engine.dispose()

    diff, columns = asyncio.run(run())
    assert "constrained" in columns
    assert [d for d in diff if "constrained" in repr(d)] == []
