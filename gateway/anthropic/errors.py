"""Anthropic's error shape on the Messages routes, for every failure there, wherever it is raised.

The routes raise the gateway's usual errors and the usual boundaries (`routes.dispatch`, the FastAPI
handlers, the NUL-in-URL check, a 405) answer them in OpenAI's envelope. For a request on an Anthropic path
`GatewayApp` wraps the ASGI `send` with `anthropic_errors`: an answer of status 400 or more is rewritten to
`{"type": "error", "error": {"type", "message"}}` with Anthropic's status (`errors.anthropic_error`: a 503 is
a 529 overloaded_error). Successful answers pass through untouched, and other paths never get the wrapper
(one substring test per request).

Anthropic paths: `/v1/messages` and everything under it, at `/v1/...` or `/sessions/{id}/v1/...`; and
`/v1/models` (and `/v1/models/{id}`) when the request carries an `anthropic-version` header (the Anthropic
SDK always sends one), so an OpenAI client keeps OpenAI's shape there.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.routing import get_route_path

from gateway.errors import anthropic_error


def anthropic_path(scope: Any) -> bool:
    path: str = scope["path"]
    if "/v1/m" not in path:  # the fast exit for every other route
        return False
    path = get_route_path(scope)
    if path.startswith("/sessions/"):
        path = "/" + path[len("/sessions/"):].partition("/")[2]
    if path.startswith("/v1/messages"):
        return True
    if path.startswith("/v1/models"):
        return any(k == b"anthropic-version" for k, _ in scope.get("headers", ()))
    return False


def _message(body: bytes, status: int) -> str:
    try:
        err = orjson.loads(body).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return body.decode(errors="replace").strip() or f"HTTP {status}"


def anthropic_errors(send: Any) -> Any:
    """`send` with error answers rewritten to Anthropic's shape (the whole error body is held, then sent)."""
    held: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def wrapped(message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start" and message["status"] >= 400:
            held.update(message)
            return
        if kind != "http.response.body" or not held:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        status, body = anthropic_error(held["status"], _message(b"".join(chunks), held["status"]))
        raw = orjson.dumps(body)
        headers = [(k, v) for k, v in held.get("headers", ()) if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": raw})

    return wrapped
