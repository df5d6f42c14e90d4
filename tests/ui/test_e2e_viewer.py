"""End to end (slow): the CPU engine with the tiny model behind a live gateway, a two-turn tool agent on the
openai SDK that also rewrites its history once (a new chain), a weight publish in the middle of a reply, then
each viewer page in Chromium checked against the store and saved as a screenshot.

    ROLLWAY_UI_SCREENSHOTS=DIR pytest -m slow tests/ui/test_e2e_viewer.py

The tiny model is untrained: it seldom writes a tool call, so the agent answers its first reply with the
calculator's result as a tool message either way (the call id it was given, else `call_0`).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.embedded import engine_process
from tests.harness import LiveGateway
from tests.ui.conftest import sign_in
from tests.ui.fill import SYSTEM, TOOLS

pytestmark = pytest.mark.slow


def _agent(gw: LiveGateway, cred: dict[str, Any], a: int, b: int, *, before_reply_2: Any = None,
           during_reply_2: Any = None) -> None:
    client = gw.openai(cred, timeout=120)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}]
    r1 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=24)
    m1 = r1.choices[0].message
    msgs.append(m1.model_dump(exclude_none=True))
    call_id = m1.tool_calls[0].id if m1.tool_calls else "call_0"
    msgs.append({"role": "tool", "tool_call_id": call_id, "content": str(a + b)})
    done: dict[str, Any] = {}
    if before_reply_2 is not None:
        before_reply_2()
    t = threading.Thread(target=lambda: done.setdefault(
        "r", client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=160)))
    t.start()
    if during_reply_2 is not None:
        during_reply_2()
    t.join(180)
    msgs.append(done["r"].choices[0].message.model_dump(exclude_none=True))
    msgs[1] = {"role": "user", "content": f"What is {a}+{b}? Only the number."}  # history rewritten: a new chain
    msgs.append({"role": "user", "content": "Sure?"})
    client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=12)


def test_viewer_over_a_real_run(tiny_model_dir: Path, sqlite_url: str, browser: Any, shots: Path, tmp_path: Path) -> None:
    db = Path(sqlite_url.removeprefix("sqlite:///"))  # migrated before the browser starts (see conftest)
    with engine_process(tiny_model_dir, log_path=tmp_path / "engine.log") as engine, \
            LiveGateway(backends=[engine], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        group = gw.group(2, task={"prompt": "What is 17+25?", "answer": 42})
        published: list[int] = []
        start: list[float] = []

        def decode_steps() -> float:
            metrics = httpx.get(engine + "/metrics", timeout=10).text.splitlines()
            return next(float(x.split()[1]) for x in metrics if x.startswith("rollway_engine_decode_steps_total"))

        def publish_soon() -> None:
            # Reply 2 under way: the engine has decoded a few of its tokens (one request, so one step a token). A
            # fixed sleep missed it on a quiet machine, where the 160 tokens took under half a second.
            deadline = time.monotonic() + 60
            while decode_steps() < start[0] + 6:
                assert time.monotonic() < deadline, "reply 2 did not start decoding"
                time.sleep(0.002)
            version = gw.admin.get("/v1/weights").json()["version"] + 1
            r = gw.admin.post("/v1/weights", json={"version": version, "model_path": str(tiny_model_dir)})
            assert r.status_code == 200, r.text
            published.append(version)

        _agent(gw, group["sessions"][0], 17, 25, before_reply_2=lambda: start.append(decode_steps()),
               during_reply_2=publish_soon)
        _agent(gw, group["sessions"][1], 17, 25)
        for cred, reward in zip(group["sessions"], [1.0, 0.0], strict=True):
            gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True}) \
                .raise_for_status()
        sid = group["sessions"][0]["session_id"]
        record = gw.session(sid)
        turn2 = record["turns"][1]
        boundary = [i for i in range(1, len(turn2["versions"])) if turn2["versions"][i] != turn2["versions"][i - 1]]
        if not boundary:
            pytest.fail(f"the publish did not land inside reply 2 (versions {set(turn2['versions'])}); "
                        "the engine answered faster than the test waited")

        page = sign_in(browser, gw.url)
        try:
            page.goto(f"{gw.url}/ui")
            page.wait_for_selector("#tile-version b")
            assert page.inner_text("#tile-version b") == str(published[-1])
            with sqlite3.connect(db) as conn:
                finished = conn.execute("SELECT count(*) FROM sessions WHERE state = 'finished'").fetchone()[0]
            assert page.inner_text("#tile-finished b") == str(finished)
            page.screenshot(path=str(shots / "e2e-overview.png"), full_page=True)

            page.goto(f"{gw.url}/ui/groups")
            row = page.locator(f"tr[data-group='{group['group_id']}']")
            assert row.locator(".cell").all_inner_texts() == ["1", "0"]
            page.screenshot(path=str(shots / "e2e-groups.png"), full_page=True)

            page.goto(f"{gw.url}/ui/groups/{group['group_id']}")
            assert page.locator("article.session-card").count() == 2
            versions = page.locator(f"article[data-session='{sid}'] .versions").inner_text()
            assert versions == ", ".join(str(v) for v in sorted({v for t in record["turns"] for v in t["versions"]}))
            page.screenshot(path=str(shots / "e2e-group.png"), full_page=True)

            page.goto(f"{gw.url}/ui/sessions/{sid}")
            assert "edited_message" in page.inner_text("#turn-3")
            page.click("#turn-2 button.show-tokens")
            page.wait_for_selector("#tokens[data-ready='1']")
            k = boundary[0]
            mark = page.locator("#tokens .vmark")
            assert mark.first.inner_text() == f"v{turn2['versions'][k - 1]}→v{turn2['versions'][k]}"
            index = len(turn2["prompt_ids"]) + k
            after = page.evaluate("() => document.querySelector('#tokens .vmark').nextElementSibling.title")
            assert f"token {index} " in after
            page.screenshot(path=str(shots / "e2e-session-version.png"), full_page=True)
            page.click("#turn-3 button.show-tokens")
            page.wait_for_function("() => document.querySelector('#drift-report')")
            t3 = record["turns"][2]
            chain2 = turn2["prompt_ids"] + turn2["completion_ids"]
            d = next(i for i, (x, y) in enumerate(zip(t3["prompt_ids"], chain2, strict=False)) if x != y)
            assert f"at token {d}" in page.inner_text("#drift-report")
            page.screenshot(path=str(shots / "e2e-session-drift.png"), full_page=True)

            page.goto(f"{gw.url}/ui/search?q=17%2B25")
            assert page.locator(f"#search-rows tr[data-group='{group['group_id']}']").count() == 1
            page.screenshot(path=str(shots / "e2e-search.png"), full_page=True)
        finally:
            page.context.close()
        own = sign_in(browser, gw.url, group["sessions"][1]["api_key"])
        try:
            assert own.goto(f"{gw.url}/ui/sessions/{sid}").status == 403
        finally:
            own.context.close()
        assert httpx.get(f"{gw.url}/ui/api/sessions/{sid}/tokens").status_code == 401
