"""Browser fixtures: headless Chromium driven by Playwright, skipped cleanly where either is missing.

Chromium is the system's (`/usr/bin/chromium`, or `ROLLWAY_CHROMIUM`): Playwright's own browser download is
not reachable everywhere. Screenshots go to `$ROLLWAY_UI_SCREENSHOTS` (default: a pytest temp folder).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ADMIN_KEY

CHROMIUM = os.environ.get("ROLLWAY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Per module: Playwright's sync API keeps an event loop running in this thread while it lives, and the
    database fixtures of later modules call asyncio.run."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set ROLLWAY_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(os.environ.get("ROLLWAY_UI_SCREENSHOTS") or tmp_path_factory.mktemp("ui-screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def sign_in(browser: Any, base: str, key: str = ADMIN_KEY) -> Any:
    """A fresh browser context signed in with `key` through the /ui/login form (the cookie, no key kept)."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.goto(f"{base}/ui/login")
    page.fill("#key", key)
    with page.expect_navigation():  # the form's POST, then its redirect to the page asked for
        page.click("button[type=submit]")
    assert "/ui/login" not in page.url, f"sign-in failed: {page.inner_text('main')}"
    return page
