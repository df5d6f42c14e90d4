"""`LoopBatch`: the calls of one turn of the event loop run back to back, each with its own result or error, a
cancelled caller's call not run; and through a live gateway, concurrent sessions' prompts batched that way are
each their own conversation's exact tokens, stored as before (first turns new chains, second turns extending)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from gateway.loop_batch import LoopBatch
from gateway.services import app_serving
from tests.fakes.sglang import FakeSGLang
from tests.gateway.template_calls import extension_ids, render_ids
from tests.harness import LiveGateway


async def test_calls_of_one_loop_turn_run_back_to_back_in_order() -> None:
    batch = LoopBatch(asyncio.get_running_loop())
    ran: list[int] = []

    def work(i: int) -> int:
        ran.append(i)
        return i * 10

    futures = [batch.run(work, i) for i in range(5)]
    assert ran == []  # not before this turn of the loop ends
    assert await asyncio.gather(*futures) == [0, 10, 20, 30, 40]
    assert ran == [0, 1, 2, 3, 4]
    assert (batch.batches, batch.calls) == (1, 5)
    assert await batch.run(work, 7) == 70  # a later call: a batch of its own
    assert (batch.batches, batch.calls) == (2, 6)


async def test_calls_from_concurrent_tasks_share_a_batch() -> None:
    batch = LoopBatch()  # no loop given: each call's running loop

    async def caller(i: int) -> int:
        await asyncio.sleep(0)
        return await batch.run(lambda: i + 1)

    assert await asyncio.gather(*(caller(i) for i in range(8))) == list(range(1, 9))
    assert batch.batches == 1 and batch.calls == 8


async def test_an_error_goes_to_its_own_caller_only() -> None:
    batch = LoopBatch(asyncio.get_running_loop())

    def work(i: int) -> int:
        if i == 1:
            raise ValueError("bad call")
        return i

    results = await asyncio.gather(*(batch.run(work, i) for i in range(3)), return_exceptions=True)
    assert results[0] == 0 and results[2] == 2
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad call"


async def test_a_cancelled_caller_is_not_run() -> None:
    batch = LoopBatch(asyncio.get_running_loop())
    ran: list[str] = []
    kept = batch.run(ran.append, "kept")
    dropped = batch.run(ran.append, "dropped")
    dropped.cancel()
    await kept
    assert ran == ["kept"]
    assert dropped.cancelled()


async def test_a_keyboard_interrupt_cancels_the_calls_not_yet_run() -> None:
    loop = asyncio.get_running_loop()
    batch = LoopBatch(loop)

    def interrupt() -> None:
        raise KeyboardInterrupt

    first = batch.run(lambda: 1)
    batch.run(interrupt)
    last = batch.run(lambda: 3)
    with pytest.raises(KeyboardInterrupt):
        batch._flush(batch._pending)  # as the loop would run it; the callback it scheduled then finds no batch
    assert first.result() == 1
    assert last.cancelled()
    await asyncio.sleep(0)


def test_one_batch_object_serves_loop_after_loop() -> None:
    batch = LoopBatch()

    async def one(i: int) -> int:
        return await batch.run(lambda: i)

    assert asyncio.run(one(1)) == 1
    assert asyncio.run(one(2)) == 2  # a new loop: a new batch, nothing left from the closed one


def test_a_batch_left_on_a_closed_loop_does_not_hold_up_the_next() -> None:
    batch = LoopBatch()
    old = asyncio.new_event_loop()
    old.call_soon(lambda: batch.run(lambda: 1))  # queued: its flush comes after the stop below
    old.call_soon(old.stop)
    old.run_forever()
    old.close()
    assert len(batch._pending) == 1  # left behind, its flush never run

    async def one() -> int:
        return await asyncio.wait_for(batch.run(lambda: 2), 5)  # would wait forever if it joined that batch

    assert asyncio.run(one()) == 2


# --- through a live gateway --------------------------------------------------------------------------------------

SESSIONS = 24


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Any, sqlite_url: str) -> Any:
    with FakeSGLang(vocab=range(100, 1000)) as fake, LiveGateway(
        backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url
    ) as gateway:
        yield gateway


def test_concurrent_sessions_prompts_are_each_their_own(gw: LiveGateway) -> None:
    sessions = list(itertools.chain.from_iterable(gw.group(8)["sessions"] for _ in range(SESSIONS // 8)))
    turns = app_serving(gw.app).turns
    batches0, calls0 = turns._prompts.batches, turns._prompts.calls

    async def agent(i: int, cred: dict[str, Any]) -> list[dict[str, Any]]:
        async with gw.async_openai(cred) as client:
            messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."},
                                              {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
            first = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"And {i} times two, session {i}?"}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
            return messages

    async def main() -> list[list[dict[str, Any]]]:
        return await asyncio.gather(*(agent(i, cred) for i, cred in enumerate(sessions)))

    conversations = asyncio.run(main())
    template = turns.template
    for cred, messages in zip(sessions, conversations, strict=True):
        rec = gw.session(cred["session_id"])
        first, second = rec["turns"]
        assert (first["continuity"], second["continuity"]) == ("new-chain", "extends")
        assert second["parent_id"] == first["id"]
        assert first["prompt_ids"] == render_ids(template, messages[:2], None)
        chain = first["prompt_ids"] + first["completion_ids"]
        assert second["prompt_ids"][: len(chain)] == chain
        # The rest: the new message's tokens after the reply's own ids, as the template renders them.
        assert second["prompt_ids"][len(chain):] == extension_ids(template, messages[:3], first["completion_ids"],
                                                                  messages[3:], None)
    calls = turns._prompts.calls - calls0
    assert calls == 2 * SESSIONS
    # Every prompt went through the batch, and 24 agents starting at once shared some (4 batches for the 48 calls
    # in a run here; how many depends on how the requests arrive).
    assert 1 <= turns._prompts.batches - batches0 < calls
