"""Forwarded headers are believed from configured proxies only (gateway.proxies; issue 29 item 10), on SQLite and
PostgreSQL: rotating X-Forwarded-For from loopback no longer escapes the sign-in limiter, X-Forwarded-Host no
longer passes the CSRF check, X-Forwarded-Proto no longer makes the cookie Secure; a configured proxy's headers
are believed (the client address, the scheme, the host)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.services import app_services
from gateway.settings import Settings
from gateway.sign_in import SignInLimiter
from tests.harness import ADMIN_KEY, LiveGateway


def sign_in(gw: LiveGateway, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        return c.post("/ui/login", data={"key": key}, headers=headers or {})


def test_rotating_x_forwarded_for_does_not_escape_the_limiter(gateway: LiveGateway) -> None:
    app_services(gateway.app).ui_sign_in_limiter = SignInLimiter(max_failures=10, window_s=60)
    try:
        for i in range(10):
            r = sign_in(gateway, "rw-guess", {"X-Forwarded-For": f"203.0.113.{i}"})
            assert r.status_code == 401
        r = sign_in(gateway, "rw-guess", {"X-Forwarded-For": "203.0.113.99"})  # a new "address": the same peer
        assert r.status_code == 429
        assert sign_in(gateway, ADMIN_KEY).status_code == 303  # the right key is never locked out
    finally:
        app_services(gateway.app).ui_sign_in_limiter = SignInLimiter()


def test_x_forwarded_host_does_not_pass_the_csrf_check(gateway: LiveGateway) -> None:
    r = sign_in(gateway, ADMIN_KEY, {"Origin": "http://evil", "X-Forwarded-Host": "evil"})
    assert r.status_code == 403 and "set-cookie" not in r.headers


@pytest.fixture(scope="module")
def proxied(fake_url: str, tiny_model_dir: Path, db_url: str) -> Iterator[LiveGateway]:
    """A gateway behind a proxy on 127.0.0.1 (the tests' own address, standing in for it)."""
    with LiveGateway(backends=[fake_url], tokenizer=str(tiny_model_dir), db=db_url,
                     trusted_proxies=["127.0.0.1"]) as gw:
        yield gw


@pytest.fixture(scope="module")
def fake_url(fake: object) -> str:
    return fake.url  # type: ignore[attr-defined,no-any-return]


def test_a_trusted_proxy_is_believed(proxied: LiveGateway) -> None:
    app_services(proxied.app).ui_sign_in_limiter = SignInLimiter(max_failures=3, window_s=60)
    try:
        for _ in range(3):
            assert sign_in(proxied, "rw-guess", {"X-Forwarded-For": "203.0.113.1"}).status_code == 401
        assert sign_in(proxied, "rw-guess", {"X-Forwarded-For": "203.0.113.1"}).status_code == 429
        # another client behind the proxy is another address
        assert sign_in(proxied, "rw-guess", {"X-Forwarded-For": "203.0.113.2"}).status_code == 401
    finally:
        app_services(proxied.app).ui_sign_in_limiter = SignInLimiter()
    tls = sign_in(proxied, ADMIN_KEY, {"X-Forwarded-Proto": "https"})
    assert tls.status_code == 303 and "secure" in tls.headers["set-cookie"].lower()
    renamed = sign_in(proxied, ADMIN_KEY, {"Origin": "https://rollway.example", "X-Forwarded-Host": "rollway.example"})
    assert renamed.status_code == 303  # the proxy rewrote Host; the browser's origin is the public name
    assert sign_in(proxied, ADMIN_KEY, {"Origin": "http://evil"}).status_code == 403


@pytest.mark.parametrize("value", ["10.0.0.5", "10.0.0.0/8", "::1", "fd00::/8", "10.0.0.5, 192.168.1.0/24"])
def test_trusted_proxies_setting(value: str) -> None:
    assert Settings(trusted_proxies=value).trusted_proxies  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["proxy.example", "10.0.0.300", "*"])
def test_trusted_proxies_must_be_addresses(value: str) -> None:
    with pytest.raises(ValueError, match="trusted proxy"):
        Settings(trusted_proxies=value)  # type: ignore[arg-type]


def test_settings_default_trusts_no_proxy() -> None:
    assert Settings().trusted_proxies == []
