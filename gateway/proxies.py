"""Forwarded headers (`X-Forwarded-For`, `-Proto`, `-Host`) are believed only from the proxies the settings name.

A client can send these headers itself. uvicorn believes them by default from 127.0.0.1, so on a shared machine
any local user could rotate `X-Forwarded-For` past the sign-in limiter, and the CSRF check took
`X-Forwarded-Host` from anyone. Now the servers that run the gateway turn uvicorn's own handling off
(`proxy_headers=False`: `rollway serve`, `rollway view`) and the app applies it here, for the addresses in
`ROLLWAY_TRUSTED_PROXIES` only (none by default): from one of them, the client address and scheme are taken
from the headers (uvicorn's `ProxyHeadersMiddleware`), and `forwarded_host` may be read; from anyone else the
headers are ignored.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from starlette.requests import Request
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

VIA_PROXY = "rollway.via_trusted_proxy"
"""Set in the ASGI scope of a request whose peer is a trusted proxy."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_proxies(values: list[str]) -> list[Network]:
    """Each entry an IP address or a network (CIDR); ValueError names the first that is neither."""
    out: list[Network] = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"trusted proxy {value!r} is not an IP address or network (e.g. 10.0.0.5, "
                             "10.0.0.0/8); host names are not accepted") from None
    return out


class TrustedProxies:
    """ASGI middleware: uvicorn's proxy-header handling, for peers in `proxies` only."""

    def __init__(self, app: Any, proxies: list[str]) -> None:
        self._app = app
        self._networks = parse_proxies(proxies)
        self._inner = ProxyHeadersMiddleware(app, trusted_hosts=[str(n) for n in self._networks])

    def trusts(self, host: str | None) -> bool:
        try:
            address = ipaddress.ip_address(host or "")
        except ValueError:
            return False
        return any(address in n for n in self._networks)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            client = scope.get("client")
            if client and self.trusts(client[0]):
                scope[VIA_PROXY] = True
                await self._inner(scope, receive, send)
                return
        await self._app(scope, receive, send)


def forwarded_host(request: Request) -> str:
    """`X-Forwarded-Host` of a request that came through a trusted proxy, else ''."""
    if not request.scope.get(VIA_PROXY):
        return ""
    return request.headers.get("x-forwarded-host", "").split(",")[0].strip().lower()
