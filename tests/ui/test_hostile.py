"""The viewer over hostile values already in a store, on both stores (SQLite and PostgreSQL), over HTTP: issue
29 items 2 and 3 with their reproducers as input, and issue 28 item 6's lease, eval-chain and page details.

Extreme rewards are written into the store directly (the REST API refuses them at its boundary now, but a store
written before that, or by another tool, may hold them): the viewer must still answer every page with finite
figures, never a 500.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from gateway.services import app_services
from gateway.store.db import create_engine
from gateway.store.store import S
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


def set_rewards(url: str, rewards: dict[str, float]) -> None:
    """Write session rewards into the store as a row update, bypassing the REST API's range check."""
    async def run() -> None:
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                for sid, value in rewards.items():
                    await conn.execute(update(S).where(S.c.id == sid).values(reward=value))
        finally:
            await engine.dispose()

    asyncio.run(run())


def finished_group(g: LiveGateway, n: int, rewards: list[float], **extra: Any) -> dict[str, Any]:
    grp = g.group(n, task={"prompt": "hostile"}, **extra)
    for cred, reward in zip(grp["sessions"], rewards, strict=True):
        g.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True}) \
            .raise_for_status()
    return grp


def fresh_overview(g: LiveGateway) -> dict[str, Any]:
    app_services(g.app).ui_overview = None  # the page's 4 s cache
    r = g.admin.get("/ui/api/overview")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_huge_rewards_in_a_group_never_500(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 29 item 2: rewards 1e155 and 0 in one group broke /ui/groups, /ui/api/groups and the group page
    (OverflowError in reward_stats), and on PostgreSQL /ui/api/overview (avg(float8) overflows its sum of
    squares). 1e308 twice overflows a plain sum as well."""
    g = gw[0]
    url = g.settings.db_url
    a = finished_group(g, 2, [1.0, 0.0])
    b = finished_group(g, 2, [1.0, 1.0])
    c = finished_group(g, 3, [1.0, 1.0, 0.0])
    sa, sb, sc = ([s["session_id"] for s in x["sessions"]] for x in (a, b, c))
    set_rewards(url, {sa[0]: 1e155, sa[1]: 0.0, sb[0]: 1e308, sb[1]: 1e308, sc[0]: -1.7e308, sc[1]: 1.7e308, sc[2]: 5.0})
    for path in ("/ui/groups", "/ui/groups?kind=all", f"/ui/groups/{a['group_id']}", f"/ui/groups/{b['group_id']}",
                 f"/ui/groups/{c['group_id']}", "/ui/groups?reward_min=1", "/ui/groups?reward_max=-1",
                 "/ui/groups?reward_min=0&reward_max=1e300", f"/ui/search?q={a['group_id'][:8]}", "/ui"):
        r = g.admin.get(path, headers={"Accept": "text/html"})
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
    page = g.admin.get(f"/ui/groups/{a['group_id']}", headers={"Accept": "text/html"}).text
    assert "1e+155" in page and "5e+154" in page  # the reward and the mean, short
    one = g.admin.get(f"/ui/api/groups/{a['group_id']}").json()
    assert one["reward_mean"] == pytest.approx(5e154) and one["reward_std"] == pytest.approx(5e154)
    two = g.admin.get(f"/ui/api/groups/{b['group_id']}").json()
    assert two["reward_mean"] == pytest.approx(1e308) and two["reward_std"] == 0.0 and two["zero_variance"]
    three = g.admin.get(f"/ui/api/groups/{c['group_id']}").json()
    assert math.isfinite(three["reward_mean"]) and math.isfinite(three["reward_std"])
    listed = g.admin.get("/ui/api/groups", params={"limit": 200})
    assert listed.status_code == 200, listed.text
    rows = {x["id"]: x for x in listed.json()["data"]}
    assert rows[a["group_id"]]["reward_mean"] == pytest.approx(5e154)
    # The reward filter's mean (SQL) on the same groups: 5e154 >= 1e154, 1e308 too; the third is ~5/3.
    hits = g.admin.get("/ui/api/groups", params={"reward_min": 1e154, "limit": 200}).json()
    assert {a["group_id"], b["group_id"]} <= {x["id"] for x in hits["data"]}
    assert hits["total"] == len(hits["data"])
    d = fresh_overview(g)
    for p in d["train_reward_by_clock"]:
        assert p["mean"] is None or math.isfinite(p["mean"])
    assert d["train_reward_by_clock"], "the finished groups are on the wall-clock chart"


def test_session_keys_large_rewards_a_few_units_apart(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 29 item 9's store (rewards 1e16 and 1e16 + 4) gives the overview finite figures; the browser test
    (test_charts.py) draws it."""
    g = gw[0]
    grp = finished_group(g, 2, [0.0, 0.0])
    set_rewards(g.settings.db_url, {grp["sessions"][0]["session_id"]: 1e16, grp["sessions"][1]["session_id"]: 1e16 + 4})
    got = g.admin.get(f"/ui/api/groups/{grp['group_id']}").json()
    assert got["reward_mean"] == 1e16 + 2 and got["reward_std"] == 2.0
    assert fresh_overview(g)["train_reward_by_clock"]


def test_group_page_while_a_session_has_no_turn(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 29 item 3: the group page was a 400 ("the chat template refused these messages: 'dict object' has
    no attribute 'last_reply'") while one of its sessions had no turn yet: a viewer template error."""
    g, fake, tok = gw
    grp = g.group(2, task={"prompt": "What is 3+4?"})
    fresh = g.admin.get(f"/ui/groups/{grp['group_id']}", headers={"Accept": "text/html"})
    assert fresh.status_code == 200, fresh.text[:300]  # no session has a turn
    _tool_session(g, fake, tok, grp["sessions"][0], 3, 4)
    r = g.admin.get(f"/ui/groups/{grp['group_id']}", headers={"Accept": "text/html"})
    assert r.status_code == 200, r.text[:300]
    assert r.text.count("session-card") == 2 and 'class="snippet"' in r.text  # the one with turns shows its reply
    frag = g.admin.get(f"/ui/groups/{grp['group_id']}?fragment=1")
    assert frag.status_code == 200 and frag.text.count("session-card") == 2


def test_an_eval_sessions_chain_trains_nothing(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 28 item 6: an eval session's chain said "trained 3"; eval groups are never leased."""
    g, fake, tok = gw
    ev = g.group(1, task={"prompt": "eval: 2+5"}, eval=True, metadata={"eval_version": 0})
    tr = g.group(1, task={"prompt": "train: 2+5"})
    for grp in (ev, tr):
        _tool_session(g, fake, tok, grp["sessions"][0], 2, 5)
        g.admin.post(f"/v1/sessions/{grp['sessions'][0]['session_id']}/reward", json={"reward": 1.0, "finish": True})
    chains = {k: g.admin.get(f"/ui/api/sessions/{x['sessions'][0]['session_id']}/chains").json()["data"]
              for k, x in (("eval", ev), ("train", tr))}
    assert [c["trained"] for c in chains["eval"]] == [0] and chains["eval"][0]["eval"] is True
    assert chains["train"][0]["trained"] > 0 and chains["train"][0]["eval"] is False
    tokens = g.admin.get(f"/ui/api/sessions/{ev['sessions'][0]['session_id']}/tokens", params={"turn": "last"}).json()
    assert set(tokens["mask"]) == {0}


def test_leases_held_lapsed_and_paged(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 28 item 6: a finished store showed groups "leased" and leases "expiring in 210 s" after its trainer
    was gone, and the overview listed every lease ever. A lapsed lease says so (groups too), the overview
    lists the newest 10, GET /ui/api/leases pages through the rest."""
    g, fake, tok = gw
    while (r := g.admin.post("/v1/batches", json={"max_groups": 4096})).json()["batch_id"]:  # earlier tests' groups
        g.admin.post(f"/v1/batches/{r.json()['batch_id']}/ack", json={})  # dropped as filtered
    # Fresh groups leased one a batch (oldest complete first): 11 leases of 6 s that lapse (no trainer renews
    # them; no later lease call expires them either), then 1 held.
    made = []
    for i in range(12):
        grp = g.group(1, task={"prompt": f"lease {i}"})
        _tool_session(g, fake, tok, grp["sessions"][0], 2, i)
        g.admin.post(f"/v1/sessions/{grp['sessions'][0]['session_id']}/reward", json={"reward": 1.0, "finish": True})
        made.append(grp["group_id"])
    batches = []
    t_last = t0 = time.time()  # a lease call after the short ones lapsed would expire them (state expired): all first
    for i in range(12):
        lease = g.admin.post("/v1/batches", json={"max_groups": 1, "lease_seconds": 6 if i < 11 else 600}).json()
        assert lease["groups"][0]["group_id"] == made[i], lease
        batches.append((lease["batch_id"], made[i]))
        t_last = time.time() if i == 10 else t_last  # the last short lease
    assert time.time() - t0 < 6, "the leases took longer than the short ones last"
    time.sleep(max(0.0, t_last + 6.3 - time.time()))
    d = fresh_overview(g)
    q = d["lease_queue"]
    assert q["total"] == 12 and q["held"] == 1 and q["lapsed"] == 11
    assert len(q["leases"]) == 10 and q["leases"][0]["id"] == batches[-1][0]  # newest first
    assert [x["status"] for x in q["leases"]] == ["held"] + ["lapsed"] * 9
    assert q["trainer_last_seen"] is not None and q["trainer_last_seen"] <= d["now"]
    older = g.admin.get("/ui/api/leases", params={"offset": 10}).json()
    assert [x["id"] for x in older["leases"]] == [b for b, _ in batches[1::-1]]
    assert g.admin.get("/ui/api/leases", params={"limit": 0}).status_code == 400
    assert g.admin.get("/ui/api/leases", params={"offset": "x"}).status_code == 400
    lapsed_group, held_group = batches[0][1], batches[-1][1]
    assert g.admin.get(f"/ui/api/groups/{lapsed_group}").json()["lease"] == "lapsed"
    assert g.admin.get(f"/ui/api/groups/{held_group}").json()["lease"] == "held"
    page = g.admin.get(f"/ui/groups/{lapsed_group}", headers={"Accept": "text/html"}).text
    assert "lease lapsed" in page
    assert "lease lapsed" not in g.admin.get(f"/ui/groups/{held_group}", headers={"Accept": "text/html"}).text
    listed = {x["id"]: x for x in g.admin.get("/ui/api/groups", params={"state": "leased", "limit": 50}).json()["data"]}
    assert listed[lapsed_group]["lease"] == "lapsed" and listed[held_group]["lease"] == "held"


def test_groups_page_opens_on_train_groups(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 28 item 6: the page opened on one-session eval groups; train groups needed a filter."""
    g = gw[0]
    ev = finished_group(g, 1, [1.0], eval=True, metadata={"eval_version": 3})
    page = g.admin.get("/ui/groups", params={"limit": 200}, headers={"Accept": "text/html"}).text
    assert ev["group_id"] not in page and '<option value="train" selected>' in page
    both = g.admin.get("/ui/groups", params={"kind": "all", "limit": 200}, headers={"Accept": "text/html"}).text
    assert ev["group_id"] in both and "kind=all" in both  # the pager keeps the choice
    assert ev["group_id"] in g.admin.get("/ui/groups", params={"kind": "eval"}, headers={"Accept": "text/html"}).text
    assert g.admin.get("/ui/api/groups", params={"kind": "nope"}).status_code == 400


def test_plurals_and_favicon(gw: tuple[LiveGateway, FakeSGLang, Any]) -> None:
    """Issue 28 item 6: "1 turns"; /favicon.ico was a 404 (a console error on every page)."""
    g, fake, tok = gw
    grp = g.group(1, task={"prompt": "one turn"})
    sid = grp["sessions"][0]["session_id"]
    fake.script([[101, 102, tok.convert_tokens_to_ids("<|im_end|>")]])
    g.openai(grp["sessions"][0]).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5)
    text = g.admin.get("/ui/search", params={"q": sid[:-1]}, headers={"Accept": "text/html"}).text
    assert "1 turn<" in text and "1 turns" not in text
    icon = g.admin.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
