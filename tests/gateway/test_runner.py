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
