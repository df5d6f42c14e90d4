"""The agent-facing OpenAI endpoints as plain ASGI, in front of the FastAPI app.

Every call an agent makes goes through these few routes, so they skip FastAPI's router, dependency
solving and exception middleware: that machinery was ~0.4 ms of the gateway's CPU per chat completion
(py-spy on `benchmarks/gateway.py`), as much as tokenizing the prompt. The admin and REST routes stay
FastAPI. A route answers with the same OpenAI error envelope (`common.error_response`), is counted by the
same metrics middleware (it sets `scope["route"]`), and is served at `/v1/...` (session key) and at
`/sessions/{session_id}/v1/...` (the id in the path).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.routing import get_route_path

from gateway.errors import error_body
from gateway.routes.common import error_response, json_response

Handler = Callable[[Request, str | None], Awaitable[Response]]


class RouteLabel(NamedTuple):
    """What the metrics middleware reads from `scope["route"]`: the route template."""

    path: str


class SessionRoutes:
    """ASGI middleware: serves `routes` ({"/v1/...": (method, handler)}) and passes anything else on."""

    def __init__(self, app: Any, routes: Mapping[str, tuple[str, Handler]]) -> None:
        self.app = app
        self.routes = dict(routes)
        self.by_key = {path: RouteLabel(path) for path in routes}
        self.by_path = {path: RouteLabel("/sessions/{session_id}" + path) for path in routes}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = get_route_path(scope)  # without a --root-path prefix, as Starlette routes
        session_id: str | None = None
        if path.startswith("/sessions/"):
            session_id, slash, rest = path[len("/sessions/"):].partition("/")
            path = slash + rest
            labels = self.by_path
        else:
            labels = self.by_key
        route = self.routes.get(path)
        if route is None or session_id == "":
            await self.app(scope, receive, send)
            return
        scope["route"] = labels[path]
        method, handler = route
        request = Request(scope, receive, send)
        try:
            if scope["method"] != method:
                response = json_response(error_body("Method Not Allowed", "invalid_request_error"), 405,
                                         {"Allow": method})
            else:
                response = await handler(request, session_id)
        except ClientDisconnect:
            return  # gone before its request was read: nothing was started, nobody to answer
        except Exception as exc:  # mapped to the OpenAI envelope (a 500 for a bug, logged)
            response = error_response(exc)
        await response(scope, receive, send)


class ErrorBoundary:
    """ASGI middleware around the FastAPI app: an exception that escapes a route never reaches the server.

    Starlette answers an unexpected exception with the registered handler (our envelope, a logged 500) and
    then re-raises it for the server, and uvicorn closes the connection: the client's next request on that
    keep-alive connection was reset. Here the re-raise ends: answered already, nothing more to do; and an
    exception before any answer gets the envelope."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if not started:
                await error_response(exc)(scope, receive, send)


def nul_in_url(scope: Any) -> bool:
    """A NUL character in the path or the query string: PostgreSQL can't compare text with one (it answered
    500 where SQLite answered 404), and no id, state or cursor of ours holds one."""
    return "\x00" in scope["path"] or b"%00" in scope.get("query_string", b"")


async def refuse_nul(scope: Any, receive: Any, send: Any) -> None:
    body = error_body("the URL holds a NUL character (%00), which is not accepted", "invalid_request_error")
    await json_response(body, 400)(scope, receive, send)

