"""Who is looking at the /ui pages: the admin, a viewer (a read-only key) or one session (its key).

A browser signs in once at /ui/login with one of those keys and gets a cookie holding a random token whose
SHA-256 the store keeps with the role and an expiry (`ui_sessions`): HttpOnly (no script reads it), SameSite
Strict (no other site's page sends it, which with the viewer being read-only is the CSRF defence), Path=/ui,
Secure over https. The key itself is never in the cookie or in JavaScript. Scripts and tools may instead
send `Authorization: Bearer <key>`. docs/viewer-auth.md is the user-facing account.

For the pages (gateway/ui/):

    @router.get("/ui/groups")
    async def groups(request: Request, caller: UiCaller = Depends(ui_caller)) -> Response:
        caller.require_run_wide()          # admin or viewer; a session key gets 403
        ...
    caller.require_session(session_id)     # a session key sees only its own session (403)

Without credentials `ui_caller` raises `UiSignInRequired` (a 401): a browser asking for HTML is redirected
to /ui/login?next=<the page> instead (the handler gateway/routes/ui_sign_in.py `install` adds, with the
sign-in routes).
"""

from __future__ import annotations

import hmac
import urllib.parse
from dataclasses import dataclass
from typing import Literal

from fastapi import Request

from gateway.auth import bearer, is_admin_key
from gateway.errors import Forbidden, Unauthorized
from gateway.services import services
from gateway.store.store import hash_key

COOKIE = "rollway_ui"
LOGIN = "/ui/login"

Role = Literal["admin", "viewer", "session"]


@dataclass(frozen=True, slots=True)
class UiCaller:
    role: Role
    session_id: str | None = None
    """Set only for role "session": the one session this caller may see."""

    def require_run_wide(self) -> None:
        """Pages over the whole run (overview, groups, search): the admin or a viewer."""
        if self.role == "session":
            raise Forbidden("a session key opens only its own session's page (/ui/sessions/<its id>)")

    def require_session(self, session_id: str) -> None:
        """One session's page or data: the admin, a viewer, or that session's own key."""
        if self.role == "session" and session_id != self.session_id:
            raise Forbidden("a session key can only see its own session")


class UiSignInRequired(Unauthorized):
    """No credentials, or a cookie that no longer signs in: a browser asking for a page goes to /ui/login."""


async def identify(request: Request, key: str) -> tuple[Role, str | None, str | None] | None:
    """(role, viewer key id, session id) of a key, or None for a key nobody issued."""
    if is_admin_key(request, key):
        return "admin", None, None
    store = services(request).store
    viewer = await store.viewer_key_id(key)
    if viewer is not None:
        return "viewer", viewer, None
    auth = await store.session_auth(key=key)
    if auth is not None:
        return "session", None, auth.id
    return None


async def ui_caller(request: Request) -> UiCaller:
    """The caller of a /ui page or of the data it fetches (a FastAPI dependency): a bearer key, else the cookie."""
    key = bearer(request)
    if key is not None:
        found = await identify(request, key)
        if found is None:
            raise Unauthorized("unknown API key")
        return UiCaller(found[0], found[2])
    token = request.cookies.get(COOKIE)
    if not token:
        raise UiSignInRequired("sign in at /ui/login (or send 'Authorization: Bearer <key>')")
    row = await services(request).store.ui_session(token)
    if row is None:
        raise UiSignInRequired("signed out: the sign-in expired or its key was revoked; sign in again at /ui/login")
    if row["role"] == "admin" and not hmac.compare_digest(row["credential_hash"], hash_key(services(request).admin_key)):
        raise UiSignInRequired("signed out: the admin key changed; sign in again at /ui/login")
    return UiCaller(row["role"], row["session_id"])


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path under /ui on this site, else /ui (no open redirect)."""
    if not target or any(c in target for c in "\\\r\n\t") or not target.startswith("/ui"):
        return "/ui"
    parts = urllib.parse.urlsplit(target)
    if parts.scheme or parts.netloc or target.startswith("//") or not (parts.path == "/ui" or
                                                                       parts.path.startswith("/ui/")):
        return "/ui"
    if any(seg in (".", "..") for seg in urllib.parse.unquote(parts.path).split("/")):
        return "/ui"  # /ui/../v1 would leave /ui
    return target
