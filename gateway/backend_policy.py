"""What an admin may register as a backend (`POST /v1/backends`): docs/http-api.md "What a backend URL may be".

The gateway calls a registered URL from inside the deployment, with the backends' keys (`backend_api_key`,
`backend_admin_api_key`), and reports what it answered (`last_error`, the 400 of a failed registration). A
URL that leads to the cloud's instance-metadata service would turn the admin key into a way of reading the
machine's cloud credentials. So, on top of `settings.backend_url`'s checks (http or https, a valid host, a
port, no user, query or fragment), a registered URL's host may not be:

- link-local: 169.254.0.0/16 (the metadata services of AWS, GCP, Azure, OpenStack, ECS live there) or fe80::/10,
  also as an IPv4-mapped IPv6 address (::ffff:169.254.169.254);
- another cloud's metadata address (fd00:ec2::254, 100.100.100.200) or a metadata host name
  (metadata.google.internal, metadata, instance-data, ...);
- unspecified (0.0.0.0, ::), multicast or broadcast: no server is there;
- an IPv4 address in another form than four decimal numbers: decimal (2852039166), hex (0xa9fea9fe), octal
  (0251.0376.0251.0376) or short (169.254.43518) forms, which HTTP clients and resolvers read as addresses
  and a reader of the URL does not;
- a name that resolves to any of the above (checked when registering; `check_resolved`).

Loopback and private addresses are allowed: SGLang servers run on the same machine or the cluster network.
The health probe and every other call to a backend never follow a redirect (gateway.sglang), so a server
cannot send the gateway on to an address this policy refuses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import urllib.parse

METADATA_HOSTS = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
    "metadata.azure.com", "metadata.tencentyun.com", "metadata.platformequinix.com", "metadata.packet.net",
})
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})
# The WHATWG URL standard (and so browsers, curl, many resolvers) reads a host whose last label is a number
# (decimal, 0x-hex, 0-octal) as an IPv4 address.
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def refused_address(address: Address) -> str | None:
    """Why an address may not be a backend's, or None."""
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    if address.is_link_local:
        return "a link-local address (where cloud metadata services answer)"
    if address in METADATA_ADDRESSES:
        return "a cloud metadata service's address"
    if address.is_unspecified or address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
        return "not a server's address (unspecified, multicast or broadcast)"
    return None


def check_registrable(url: str) -> str:
    """`url` (already through `settings.backend_url`) if an admin may register it; ValueError says why not."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        if why := refused_address(address):
            raise ValueError(f"backend URL {url!r}: {host} is {why}; see docs/http-api.md")
        return url
    if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        raise ValueError(f"backend URL {url!r}: write an IPv4 address as four decimal numbers (a.b.c.d); "
                         f"{host!r} is read as an address in another form")
    if host in METADATA_HOSTS:
        raise ValueError(f"backend URL {url!r}: {host} is a cloud metadata service; see docs/http-api.md")
    return url


async def check_resolved(url: str) -> None:
    """ValueError when the URL's host name resolves to an address `refused_address` refuses. A name that does
    not resolve passes here (the health check that follows fails it)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return  # a literal address: check_registrable has seen it
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return
    for info in infos:
        try:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        except ValueError:
            continue
        if why := refused_address(address):
            raise ValueError(f"backend URL {url!r}: {host} resolves to {address}, {why}; see docs/http-api.md")
