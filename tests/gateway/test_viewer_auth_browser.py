"""The /ui sign-in in a real browser (headless Chromium, the system's, driven by Playwright): what a person does
(open a page, get the form, a wrong key, the right key, back on the page, sign out) and what a browser keeps
(an HttpOnly SameSite=Strict cookie scripts cannot read; the key nowhere in the page or its storage).

A browser posts the form with an `Origin` header only under a referrer policy that allows it: under
`no-referrer` it sends `Origin: null`, which the cross-site check refused, and only a real browser shows that.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway

CHROMIUM = os.environ.get("ROLLWAY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set ROLLWAY_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, sqlite_url: str) -> Iterator[LiveGateway]:
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as g:
        yield g


def test_signing_in_and_out_in_a_browser(browser: Any, gw: LiveGateway, tmp_path: Path) -> None:
    context = browser.new_context(viewport={"width": 900, "height": 600})
    page = context.new_page()
    try:
        page.goto(f"{gw.url}/ui/api/me?from=browser")
        assert page.url == f"{gw.url}/ui/login?next=%2Fui%2Fapi%2Fme%3Ffrom%3Dbrowser"
        page.fill("#key", "rw-not-a-key")
        page.click("button[type=submit]")
        assert page.locator("[role=alert]").inner_text() == "That key is not valid."
        page.screenshot(path=str(tmp_path / "login-wrong-key.png"))
        page.fill("#key", ADMIN_KEY)
        page.click("button[type=submit]")
        page.wait_for_url(f"{gw.url}/ui/api/me?from=browser")
        assert '"role":"admin"' in page.content()
        (cookie,) = context.cookies()
        assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == \
               ("rollway_ui", True, "Strict", "/ui")
        assert ADMIN_KEY not in cookie["value"]
        stored = page.evaluate("[document.cookie, JSON.stringify(localStorage), JSON.stringify(sessionStorage)]")
        assert stored == ["", "{}", "{}"]
        status = page.evaluate("fetch('/ui/logout', {method: 'POST'}).then(r => r.url)")
        assert status.endswith("/ui/login")
        page.goto(f"{gw.url}/ui/api/me")
        assert page.url.startswith(f"{gw.url}/ui/login")
    finally:
        context.close()


def test_a_viewer_signs_in_and_is_signed_out_by_revocation(browser: Any, gw: LiveGateway) -> None:
    made = gw.admin.post("/v1/viewer_keys", json={"name": "browser"}).json()
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(f"{gw.url}/ui/login?next=/ui/api/me")
        page.fill("#key", made["key"])
        page.click("button[type=submit]")
        page.wait_for_url(f"{gw.url}/ui/api/me")
        assert '"role":"viewer"' in page.content()
        assert gw.admin.delete(f"/v1/viewer_keys/{made['id']}").status_code == 200
        page.reload()
        assert page.url.startswith(f"{gw.url}/ui/login")
    finally:
        context.close()
