"""`create_app(settings)`: the gateway's FastAPI app. Services live on `app.state`, made in the lifespan.

The agent-facing OpenAI routes are plain ASGI in front of it (`routes.dispatch`); the admin and REST routes
are FastAPI. Errors of both are mapped to OpenAI's envelope in one place (`routes.common.error_response`); a
client never sees a traceback or a 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.anthropic_errors import anthropic_errors, anthropic_path
from gateway.changes import Changes
from gateway.errors import GatewayError
from gateway.metrics import Metrics, RequestMetrics
from gateway.pool import Backend, BackendPool
from gateway.proxies import TrustedProxies
from gateway.routes.backends import Registry
from gateway.routes.common import STORE_UNAVAILABLE, error_response
from gateway.routes.dispatch import ErrorBoundary, SessionRoutes, nul_in_url, refuse_nul
from gateway.samples import DEPRECATED_GAMMA, LeaseSamples
from gateway.sessions_cache import SessionCache
from gateway.settings import Settings
from gateway.sglang import BackendError
from gateway.store.db import create_engine
from gateway.store.leases import Leases
from gateway.store.store import Store
from gateway.templating import ChatTemplate
from gateway.turns import TurnService
from gateway.weights import Admission, Publisher

log = logging.getLogger("rollway.gateway")


def load_template(settings: Settings) -> ChatTemplate:
    from transformers import AutoTokenizer

    if not settings.tokenizer:
        raise ValueError("no tokenizer: pass --tokenizer DIR (an HF model folder with a chat template)")
    tok = AutoTokenizer.from_pretrained(settings.tokenizer)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {settings.tokenizer} has no chat template")
    template = ChatTemplate(tok, tool_parser=settings.tool_parser, reasoning_parser=settings.reasoning_parser,
                            allow_special_tokens_in_content=settings.allow_special_tokens_in_content)
    if template.tool_parser is None and settings.tool_parser == "auto":
        log.warning("the chat template of %s writes tool calls in no format the gateway knows: requests with "
                    "tools will be refused (400) until --tool-parser names the format; requests without tools "
                    "are served (docs/models.md)", settings.tokenizer)
    log.info("model formats of %s: %s", settings.tokenizer, template.formats.describe())
    return template


def config_context_length(tokenizer_dir: str) -> int | None:
    cfg = Path(tokenizer_dir) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    value = data.get("max_position_embeddings") or data.get("n_positions")
    return int(value) if value else None


async def detect_context_length(pool: BackendPool, settings: Settings) -> int:
    """Backend's /server_info, else the model's config.json, else --context-length (docs/architecture.md)."""
    for backend in pool.backends():
        with contextlib.suppress(BackendError):  # an unreachable backend just doesn't tell us
            info = await backend.client.server_info()
            for key in ("context_length", "max_req_input_len"):
                if info.get(key):
                    return int(info[key])
    return config_context_length(settings.tokenizer) or settings.context_length or 4096


def served_name(settings: Settings) -> str:
    return settings.served_model_name or Path(settings.tokenizer.rstrip("/")).name or "rollway"


class GatewayApp(FastAPI):
    """FastAPI, with the agent-facing OpenAI routes served ahead of its middleware stack (`routes.dispatch`),
    and every request of both kinds counted by `RequestMetrics`. A middleware added with `add_middleware`
    (CORS, say) wraps the FastAPI routes only; wrap the app itself to reach the OpenAI routes too."""

    def __init__(self, *, routes: dict[str, Any], trusted_proxies: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        fastapi_app = ErrorBoundary(functools.partial(FastAPI.__call__, self))
        self._entry: Any = RequestMetrics(SessionRoutes(fastapi_app, routes))
        if trusted_proxies:  # X-Forwarded-* from these peers only (gateway.proxies); run with proxy_headers=False
            self._entry = TrustedProxies(self._entry, trusted_proxies)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = self
        if scope["type"] == "http" and anthropic_path(scope):
            send = anthropic_errors(send)  # Anthropic's error shape on the Messages routes (gateway.anthropic_errors)
        if scope["type"] == "http" and nul_in_url(scope):
            await refuse_nul(scope, receive, send)
            return
        await self._entry(scope, receive, send)


def create_app(settings: Settings, *, admin_key: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(create_engine(settings.db_url))
        await store.open()
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=settings.backend_timeout_s),
        )
        if "gamma" in settings.model_fields_set:
            log.warning(DEPRECATED_GAMMA, settings.gamma)
        leases = Leases(store, LeaseSamples(settings.gamma))
        metrics = Metrics()

        async def on_recover(backend: Backend) -> None:
            await publisher.sync_backend(backend)

        pool = BackendPool(http, health_interval=settings.health_interval_s, on_recover=on_recover,
                           client_options={"read_timeout": settings.backend_timeout_s,
                                           "api_key": settings.backend_api_key,
                                           "admin_api_key": settings.backend_admin_api_key})
        publisher = Publisher(pool, leases, metrics)
        for url in settings.backends:
            pool.add(url)
        await publisher.sync_all()
        registry = Registry(pool, store, settings.backends)
        await registry.reload()  # the backends added at run time, through any gateway
        template = await asyncio.to_thread(load_template, settings)
        ctx = await detect_context_length(pool, settings)
        app.state.settings = settings
        app.state.store = store
        app.state.pool = pool
        app.state.template = template
        app.state.metrics = metrics
        app.state.leases = leases
        app.state.publisher = publisher
        app.state.admission = Admission(leases, settings, metrics)
        app.state.completions = Changes(poll_s=0.25)  # a group completed: lease long-polls look again
        app.state.budget = Changes(poll_s=1.0)  # room under the staleness budget: a waiting creation looks again
        store.on_group_end = lambda state: (app.state.completions.notify() if state == "complete"
                                            else app.state.budget.notify_one())
        app.state.context_length = ctx
        app.state.model_name = served_name(settings)
        app.state.turns = TurnService(
            store=store, template=template, cache=SessionCache(store), metrics=metrics, context_length=ctx,
            reasoning=settings.reasoning, chat_template_kwargs=settings.chat_template_kwargs,
        )
        await pool.start()
        supervisor = getattr(app.state, "engine_supervisor", None)
        if supervisor is not None:  # `rollway serve`'s embedded engine (rollway/embedded.py): deaths and restarts
            supervisor.attach(asyncio.get_running_loop(), pool)
        sweeper = asyncio.create_task(_sweep_idle(store, settings.session_idle_timeout_s))
        app.state.registry = registry
        follower = asyncio.create_task(app.state.registry.follow(settings.health_interval_s))
        _tune_gc()
        log.info("gateway started: %d backend(s), context length %d (GET /ready says whether one answers)",
                 len(pool.backends()), ctx)
        try:
            yield
        finally:
            sweeper.cancel()
            follower.cancel()
            await pool.stop()
            await http.close()
            await store.close()

    from gateway import openapi, viewer_auth
    from gateway.routes import (
        anthropic_api,
        backends,
        groups,
        openai_api,
        responses,
        system,
        training,
        training_reports,
        viewer_keys,
    )

    # anthropic_api last: its /v1/models answers Anthropic clients and hands OpenAI clients to openai_api's
    app = GatewayApp(routes={**openai_api.ROUTES, **responses.ROUTES, **anthropic_api.ROUTES}, title="rollway gateway",
                     lifespan=lifespan, trusted_proxies=settings.trusted_proxies)
    app.state.admin_key = admin_key
    _install_error_handlers(app)
    app.include_router(groups.router)
    app.include_router(training.router)
    app.include_router(backends.router)
    app.include_router(system.router)
    app.include_router(viewer_keys.router)
    app.include_router(training_reports.router)
    viewer_auth.install(app)  # /ui/login, /ui/logout; a browser without a sign-in is sent there
    from gateway.ui import install as install_viewer
    install_viewer(app)  # the viewer's pages, their JSON and static files (docs/viewer.md)
    openapi.install(app)
    return app


def _tune_gc() -> None:
    """The collector's share of a chat completion, from ~0.2 ms to ~0.03 ms (benchmarks/gateway.py, C=32).

    Everything loaded so far (transformers, tokenizer, template, SQLAlchemy: ~300k objects) lives as long as
    the process: frozen, out of the collector's sight, a full collection no longer walks it. And a young
    collection costs about the same whatever its threshold (it walks what the requests in flight hold), so
    one every 5,000 allocations instead of every 700 does a seventh of the work; garbage that only the
    collector can free (cycles) waits a little longer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(5000, 20, 20)


async def _sweep_idle(store: Store, idle_s: float) -> None:
    while True:
        await asyncio.sleep(min(60.0, max(1.0, idle_s / 4)))
        n = await store.abandon_idle(idle_s)
        if n:
            log.info("abandoned %d idle session(s)", n)


def _install_error_handlers(app: FastAPI) -> None:
    """FastAPI's routes answer errors as the OpenAI routes do (`error_response`)."""

    async def handle(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    # Each kind by name (an `Exception` handler alone answers, then re-raises to the server as a crash).
    for exc_type in (GatewayError, RequestValidationError, StarletteHTTPException, jinja2.TemplateError,
                     *STORE_UNAVAILABLE, Exception):
        app.add_exception_handler(exc_type, handle)
