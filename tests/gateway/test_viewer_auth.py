"""Viewer keys and the /ui sign-in, over real HTTP against a live gateway, on SQLite and PostgreSQL: every role
(admin, viewer, session, none, revoked) on every route kind, the cookie's attributes and lifetime, the
redirects (no open redirect), and the failed sign-in limit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.errors import Forbidden
from gateway.services import app_services
from gateway.sign_in import SESSION_TTL_S, SignInLimiter
from gateway.viewer_auth import COOKIE, UiCaller, safe_next
from tests.harness import ADMIN_KEY, LiveGateway


@pytest.fixture(scope="module")
def gw(gateway: LiveGateway) -> LiveGateway:
    return gateway


@pytest.fixture
def browser(gw: LiveGateway) -> Iterator[httpx.Client]:
    """A client that keeps cookies, as a browser does, and does not follow redirects (the tests look at them)."""
    with httpx.Client(base_url=gw.url, timeout=30, follow_redirects=False) as c:
        yield c


def viewer_key(gw: LiveGateway, name: str = "alice") -> dict[str, Any]:
    r = gw.admin.post("/v1/viewer_keys", json={"name": name})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def sign_in(browser: httpx.Client, key: str, next_path: str | None = None) -> httpx.Response:
    data = {"key": key, **({"next": next_path} if next_path is not None else {})}
    return browser.post("/ui/login", data=data)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_viewer_keys_are_created_listed_and_revoked_by_the_admin(gw: LiveGateway) -> None:
    made = viewer_key(gw, "dashboards")
    assert set(made) == {"id", "key", "name", "created_at"} and made["key"].startswith("rw-viewer-")
    listed = gw.admin.get("/v1/viewer_keys").json()["data"]
    mine = next(k for k in listed if k["id"] == made["id"])
    assert mine == {"id": made["id"], "name": "dashboards", "created_at": made["created_at"], "revoked_at": None}
    assert made["key"] not in gw.admin.get("/v1/viewer_keys").text  # shown once, never listed
    r = gw.admin.delete(f"/v1/viewer_keys/{made['id']}")
    assert r.status_code == 200 and r.json()["revoked"] is True and r.json()["revoked_at"] > 0
    again = gw.admin.delete(f"/v1/viewer_keys/{made['id']}")  # idempotent: the same revocation time
    assert again.status_code == 200 and again.json()["revoked_at"] == r.json()["revoked_at"]
    missing = gw.admin.delete("/v1/viewer_keys/vk_nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    bad = gw.admin.post("/v1/viewer_keys", json={"name": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
    assert gw.admin.post("/v1/viewer_keys", json={"name": "x", "role": "admin"}).status_code == 400


def test_every_role_on_every_route_kind(gw: LiveGateway) -> None:
    """Viewer keys open nothing but /ui: 403 naming the reason on admin, session and OpenAI routes; a revoked
    one is a key nobody issued (401). Session keys cannot manage viewer keys (403), no key is a 401."""
    session = gw.group(2)["sessions"][0]
    live, revoked = viewer_key(gw, "live"), viewer_key(gw, "gone")
    gw.admin.delete(f"/v1/viewer_keys/{revoked['id']}")
    routes = [
        ("GET", "/v1/weights", None),  # admin
        ("POST", "/v1/viewer_keys", {"name": "more"}),  # admin
        ("GET", "/v1/viewer_keys", None),  # admin
        ("POST", "/v1/training/steps", {"step": 1, "version": 1}),  # admin (the trainer)
        ("GET", f"/v1/sessions/{session['session_id']}", None),  # admin or that session
        ("POST", f"/v1/sessions/{session['session_id']}/finish", None),  # admin or that session
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),  # a session key
        ("GET", "/v1/models", None),  # a session key
    ]
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for method, path, body in routes:
            r = c.request(method, path, json=body, headers=bearer(live["key"]))
            assert r.status_code == 403, (path, r.text)
            assert "viewer key" in r.json()["error"]["message"] and r.json()["error"]["type"] == "permission_error"
            for who in (revoked["key"], "rw-made-up"):
                r = c.request(method, path, json=body, headers=bearer(who))
                assert r.status_code == 401, (path, r.text)
            assert c.request(method, path, json=body).status_code == 401
        for method, path in (("GET", "/v1/viewer_keys"), ("POST", "/v1/viewer_keys"),
                             ("DELETE", f"/v1/viewer_keys/{live['id']}")):
            r = c.request(method, path, headers=bearer(session["api_key"]), json={"name": "x"})
            assert r.status_code == 403, r.text
        # the /ui data a page fetches: every issued key, by bearer
        for key, role in ((ADMIN_KEY, "admin"), (live["key"], "viewer"), (session["api_key"], "session")):
            me = c.get("/ui/api/me", headers=bearer(key))
            assert me.status_code == 200 and me.json()["role"] == role, me.text
        assert c.get("/ui/api/me", headers=bearer(session["api_key"])).json()["session_id"] == session["session_id"]
        assert c.get("/ui/api/me", headers=bearer(revoked["key"])).status_code == 401
        assert c.get("/ui/api/me").status_code == 401
    # the session key still works where it did (nothing above ended it)
    assert gw.session(session["session_id"])["state"] == "active"


def test_sign_in_sets_a_strict_http_only_cookie_without_the_key(gw: LiveGateway, browser: httpx.Client) -> None:
    page = browser.get("/ui/login?next=/ui/groups")
    assert page.status_code == 200 and 'name="key"' in page.text and 'value="/ui/groups"' in page.text
    assert "/ui/static/ui.css" in page.text and page.headers["x-frame-options"] == "DENY"
    r = sign_in(browser, ADMIN_KEY, "/ui/groups?state=complete")
    assert r.status_code == 303 and r.headers["location"] == "/ui/groups?state=complete"
    cookie = r.headers["set-cookie"]
    attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
    assert {"httponly", "path", "samesite", "max-age"} <= attrs and "secure" not in attrs
    assert "samesite=strict" in cookie.lower() and "path=/ui" in cookie.lower()
    assert ADMIN_KEY not in cookie and ADMIN_KEY not in r.text
    me = browser.get("/ui/api/me")
    assert me.status_code == 200 and me.json() == {"role": "admin", "session_id": None}
    # the cookie is sent to /ui only (Path), and it opens no REST route
    assert browser.get("/v1/weights").status_code == 401
    # X-Forwarded-Proto from a peer that is no configured proxy changes nothing (test_forwarded_headers.py has
    # the trusted proxy's https)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        plain = c.post("/ui/login", data={"key": ADMIN_KEY}, headers={"X-Forwarded-Proto": "https"})
        assert plain.status_code == 303 and "secure" not in plain.headers["set-cookie"].lower()


def test_sign_out_and_a_changed_admin_key_end_the_cookie(gw: LiveGateway, browser: httpx.Client) -> None:
    assert sign_in(browser, ADMIN_KEY).headers["location"] == "/ui"
    token = browser.cookies[COOKIE]
    app_services(gw.app).admin_key = "rw-admin-another"
    try:
        assert browser.get("/ui/api/me").status_code == 401
    finally:
        app_services(gw.app).admin_key = ADMIN_KEY
    assert browser.get("/ui/api/me").status_code == 200
    out = browser.post("/ui/logout")
    assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    # the token itself no longer signs in (deleted in the store), not only the browser's copy
    with httpx.Client(base_url=gw.url, timeout=30, cookies={COOKIE: token}) as c:
        assert c.get("/ui/api/me").status_code == 401


def test_revoking_a_viewer_key_ends_its_sign_ins_at_once(gw: LiveGateway, browser: httpx.Client) -> None:
    key = viewer_key(gw, "bob")
    assert sign_in(browser, key["key"]).status_code == 303
    assert browser.get("/ui/api/me").json() == {"role": "viewer", "session_id": None}
    gw.admin.delete(f"/v1/viewer_keys/{key['id']}")
    r = browser.get("/ui/api/me")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # a browser asking for a page is sent to the sign-in form, back to where it was
    page = browser.get("/ui/api/me?x=1", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 303 and page.headers["location"] == "/ui/login?next=%2Fui%2Fapi%2Fme%3Fx%3D1"
    assert sign_in(browser, key["key"]).status_code == 401  # and the revoked key cannot sign in again


def test_a_session_key_signs_in_to_its_own_session(gw: LiveGateway, browser: httpx.Client) -> None:
    own, other = gw.group(2)["sessions"]
    r = sign_in(browser, own["api_key"])
    assert r.status_code == 303 and r.headers["location"] == f"/ui/sessions/{own['session_id']}"
    assert browser.get("/ui/api/me").json() == {"role": "session", "session_id": own["session_id"]}
    caller = UiCaller("session", own["session_id"])
    caller.require_session(own["session_id"])
    with pytest.raises(Forbidden):
        caller.require_session(other["session_id"])
    with pytest.raises(Forbidden):
        caller.require_run_wide()
    UiCaller("viewer").require_run_wide()
    UiCaller("viewer").require_session(other["session_id"])


@pytest.mark.parametrize("target", [
    "https://evil.example/ui", "//evil.example/ui", "/\\evil.example", "/ui\\@evil", "javascript:alert(1)",
    "/uix", "/v1/weights", "", "/ui/../v1", "/ui/%2e%2e/v1", "ui/groups", "/ui\r\nSet-Cookie: x=1",
])
def test_no_open_redirect(target: str) -> None:
    assert safe_next(target) == "/ui"
    assert safe_next("/ui/groups?page=2#top") == "/ui/groups?page=2#top"


def test_failed_sign_ins_are_refused_then_limited(gw: LiveGateway, browser: httpx.Client,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    app_services(gw.app).ui_sign_in_limiter = SignInLimiter(max_failures=3, window_s=60)
    try:
        for _ in range(3):
            r = sign_in(browser, "rw-guess")
            assert r.status_code == 401 and "not valid" in r.text and COOKIE not in r.headers.get("set-cookie", "")
        limited = sign_in(browser, "")  # the 4th try within the window, even with no key
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        # the right key still signs in: ten wrong keys from a shared address (every local user is 127.0.0.1)
        # must not lock the admin out
        assert sign_in(browser, ADMIN_KEY).status_code == 303
        assert sign_in(browser, "rw-guess").status_code == 429  # and the address stays limited for wrong ones
        assert any("failed /ui sign-in" in rec.getMessage() for rec in caplog.records)
        assert "rw-guess" not in caplog.text
    finally:
        app_services(gw.app).ui_sign_in_limiter = SignInLimiter()
    assert sign_in(browser, ADMIN_KEY).status_code == 303


def test_a_sign_in_expires(gw: LiveGateway, browser: httpx.Client) -> None:
    app_services(gw.app).ui_session_ttl_s = 1.5
    try:
        r = sign_in(browser, ADMIN_KEY)
        assert "max-age=1" in r.headers["set-cookie"].lower()
    finally:
        app_services(gw.app).ui_session_ttl_s = SESSION_TTL_S
    token = browser.cookies[COOKIE]
    assert browser.get("/ui/api/me").status_code == 200
    time.sleep(1.6)
    with httpx.Client(base_url=gw.url, timeout=30, cookies={COOKIE: token}) as c:  # a browser that kept it
        assert c.get("/ui/api/me").status_code == 401


def test_a_browser_without_a_sign_in_is_sent_to_the_form(gw: LiveGateway, browser: httpx.Client) -> None:
    page = browser.get("/ui/api/me", headers={"Accept": "text/html"})
    assert page.status_code == 303 and page.headers["location"] == "/ui/login?next=%2Fui%2Fapi%2Fme"
    script = browser.get("/ui/api/me", headers={"Accept": "application/json"})
    assert script.status_code == 401 and script.json()["error"]["type"] == "authentication_error"
    with httpx.Client(base_url=gw.url, timeout=30, cookies={COOKIE: "made-up"}) as forged:
        assert forged.get("/ui/api/me", headers={"Accept": "text/html"}).status_code == 303
        assert forged.get("/ui/api/me").status_code == 401


def test_forms_posted_from_another_site_are_refused(gw: LiveGateway, browser: httpx.Client) -> None:
    evil = {"Origin": "https://evil.example"}
    r = browser.post("/ui/login", data={"key": ADMIN_KEY}, headers=evil)
    assert r.status_code == 403 and "set-cookie" not in r.headers  # no login CSRF with a key of its choosing
    same = browser.post("/ui/login", data={"key": ADMIN_KEY}, headers={"Origin": gw.url})
    assert same.status_code == 303
    assert browser.post("/ui/logout", headers=evil).status_code == 403
    assert browser.get("/ui/api/me").status_code == 200  # still signed in
    assert browser.post("/ui/logout", headers={"Origin": gw.url}).status_code == 303


@pytest.mark.parametrize("body", [
    b"&".join(b"f%d=1" % i for i in range(50)),  # more fields than the form has
    b"key=\xff\xfe%00%ff&next=%00",  # not UTF-8, NULs
    b"key=" + b"x" * 100_000,
    b'{"key": "rw-admin-test-key"}',  # JSON is not the form
    b"",
])
def test_hostile_sign_in_bodies_are_answered_never_a_500(gw: LiveGateway, body: bytes) -> None:
    app_services(gw.app).ui_sign_in_limiter = SignInLimiter()
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/ui/login", content=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code in (400, 401) and "set-cookie" not in r.headers, r.text[:200]
