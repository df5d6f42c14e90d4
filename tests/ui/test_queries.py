"""The viewer's queries on both stores (SQLite and PostgreSQL), over HTTP without a browser: the groups list's
filters and keyset pages, the session page's per-turn new messages (taken apart by the database), the token
view's chains, and migration 0004's indexes matching the models."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.store.db import create_engine
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway
from tests.ui.fill import _tool_session


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, db_url: str) -> Iterator[tuple[LiveGateway, FakeSGLang, Any]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as g:
        yield g, fake, tok


def test_groups_filters_and_pages(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    g = gw[0]
    made = []
    for i in range(7):
        grp = g.group(2, task={"prompt": f"task {i} 100%_done"}, eval=(i == 6))
        made.append(grp["group_id"])
        for j, s in enumerate(grp["sessions"]):
            g.admin.post(f"/v1/sessions/{s['session_id']}/reward", json={"reward": i / 6 if j else 0.5, "finish": True})
    ids: list[str] = []
    r = g.admin.get("/ui/api/groups?limit=10").json()
    assert r["total"] == 7 and r["next"] is None
    page = g.admin.get("/ui/api/groups?limit=10&kind=train").json()
    assert [x["id"] for x in page["data"]] == made[5::-1]
    # Keyset pages of... 10 is the smallest page: walk 7 groups as 10 + nothing; then with a text filter.
    assert g.admin.get("/ui/api/groups", params={"q": "100%_"}).json()["total"] == 7  # % and _ are literal
    assert g.admin.get("/ui/api/groups", params={"q": "0%x"}).json()["total"] == 0
    assert [x["id"] for x in g.admin.get("/ui/api/groups", params={"q": "TASK 3"}).json()["data"]] == [made[3]]
    # mean reward: session rewards 0.5 and i/6
    hits = {x["id"] for x in g.admin.get("/ui/api/groups", params={"reward_min": 0.5, "reward_max": 1}).json()["data"]}
    assert hits == {made[i] for i in range(7) if (0.5 + i / 6) / 2 >= 0.5}
    last = g.admin.get("/ui/api/groups", params={"last": 1, "limit": 10}).json()
    assert [x["id"] for x in last["data"]] == made[::-1]
    assert g.admin.get("/ui/api/groups", params={"kind": "eval"}).json()["data"][0]["id"] == made[6]
    # a cursor: everything older than the 3rd newest
    first = g.admin.get("/ui/api/groups?limit=10").json()["data"]
    cursor = f"{first[2]['created_at']!r}~{first[2]['id']}"
    ids = [x["id"] for x in g.admin.get("/ui/api/groups", params={"after": cursor}).json()["data"]]
    assert ids == [x["id"] for x in first[3:]]
    newer = g.admin.get("/ui/api/groups", params={"before": cursor}).json()
    assert [x["id"] for x in newer["data"]] == [x["id"] for x in first[:2]]
    for bad in ({"after": "x"}, {"before": "1.0"}, {"reward_min": "inf"}, {"limit": "3"}, {"q": "x" * 201},
                {"after": cursor, "last": "1"}):
        assert g.admin.get("/ui/api/groups", params=bad).status_code == 400, bad


def test_session_turns_show_what_is_new(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    g, fake, tok = gw
    grp = g.group(2, task={"prompt": "17+25"})
    cred = grp["sessions"][0]
    _tool_session(g, fake, tok, cred, 17, 25, edit=True)
    html = g.admin.get(f"/ui/sessions/{cred['session_id']}").text
    turns = re.split(r'<article class="card turn"', html)[1:]
    assert len(turns) == 3
    roles = [re.findall(r'class="msg role-(\w+)', t) for t in turns]
    # turn 1: system, user, reply; turn 2: only the tool result, then the reply; turn 3 (a new chain): all of it
    assert roles == [["system", "user", "assistant"], ["tool", "assistant"],
                     ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]]
    assert "3 earlier messages" in turns[1] and "edited_message" in turns[2]
    chains = g.admin.get(f"/ui/api/sessions/{cred['session_id']}/chains").json()["data"]
    assert [c["drift"]["reason"] if c["drift"] else None for c in chains] == [None, "edited_message"]
    record = g.session(cred["session_id"])
    t1, t2 = record["turns"][0], record["turns"][1]
    tokens = g.admin.get(f"/ui/api/sessions/{cred['session_id']}/tokens", params={"chain": chains[0]["leaf_id"]}).json()
    assert tokens["ids"] == t2["prompt_ids"] + t2["completion_ids"]
    mask = [0] * len(t1["prompt_ids"]) + [1] * len(t1["completion_ids"])
    mask += [0] * (len(t2["prompt_ids"]) - len(mask)) + [1] * len(t2["completion_ids"])
    assert tokens["mask"] == mask  # gateway/samples.py's loss mask: prompt 0, each reply 1
    assert tokens["logprobs"][len(t1["prompt_ids"])] == pytest.approx(t1["logprobs"][0], abs=1e-4)


def test_migration_0004_indexes_match_the_models(db_url: str) -> None:
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from gateway.store.models import Base

    def compare(conn: Any) -> tuple[list[Any], set[str]]:
        names = {ix["name"] for t in ("groups", "sessions") for ix in sa.inspect(conn).get_indexes(t)}
        return compare_metadata(MigrationContext.configure(conn), Base.metadata), names

    async def run() -> tuple[list[Any], set[str]]:
        engine = create_engine(db_url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(compare)  # type: ignore[no-any-return]
        finally:
            await engine.dispose()

    diff, names = asyncio.run(run())
    ours = ("ix_groups_created_at_id", "ix_sessions_group_id_reward")
    assert set(ours) <= names
    assert [d for d in diff if any(n in repr(d) for n in ours)] == []


@pytest.mark.parametrize("path", [
    "/ui/sessions/" + "x" * 3000, "/ui/api/sessions/sess_%E2%9C%93/tokens", "/ui/api/sessions/a'b/chains",
    "/ui/groups?q=%F0%9F%98%80%25_%5C", "/ui/groups?version=99999999999", "/ui/groups?after=1~" + "x" * 100,
    "/ui/groups?reward_min=1e999", "/ui/groups?state=open&state=x", "/ui/groups?limit=-1",
    "/ui/api/sessions/x/turns/y", "/ui/search?q=" + "%25" * 300, "/ui/groups/%20", "/ui/api/groups?before=nan~g",
])
def test_hostile_input_is_never_a_500(gw: tuple[LiveGateway, FakeSGLang, Any], path: str) -> None:
    r = gw[0].admin.get(path)
    assert r.status_code in (200, 303, 400, 404), (path, r.status_code, r.text[:200])


def test_a_stored_tool_call_id_that_is_no_string_does_not_break_the_page() -> None:
    """A store written before Responses input items were checked may hold a dict `call_id` (the probe's
    reproducer): the session page was a 500 (`unhashable type: 'dict'`)."""
    from gateway.store.views import LightTurn
    from gateway.ui.conversation import turn_views

    reply = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    turn = LightTurn(id="t", seq=1, parent_id=None, reply=reply, versions=b"", temperature=1.0, finish_reason="stop",
                     continuity="new-chain", chain_reason=None, client_disconnected=False, reward=None, prompt_len=3,
                     timings={}, new_messages=[{"role": "tool", "tool_call_id": {"a": 1}, "content": "r"},
                                               {"role": "tool", "tool_call_id": "c1", "content": "r"}])
    (view,) = turn_views([turn])
    assert [m["tool_name"] for m in view["new_messages"]] == [None, "f"]
