"""The store's typed reads for the viewer (gateway/store/views.py), on SQLite and PostgreSQL (the `db_url`
fixture): the dialect-specific SQL the viewer used to hold gives the same answers on both, and the store's
eval figures stay finite whatever rewards a store holds."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import select

from gateway.store.db import create_engine
from gateway.store.models import TurnRecord
from gateway.store.store import Store
from gateway.store.views import (
    G,
    LightTurn,
    RateBucket,
    RewardBucket,
    finished_by_clock,
    in_version,
    light_turns,
    mean_std,
    reward_by_clock,
)
from rollway_common.wire import pack


def turn(turn_id: str, parent: str | None, messages: list[dict[str, Any]]) -> TurnRecord:
    return TurnRecord(id=turn_id, parent_id=parent, endpoint="chat",
                request={"messages": messages, "sampling": {"temperature": 0.5}, "asked": {"n": 1}},
                reply={"role": "assistant", "content": "2"}, prompt_ids=pack([1, 2, 3], "int32"), prompt_len=3,
                completion_ids=pack([4, 5], "int32"), logprobs=pack([-0.5, -0.5], "float32"),
                versions=pack([0, 0], "int32"), temperature=1.0, finish_reason="stop",
                continuity="extends" if parent else "new-chain", chain_reason=None, client_disconnected=False,
                timings={})


async def test_eval_summary_is_finite_with_huge_rewards(db_url: str) -> None:
    """Rewards past what the REST API takes (a store written before it refused them): a plain sum was inf."""
    store = Store(create_engine(db_url))
    await store.open()
    try:
        _, creds = await store.create_group("x", 2, sampling={}, metadata={"eval_version": 7}, is_eval=True)
        for sid, _ in creds:
            await store.set_reward(sid, 1e308, None, finish=True)
        summary = (await store.eval_summary())["7"]
        assert math.isfinite(summary["mean_reward"]) and summary["mean_reward"] == 1e308
        assert summary["pass_at_k"] == 1.0 and summary["groups"] == 1.0
    finally:
        await store.close()


def test_mean_std_is_finite_where_a_plain_mean_is_not() -> None:
    assert sum([1e308, 1e308]) / 2 == math.inf
    assert mean_std([1e308, 1e308]) == (1e308, 0.0)
    assert mean_std([1.0, 3.0]) == (2.0, 1.0)
    assert mean_std([]) is None


async def test_the_viewers_reads_answer_alike_on_both_stores(db_url: str) -> None:
    store = Store(create_engine(db_url))
    await store.open()
    try:
        gid, creds = await store.create_group("x", 2, sampling={}, metadata={"eval_version": 3}, is_eval=True)
        trained, tcreds = await store.create_group("y", 2, sampling={})
        (a, _), (b, _) = tcreds
        user = {"role": "user", "content": "1+1"}
        await store.insert_turn(a, turn(f"t1-{a}", None, [user]))
        await store.insert_turn(a, turn(f"t2-{a}", f"t1-{a}", [user, {"role": "assistant", "content": "2"},
                                                               {"role": "user", "content": "again"}]))
        for sid, r in ((a, 1.0), (b, 0.0), (creds[0][0], 0.5), (creds[1][0], 0.5)):
            await store.set_reward(sid, r, None, finish=True)
        turns = await light_turns(store.engine, a)
        assert [type(t) for t in turns] == [LightTurn, LightTurn]
        assert turns[0].sampling == {"temperature": 0.5} and turns[0].asked == {"n": 1}
        assert turns[0].completion_len == 2 and turns[0].new_messages == [user]
        # the second turn shows only what its parent's request and reply did not have
        assert turns[1].first_new == 2 and turns[1].new_messages == [{"role": "user", "content": "again"}]
        async with store.engine.connect() as conn:
            rewards = await reward_by_clock(conn)
            rates = await finished_by_clock(conn)
            found = (await conn.execute(select(G.c.id).where(in_version(store.engine, 3)))).scalars().all()
        assert all(isinstance(x, RewardBucket) for x in rewards) and sum(x.sessions for x in rewards) == 2
        assert sum(x.mean * x.sessions for x in rewards if x.mean is not None) == 1.0  # the training group only
        assert all(isinstance(x, RateBucket) and x.per_s > 0 for x in rates)
        assert gid in found and trained not in found
    finally:
        await store.close()
