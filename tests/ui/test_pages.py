"""The viewer in a real browser (headless Chromium) over a store filled through the gateway with the scripted
fake backend (tests/ui/fill.py): each page shows what the store holds, the token view marks the divergent
token and the version boundary, filtering and pagination work, live pages refresh, and a session key sees
only its own session.

    pytest tests/ui                                  # ROLLWAY_UI_SCREENSHOTS=DIR keeps the screenshots
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway
from tests.ui.conftest import sign_in
from tests.ui.fill import Filled, fill


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, Filled, FakeSGLang]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        yield gw, fill(gw, fake, tok, tmp_path_factory.mktemp("ckpt")), fake


@pytest.fixture(scope="module")
def admin_page(browser: Any, run: tuple[LiveGateway, Filled, FakeSGLang]) -> Iterator[Any]:
    page = sign_in(browser, run[0].url)
    yield page
    page.context.close()


def db(gw: LiveGateway, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    path = gw.settings.db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, args).fetchall()


def test_overview_shows_the_store(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang], shots: Path) -> None:
    gw, filled, _ = run
    page = admin_page
    page.goto(f"{gw.url}/ui")
    page.wait_for_selector("#tile-trained b")
    trained = db(gw, "SELECT count(*) FROM groups WHERE state = 'trained'")[0][0]
    version = db(gw, "SELECT max(version) FROM weight_versions")[0][0]
    assert trained == 2 and version == filled.version == 2
    assert page.inner_text("#tile-trained b") == str(trained)
    assert page.inner_text("#tile-version b") == str(version)
    assert page.inner_text("#ov-version") == f"weights v{version}"
    # Charts are drawn (SVG), the groups chart names the drop reason with its count from the store.
    for chart in ("chart-versions", "chart-train-clock", "chart-eval-version", "chart-loss", "chart-groups"):
        assert page.locator(f"#{chart} svg").count() == 1, chart
    dropped = db(gw, "SELECT count(*) FROM groups WHERE drop_reason = 'too_few_sessions'")[0][0]
    assert page.text_content("#chart-groups [data-bar='dropped: too_few_sessions']") == str(dropped)
    assert "healthy" in page.inner_text("#backends")
    page.screenshot(path=str(shots / "overview.png"), full_page=True)


def test_groups_filter_and_pagination(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang], shots: Path) -> None:
    gw, filled, _ = run
    page = admin_page
    # The page opens on training groups (issue 28: eval groups are behind the Kind filter).
    total = db(gw, "SELECT count(*) FROM groups WHERE NOT is_eval")[0][0]
    assert total < db(gw, "SELECT count(*) FROM groups")[0][0]
    page.goto(f"{gw.url}/ui/groups?limit=10")
    assert page.inner_text("#groups-total") == f"{total} match"
    seen: list[str] = []
    first = page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)")
    newest = [r[0] for r in db(gw, "SELECT id FROM groups WHERE NOT is_eval ORDER BY created_at DESC, id DESC LIMIT 10")]
    assert first == newest
    seen += first
    while page.locator("#page-next").count():
        page.click("#page-next")
        page.wait_for_load_state()
        seen += page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)")
    assert len(seen) == len(set(seen)) == total  # every group once, newest first
    page.click("#page-prev")
    page.wait_for_load_state()
    assert page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)") == seen[-20:-10] or \
        len(seen) % 10 != 0
    page.click("#page-last")
    page.wait_for_load_state()
    oldest = [r[0] for r in db(gw, "SELECT id FROM groups WHERE NOT is_eval ORDER BY created_at, id LIMIT 10")][::-1]
    assert page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)") == oldest

    # Filters through the form: state, then a reward range, then task text.
    page.goto(f"{gw.url}/ui/groups")
    page.select_option("select[name=state]", "dropped")
    page.click("#group-filter button[type=submit]")
    page.wait_for_load_state()
    assert page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)") == [filled.dropped_group]
    page.goto(f"{gw.url}/ui/groups?reward_min=0.6&reward_max=1")
    rows = page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)")
    expected = {r[0] for r in db(gw, "SELECT g.id FROM groups g JOIN sessions s ON s.group_id = g.id "
                                      "WHERE s.reward IS NOT NULL AND NOT g.is_eval GROUP BY g.id HAVING avg(s.reward) BETWEEN 0.6 AND 1")}
    assert set(rows) == expected and filled.zero_var_group in expected
    page.goto(f"{gw.url}/ui/groups?q=17%2B25")
    assert page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)") == [filled.spread_group]
    page.goto(f"{gw.url}/ui/groups?kind=eval&version=1")
    assert page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)") == [filled.eval_group]
    page.goto(f"{gw.url}/ui/groups?version=1&kind=train")
    assert set(page.eval_on_selector_all("tr.group-row", "rs => rs.map(r => r.dataset.group)")) == \
        {filled.spread_group, filled.zero_var_group}
    # The zero-variance group is marked; its reward cells show the store's rewards.
    row = page.locator(f"tr[data-group='{filled.zero_var_group}']")
    assert "zero variance" in row.inner_text()
    assert "zero variance" not in page.locator(f"tr[data-group='{filled.spread_group}']").inner_text()
    page.goto(f"{gw.url}/ui/groups?q=What%20is")
    page.screenshot(path=str(shots / "groups.png"), full_page=True)


def test_bad_filters_are_clear_errors(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang]) -> None:
    gw = run[0]
    for query, word in (("reward_min=abc", "reward_min"), ("state=nope", "state"), ("limit=7", "limit"),
                        ("after=garbage", "after"), ("version=-1", "version"), ("reward_max=nan", "reward_max")):
        r = admin_page.goto(f"{gw.url}/ui/groups?{query}")
        assert r.status == 400, query
        assert word in admin_page.inner_text(".error"), query
    api = httpx.Client(base_url=gw.url, headers=gw.admin.headers)
    sid = run[1].tool_sessions[0]
    for query in ("offset=-1", "limit=0", "limit=100000", "offset=x", "chain=nope", "offset=99999999"):
        r = api.get(f"/ui/api/sessions/{sid}/tokens?{query}")
        assert r.status_code in (400, 404), (query, r.status_code, r.text)
    assert api.get("/ui/api/sessions/sess_nope/tokens").status_code == 404


def test_group_page_side_by_side(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang], shots: Path) -> None:
    gw, filled, _ = run
    page = admin_page
    page.goto(f"{gw.url}/ui/groups/{filled.spread_group}")
    cards = page.locator("article.session-card")
    assert cards.count() == 4
    stored = dict(db(gw, "SELECT id, reward FROM sessions WHERE group_id = ?", filled.spread_group))
    advantages = dict(db(gw, "SELECT session_id, advantage FROM trained_samples WHERE group_id = ?", filled.spread_group))
    for i in range(4):
        card = cards.nth(i)
        sid = card.get_attribute("data-session")
        assert float(card.locator(".reward").inner_text()) == stored[sid]
        assert float(card.locator(".advantage").inner_text()) == advantages[sid]
        assert card.locator(".tools").inner_text() == "1"  # one tool call per session
        assert card.locator(".versions").inner_text() == "0"
    page.screenshot(path=str(shots / "group.png"), full_page=True)


def _first_divergence(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_session_page_and_drift(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang], shots: Path) -> None:
    gw, filled, _ = run
    page = admin_page
    record = gw.session(filled.break_session)
    page.goto(f"{gw.url}/ui/sessions/{filled.break_session}")
    assert page.locator("article.turn").count() == len(record["turns"]) == 3
    # The conversation as the agent saw it: system, user, the tool call, the tool result, the answer.
    turn1 = page.locator("#turn-1")
    assert turn1.locator(".role-system").count() == 1 and "calculate" in turn1.locator(".call").inner_text()
    assert "42" in page.locator("#turn-2 .role-tool").inner_text()
    assert "edited_message" in page.locator("#turn-3 .badge.new-chain").inner_text()
    # Token view of the new chain: the first divergent token against the chain of turns 1-2.
    t3, t2 = record["turns"][2], record["turns"][1]
    k = _first_divergence(t3["prompt_ids"], t2["prompt_ids"] + t2["completion_ids"])
    page.click("#turn-3 button.show-tokens")
    page.wait_for_selector("#tokens[data-ready='1']")
    assert f"at token {k}" in page.inner_text("#drift-report")
    diverge = page.locator("#drift-report .tok.diverge")
    assert diverge.count() == 2  # ours and theirs, side by side
    assert f"#{t3['prompt_ids'][k]} " in diverge.nth(0).get_attribute("title")
    assert f"#{(t2['prompt_ids'] + t2['completion_ids'])[k]} " in diverge.nth(1).get_attribute("title")
    main = page.locator("#tokens .tok.diverge")
    assert main.count() == 1 and f"token {k} " in main.get_attribute("title")
    page.screenshot(path=str(shots / "session-drift.png"), full_page=True)
    page.locator("#token-view").screenshot(path=str(shots / "session-token-view.png"))


def test_token_view_marks_version_boundary(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang], shots: Path) -> None:
    gw, filled, _ = run
    page = admin_page
    turn = gw.session(filled.publish_session)["turns"][-1]
    versions = turn["versions"]
    k = next(i for i in range(1, len(versions)) if versions[i] != versions[i - 1])
    page.goto(f"{gw.url}/ui/sessions/{filled.publish_session}#tokens=last")
    page.wait_for_selector("#tokens[data-ready='1']")
    mark = page.locator("#tokens .vmark")
    assert mark.count() == 1 and mark.inner_text() == f"v{versions[k - 1]}→v{versions[k]}"
    # The token right after the mark is the first of the new version, at the stored index.
    after = page.evaluate("() => document.querySelector('#tokens .vmark').nextElementSibling.title")
    index = len(turn["prompt_ids"]) + k
    assert f"token {index} " in after and f"v{versions[k]} " in after
    # Prompt tokens are marked as such and the reply's tokens as trained (mask 1).
    assert page.locator("#tokens .tok.prompt").count() == len(turn["prompt_ids"])
    assert page.locator("#tokens .tok.trained").count() == len(turn["completion_ids"])
    page.screenshot(path=str(shots / "session-tokens.png"), full_page=True)


def test_search(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang], shots: Path) -> None:
    gw, filled, _ = run
    page = admin_page
    page.goto(f"{gw.url}/ui")
    page.fill("header input[name=q]", filled.break_session)
    page.press("header input[name=q]", "Enter")
    page.wait_for_url(re.compile(rf"/ui/sessions/{filled.break_session}$"))
    page.goto(f"{gw.url}/ui/search?q={filled.spread_group}")
    assert page.url.endswith(f"/ui/groups/{filled.spread_group}")
    page.goto(f"{gw.url}/ui/search?q=filler%20task%2007")
    rows = page.eval_on_selector_all("#search-rows tr.group-row", "rs => rs.map(r => r.dataset.group)")
    assert rows == [filled.small_groups[7]]
    page.goto(f"{gw.url}/ui/search?q={filled.break_session[:12]}")
    assert page.locator("a.mono", has_text=filled.break_session[:12]).count() >= 1
    page.screenshot(path=str(shots / "search.png"), full_page=True)


def test_session_page_refreshes_live(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang]) -> None:
    gw, _, _ = run
    page = admin_page
    cred = gw.group(2, task={"prompt": "live"})["sessions"][0]
    client = gw.openai(cred)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}], max_tokens=5)
    page.goto(f"{gw.url}/ui/sessions/{cred['session_id']}")
    assert page.locator("article.turn").count() == 1
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}], max_tokens=5)
    page.wait_for_selector("#turn-2", timeout=15_000)  # no reload: the page polls
    assert page.inner_text("#session-turns") == "2"
    page.wait_for_function("() => document.querySelectorAll('#chains-body tr[data-chain]').length === 2")


def test_session_key_sees_only_its_session(browser: Any, run: tuple[LiveGateway, Filled, FakeSGLang]) -> None:
    gw, filled, _ = run
    own, other = filled.tool_sessions[0], filled.tool_sessions[2]
    page = sign_in(browser, gw.url, filled.creds[own]["api_key"])
    try:
        assert page.url.endswith(f"/ui/sessions/{own}")
        assert page.locator("article.turn").count() == 2
        for path in (f"/ui/sessions/{other}", "/ui", "/ui/groups", f"/ui/groups/{filled.spread_group}",
                     "/ui/search?q=x"):
            r = page.goto(gw.url + path)
            assert r.status == 403, path
        for path in (f"/ui/api/sessions/{other}", f"/ui/api/sessions/{other}/tokens",
                     f"/ui/api/sessions/{other}/summary", "/ui/api/overview", "/ui/api/groups", "/ui/api/leases"):
            r = page.request.get(gw.url + path)
            assert r.status == 403, path
        assert page.request.get(f"{gw.url}/ui/api/sessions/{own}/tokens").status == 200
    finally:
        page.context.close()
    # Without a sign-in: a page redirects to the login form, the JSON is a 401.
    anon = httpx.Client(base_url=gw.url)
    assert anon.get("/ui/groups", headers={"Accept": "text/html"}).status_code == 303
    assert anon.get("/ui/api/groups").status_code == 401
    assert anon.get("/ui/api/leases").status_code == 401


def test_export_json_is_the_session_record(admin_page: Any, run: tuple[LiveGateway, Filled, FakeSGLang]) -> None:
    gw, filled, _ = run
    page = admin_page
    page.goto(f"{gw.url}/ui/sessions/{filled.tool_sessions[0]}")
    with page.expect_download() as dl:
        page.click("#export-json")
    data = Path(dl.value.path()).read_text()
    assert json.loads(data) == gw.session(filled.tool_sessions[0])
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click("#copy-json")
    page.wait_for_function("() => document.getElementById('copy-status').textContent.startsWith('copied')")
