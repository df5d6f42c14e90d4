"""Who is calling: an admin (bearer = admin key) or one session (its key, or its id in the path). A viewer key
(the /ui pages' read-only role: gateway/viewer_auth.py) is a 403 here.

Status map (docs/http-api.md "Auth"): missing or unknown key -> 401; a valid key on another session's or
an admin-only resource -> 403; unknown id -> 404; an ended session -> 409 (checked by the callers).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import Forbidden, NotFound, Unauthorized
from gateway.services import services
from gateway.store.store import SessionAuth


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_admin_key(request: Request, key: str | None) -> bool:
    admin: str = services(request).admin_key
    return key is not None and hmac.compare_digest(key.encode(), admin.encode())


async def refuse_viewer_key(request: Request, key: str) -> None:
    """A viewer key (issue 16) opens only the read-only /ui pages: 403 on every other route. Asked only once a
    key is neither the admin's nor a session's, so the calls of those keys pay nothing for it."""
    if await services(request).store.viewer_key_id(key) is not None:
        raise Forbidden("a viewer key is read-only and opens only the /ui pages; this route needs the admin key "
                        "or a session key")


async def admin(request: Request) -> None:
    """Admin-only routes: a session key is 403, a key nobody issued 401."""
    key = bearer(request)
    if key is None:
        raise Unauthorized("missing bearer key: send the admin key as 'Authorization: Bearer <key>'")
    if is_admin_key(request, key):
        return
    if await services(request).store.session_auth(key=key) is None:
        await refuse_viewer_key(request, key)
        raise Unauthorized("unknown API key")
    raise Forbidden("this route needs the admin key; a session key cannot use it")


def api_key(request: Request) -> str | None:
    """The key of an Anthropic-style call: `x-api-key` (what the Anthropic SDK sends with `api_key`), else the
    bearer token (what it sends with `auth_token`)."""
    key = request.headers.get("x-api-key")
    return key.strip() if key and key.strip() else bearer(request)


async def chat_session(request: Request, session_id: str | None, *, anthropic: bool = False) -> SessionAuth:
    """The session of an OpenAI call: by path id (no key needed: the id is the secret) or by key.
    `anthropic`: an Anthropic Messages call, whose key may also come as `x-api-key`."""
    store = services(request).store
    if session_id is not None:
        auth = await store.session_auth(session_id=session_id)
        if auth is None:
            raise NotFound(f"no session {session_id}")
        return auth
    key = api_key(request) if anthropic else bearer(request)
    if key is None:
        env = "ANTHROPIC_API_KEY" if anthropic else "OPENAI_API_KEY"
        raise Unauthorized(f"missing API key: set {env} to a session key from POST /v1/groups")
    auth = await store.session_auth(key=key)
    if auth is None:
        if is_admin_key(request, key):
            raise Forbidden("the admin key has no session; use a session key from POST /v1/groups")
        await refuse_viewer_key(request, key)
        raise Unauthorized("unknown API key")
    return auth


async def model_reader(request: Request, session_id: str | None, *, anthropic: bool = False) -> None:
    """`/v1/models` (+ `/{id}`): a session (as for a chat call) or the admin. The model list holds nothing
    private, and an operator checking what a gateway serves has the admin key at hand, not a session's."""
    if session_id is None and is_admin_key(request, api_key(request) if anthropic else bearer(request)):
        return
    await chat_session(request, session_id, anthropic=anthropic)


@dataclass(frozen=True, slots=True)
class Caller:
    admin: bool
    session_id: str | None


async def admin_or_session(request: Request, session_id: str) -> Caller:
    """Routes on one session: the admin, or that session itself (its key)."""
    key = bearer(request)
    if key is None:
        raise Unauthorized("missing bearer key")
    if is_admin_key(request, key):
        return Caller(True, None)
    auth = await services(request).store.session_auth(key=key)
    if auth is None:
        await refuse_viewer_key(request, key)
        raise Unauthorized("unknown API key")
    if auth.id != session_id:
        raise Forbidden("a session key can only read or change its own session")
    return Caller(False, auth.id)
