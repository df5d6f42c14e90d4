"""The runner (`rollway rollout`, the demo's agent driver) against a live gateway: every session of a group
rewarded and finished in one call, an agent's exception abandons only its own session, and sessions beyond one HTTP pool's
size are spread over several pools."""

from __future__ import annotations

import asyncio
from typing import Any

from openai import AsyncOpenAI

from rollway import rollout
from rollway.rollout import Runner
from tests.harness import ADMIN_KEY, LiveGateway


async def agent(task: dict[str, Any], client: AsyncOpenAI) -> float:
    if task.get("crash"):
        raise ValueError("agent bug")
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}],
                                                 max_tokens=4)
    return float(len(reply.choices[0].message.content or "") % 2)


def test_runner_rewards_and_finishes_every_session(gateway: LiveGateway, monkeypatch: Any) -> None:
    monkeypatch.setattr(rollout, "POOL_CONNECTIONS", 8)
    used: set[int] = set()

    async def main() -> tuple[list[list[float | None]], Runner]:
        runner = Runner(gateway.url, ADMIN_KEY, agent, concurrency=20)
        real = runner._pool_index

        def spy() -> int:
            used.add(i := real())
            return i

        runner._pool_index = spy  # type: ignore[method-assign]
        try:
            tasks = [{"prompt": f"{i}+1="} for i in range(5)] + [{"prompt": "x", "crash": i == 0} for i in range(1)]
            return list(await asyncio.gather(*(runner.run_group(t, 4) for t in tasks))), runner
        finally:
            await runner.close()

    results, runner = asyncio.run(main())
    assert len(runner._admin_pools) == len(runner._agent_pools) == 3  # 20 sessions over pools of 8
    assert used == {0, 1, 2}
    assert all(r is not None for rs in results[:5] for r in rs)
    assert results[5] == [None, None, None, None]  # the crashing agent: every session abandoned, none rewarded
    assert runner.stats.sessions_done == 20 and runner.stats.sessions_failed == 4
    groups = gateway.admin.get("/v1/sessions", params={"state": "finished", "limit": 100}).json()["data"]
    finished = [s for s in groups if s.get("reward") is not None]
    assert len(finished) >= 20
    abandoned = gateway.admin.get("/v1/sessions", params={"state": "abandoned", "limit": 100}).json()["data"]
    assert len(abandoned) >= 4


def test_a_group_keeps_the_rewards_of_its_sessions_that_ran(gateway: LiveGateway) -> None:
    """One session of a group crashes, one returns NaN, one is abandoned by someone else (as the idle sweeper
    does) after its agent returned: each of those is lost alone, the group's other sessions are rewarded."""
    calls: dict[str, int] = {}
    swept_cred: list[dict[str, Any]] = []

    async def flaky(task: dict[str, Any], client: AsyncOpenAI) -> float:
        n = calls[task["prompt"]] = calls.get(task["prompt"], 0) + 1
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}],
                                             max_tokens=2)
        if task.get("crash") and n == 1:
            raise ValueError("agent bug")
        if task.get("nan") and n == 1:
            return float("nan")
        return 1.0

    async def main() -> tuple[list[list[float | None]], Runner]:
        runner = Runner(gateway.url, ADMIN_KEY, flaky, concurrency=8)
        real = runner._run_session

        async def swept(task: dict[str, Any], cred: dict[str, Any]) -> float | None:
            reward = await real(task, cred)
            if task.get("swept") and cred is swept_cred[0]:
                r = gateway.admin.post(f"/v1/sessions/{cred['session_id']}/abandon", json={"reason": "idle"})
                assert r.status_code == 200, r.text
            return reward

        real_post = runner._post

        async def post(path: str, body: dict[str, Any], pool: int = 0, **kw: Any) -> dict[str, Any]:
            out = await real_post(path, body, pool, **kw)
            if path == "/v1/groups" and body["task"].get("swept"):
                swept_cred.append(out["sessions"][0])
            return out

        runner._run_session = swept  # type: ignore[method-assign]
        runner._post = post  # type: ignore[method-assign]
        try:
            tasks = [{"prompt": "a", "crash": True}, {"prompt": "b", "nan": True}, {"prompt": "c", "swept": True}]
            return list(await asyncio.gather(*(runner.run_group(t, 3) for t in tasks))), runner
        finally:
            await runner.close()

    results, runner = asyncio.run(main())
    assert sorted(results[0], key=str) == sorted([None, 1.0, 1.0], key=str)
    assert sorted(results[1], key=str) == sorted([None, 1.0, 1.0], key=str)
    assert results[2] == [1.0, 1.0, 1.0]  # its agents all returned; the gateway kept two of the three
    assert runner.stats.sessions_failed == 2 and runner.stats.sessions_done == 2 + 2 + 2
    assert len(swept_cred) == 1
    for cred in swept_cred:
        s = gateway.admin.get(f"/v1/sessions/{cred['session_id']}").json()
        assert s["state"] == "abandoned" and s["reward"] is None
        group = gateway.admin.get(f"/v1/groups/{s['group_id']}").json()
        assert group["state"] == "complete"
        assert sorted((x["state"], x["reward"]) for x in group["sessions"]) == [
            ("abandoned", None), ("finished", 1.0), ("finished", 1.0)]


def test_the_runner_commands_run_on_uvloop_where_it_is_installed() -> None:
    """`rollway rollout` and the demo run their agents through `run_async`: uvloop's loop (a dependency off
    Windows; benchmarks/runner.py: ~25% less of the runner's CPU per session), asyncio's default without it."""
    import asyncio

    import pytest

    from rollway.rollout import event_loop_factory, run_async

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    uvloop = pytest.importorskip("uvloop")
    assert event_loop_factory() is uvloop.new_event_loop
    assert run_async(which()).startswith("uvloop")


def test_the_runner_says_when_the_trainer_holds_it(fake: Any, tiny_model_dir: Any, db_url: str, monkeypatch: Any,
                                                   caplog: Any) -> None:
    """With the trainer stopped, staleness admission refuses new groups (429) and the runner waits: it sat at
    `0group` saying nothing. Now it says what holds it, with the gateway's own words."""
    monkeypatch.setattr(rollout, "ADMISSION_WAIT_S", 0.1)
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url, max_head_offpolicyness=0,
                     default_groups_per_step=1) as gw:
        for _ in range(20):  # the budget used up (the module's store may hold groups already)
            r = gw.admin.post("/v1/groups", json={"task": {"prompt": "1+1="}, "n_samples": 2})
            if r.status_code == 429:
                break
            assert r.status_code == 201, r.text
        else:
            raise AssertionError("admission never refused a group")

        async def main() -> None:
            runner = Runner(gw.url, ADMIN_KEY, agent, concurrency=4)
            try:
                with caplog.at_level("WARNING", logger="rollway.rollout"):
                    await asyncio.wait_for(runner.run_group({"prompt": "2+2="}, 2), 1.5)
            finally:
                await runner.close()

        try:
            asyncio.run(main())
        except TimeoutError:
            pass
        else:
            raise AssertionError("the second group was admitted")
    said = [r.getMessage() for r in caplog.records if r.name == "rollway.rollout"]
    assert len(said) == 1 and "waiting for the trainer" in said[0] and "staleness" in said[0], said


def test_a_cancelled_run_abandons_its_sessions(gateway: LiveGateway) -> None:
    """The demo cancels its groups in flight when its time is up: their sessions stayed active (and their groups
    open) in the store for good. Now each is abandoned, the ones waiting for a slot too."""
    started = asyncio.Event()

    async def slow(task: dict[str, Any], client: AsyncOpenAI) -> float:
        started.set()
        await asyncio.sleep(60)
        return 1.0

    async def main() -> None:
        runner = Runner(gateway.url, ADMIN_KEY, slow, concurrency=2)  # 2 run, 2 wait for a slot
        try:
            task = asyncio.ensure_future(runner.run_group({"prompt": "1+1="}, 4))
            await started.wait()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        finally:
            await runner.close()

    before = {s["id"] for s in gateway.admin.get("/v1/sessions", params={"limit": 1000}).json()["data"]}
    asyncio.run(main())
    mine = [s for s in gateway.admin.get("/v1/sessions", params={"limit": 1000}).json()["data"] if s["id"] not in before]
    assert len(mine) == 4 and all(s["state"] == "abandoned" for s in mine), mine
    group = gateway.admin.get(f"/v1/groups/{gateway.session(mine[0]['id'])['group_id']}").json()
    assert group["state"] == "dropped" and {s["end_reason"] for s in group["sessions"]} == {"run_cancelled"}, group
