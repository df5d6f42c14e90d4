"""`create_app(settings)`: the gateway's FastAPI app. Its services are one typed `Services` object
(gateway/services.py), made in the lifespan by the factory `rollway view` uses too.

The agent-facing OpenAI routes are plain ASGI in front of it (`routes.dispatch`); the admin and REST routes
are FastAPI. Errors of both are mapped to OpenAI's envelope in one place (`routes.common.error_response`); a
client never sees a traceback or a 422.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.anthropic.errors import anthropic_errors, anthropic_path
from gateway.errors import GatewayError
from gateway.metrics import RequestMetrics
from gateway.proxies import TrustedProxies
from gateway.routes.common import error_response
from gateway.routes.dispatch import ErrorBoundary, SessionRoutes, nul_in_url, refuse_nul
from gateway.services import EngineSupervision, install, open_services, scope_metrics
from gateway.settings import Settings
from gateway.store.db import STORE_UNAVAILABLE

log = logging.getLogger("rollway.gateway")


class GatewayApp(FastAPI):
    """FastAPI, with the agent-facing OpenAI routes served ahead of its middleware stack (`routes.dispatch`),
    and every request of both kinds counted by `RequestMetrics`. A middleware added with `add_middleware`
    (CORS, say) wraps the FastAPI routes only; wrap the app itself to reach the OpenAI routes too."""

    def __init__(self, *, routes: dict[str, Any], trusted_proxies: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        fastapi_app = ErrorBoundary(functools.partial(FastAPI.__call__, self))
        self._entry: Any = RequestMetrics(SessionRoutes(fastapi_app, routes), scope_metrics)
        if trusted_proxies:  # X-Forwarded-* from these peers only (gateway.proxies); run with proxy_headers=False
            self._entry = TrustedProxies(self._entry, trusted_proxies)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = self
        if scope["type"] == "http" and anthropic_path(scope):
            send = anthropic_errors(send)  # Anthropic's error shape on the Messages routes (gateway.anthropic.errors)
        if scope["type"] == "http" and nul_in_url(scope):
            await refuse_nul(scope, receive, send)
            return
        await self._entry(scope, receive, send)


def create_app(settings: Settings, *, admin_key: str, engine_supervisor: EngineSupervision | None = None) -> FastAPI:
    """The gateway of `rollway serve`: its services (gateway/services.py) are built by `open_services` in the
    lifespan; `engine_supervisor` is the embedded engine's, when there is one."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_services(settings, admin_key=admin_key, engine_supervisor=engine_supervisor) as svc:
            install(app, svc)
            yield

    from gateway import openapi
    from gateway.anthropic import api as anthropic_api
    from gateway.routes import (
        backends,
        groups,
        openai_api,
        responses,
        system,
        training,
        training_reports,
        ui_sign_in,
        viewer_keys,
    )

    # anthropic_api last: its /v1/models answers Anthropic clients and hands OpenAI clients to openai_api's
    app = GatewayApp(routes={**openai_api.ROUTES, **responses.ROUTES, **anthropic_api.ROUTES}, title="rollway gateway",
                     lifespan=lifespan, trusted_proxies=settings.trusted_proxies)
    _install_error_handlers(app)
    app.include_router(groups.router)
    app.include_router(training.router)
    app.include_router(backends.router)
    app.include_router(system.router)
    app.include_router(viewer_keys.router)
    app.include_router(training_reports.router)
    ui_sign_in.install(app)  # /ui/login, /ui/logout; a browser without a sign-in is sent there
    from gateway.ui import install as install_viewer
    install_viewer(app)  # the viewer's pages, their JSON and static files (docs/viewer.md)
    openapi.install(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """FastAPI's routes answer errors as the OpenAI routes do (`error_response`)."""

    async def handle(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    # Each kind by name (an `Exception` handler alone answers, then re-raises to the server as a crash).
    for exc_type in (GatewayError, RequestValidationError, StarletteHTTPException, jinja2.TemplateError,
                     *STORE_UNAVAILABLE, Exception):
        app.add_exception_handler(exc_type, handle)
