"""The viewer's sign-in routes (/ui/login, /ui/logout, /ui/api/me) and the handler that sends a browser without a
sign-in to /ui/login; who a caller is, is gateway/viewer_auth.py's (docs/viewer-auth.md)."""

from __future__ import annotations

import html
import logging
import urllib.parse

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from gateway.errors import Forbidden, TooManyRequests
from gateway.proxies import forwarded_host
from gateway.routes.common import error_response, json_response, read_raw_body
from gateway.services import services
from gateway.sign_in import SignInLimiter
from gateway.viewer_auth import COOKIE, LOGIN, UiSignInRequired, identify, safe_next, ui_caller

log = logging.getLogger("rollway.gateway")

router = APIRouter()

_FALLBACK_CSS = """body{font:15px/1.4 system-ui,sans-serif;background:#f6f7f9;color:#1c2330;margin:0}
.login{max-width:22rem;margin:12vh auto;background:#fff;padding:1.5rem 2rem;border-radius:8px;
box-shadow:0 1px 4px #0002}.login h1{font-size:1.3rem;margin:0 0 1rem}.login label{display:block;margin:.5rem 0}
.login input[type=password]{width:100%;box-sizing:border-box;padding:.45rem;font:inherit}
.login button{margin-top:.8rem;padding:.45rem 1.2rem;font:inherit}.login .error{color:#b3261e}
.login .hint{color:#5b6472;font-size:.85rem}"""

_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",  # no clickjacking of the form
    "Content-Security-Policy": "default-src 'none'; style-src 'self' 'unsafe-inline'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "Referrer-Policy": "same-origin",  # not no-referrer: a browser would then post the form with Origin: null
}


def login_page(next_path: str, error: str | None = None, status: int = 200) -> HTMLResponse:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    body = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sign in · rollway</title><style>{_FALLBACK_CSS}</style><link rel="stylesheet" href="/ui/static/ui.css">
</head><body><main class="login"><h1>rollway viewer</h1>{message}
<form method="post" action="{LOGIN}">
<input type="hidden" name="next" value="{html.escape(next_path)}">
<label for="key">Key</label><input id="key" name="key" type="password" autocomplete="current-password" required
 autofocus placeholder="admin, viewer or session key">
<button type="submit">Sign in</button></form>
<p class="hint">The admin key, a read-only viewer key (POST /v1/viewer_keys), or a session key (its own session
only). The key is not stored in the browser: a sign-in cookie is.</p></main></body></html>"""
    return HTMLResponse(body, status, headers=_HEADERS)


def _limiter(request: Request) -> SignInLimiter:
    return services(request).ui_sign_in_limiter


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


@router.get(LOGIN, include_in_schema=False)
async def login_form(request: Request) -> Response:
    return login_page(safe_next(request.query_params.get("next")))


def _cross_site(request: Request) -> bool:
    """A form posted from another site's page (its Origin is not this host): refused, so no other site can sign
    a browser in with a key of its choosing (login CSRF) or out. A client that sends no Origin is no browser."""
    origin = request.headers.get("origin")
    if origin is None:
        return False
    # A proxy may rewrite Host: its X-Forwarded-Host counts, from a trusted proxy only (gateway.proxies).
    hosts = {request.headers.get("host", "").lower(), forwarded_host(request)}
    return urllib.parse.urlsplit(origin).netloc.lower() not in hosts - {""}


@router.post(LOGIN, include_in_schema=False)
async def login(request: Request) -> Response:
    if _cross_site(request):
        return login_page("/ui", "Sign in from this site's own form.", 403)
    client = _client(request)
    limiter = _limiter(request)
    try:
        form = urllib.parse.parse_qs((await read_raw_body(request)).decode("utf-8", "replace"), max_num_fields=10)
    except ValueError:  # more fields than the form has
        return login_page("/ui", "The form was not understood.", 400)
    key = (form.get("key") or [""])[0].strip()
    next_path = safe_next((form.get("next") or [""])[0])
    found = await identify(request, key) if key else None
    if found is None:
        try:
            limiter.check(client)
        except TooManyRequests as e:  # past the limit: refused without a log line each
            response = login_page("/ui", e.message, 429)
            response.headers["Retry-After"] = str(max(1, round(e.retry_after or 1)))
            return response
        n = limiter.failed(client)
        log.warning("failed /ui sign-in from %s (%d in the last %.0f s)", client, n, limiter.window_s)
        return login_page(next_path, "That key is not valid.", 401)
    role, viewer_key_id, session_id = found
    ttl = services(request).ui_session_ttl_s
    token = await services(request).store.create_ui_session(
        role=role, credential=key, ttl_s=ttl, viewer_key_id=viewer_key_id, session_id=session_id)
    if role == "session" and next_path == "/ui":
        next_path = f"/ui/sessions/{session_id}"  # the one page a session key may open
    log.info("/ui sign-in as %s from %s", role, client)
    redirect = RedirectResponse(next_path, 303, headers={"Cache-Control": "no-store"})
    redirect.set_cookie(COOKIE, token, max_age=int(ttl), path="/ui", httponly=True, samesite="strict",
                        secure=_https(request))
    return redirect


@router.post("/ui/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    if _cross_site(request):
        raise Forbidden("sign out from this site's own page")
    token = request.cookies.get(COOKIE)
    if token:
        await services(request).store.delete_ui_session(token)
    response = RedirectResponse(LOGIN, 303, headers={"Cache-Control": "no-store"})
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict", secure=_https(request))
    return response


@router.get("/ui/api/me", include_in_schema=False)
async def me(request: Request) -> Response:
    """Who is signed in (for a page's header and its sign-out button): `{role, session_id}`."""
    caller = await ui_caller(request)
    return json_response({"role": caller.role, "session_id": caller.session_id}, headers={"Cache-Control": "no-store"})


def _https(request: Request) -> bool:
    """The scheme the browser used: a trusted proxy's X-Forwarded-Proto has already set it (gateway.proxies)."""
    return request.url.scheme == "https"


def wants_html(request: Request) -> bool:
    return request.method in ("GET", "HEAD") and "text/html" in request.headers.get("accept", "")


def install(app: FastAPI) -> None:
    """The sign-in routes, and the handler that sends a browser without a sign-in to /ui/login."""

    async def sign_in(request: Request, exc: Exception) -> Response:
        if wants_html(request):
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"{LOGIN}?next={urllib.parse.quote(safe_next(target), safe='')}", 303)
        return error_response(exc)

    app.add_exception_handler(UiSignInRequired, sign_in)
    app.include_router(router)
