"""The gateway's services, typed, in one place: `Services` on the app, built by one factory (`open_services`)
that `rollway serve` (gateway/app.py's `create_app`) and `rollway view` (rollway/view.py) both use, and reached
by every route through one accessor (`services(request)`, or `serving(request)` for what only a serving gateway
has). Nothing else in the gateway touches `app.state`.

- `Services`: what both apps have: the settings, the admin key, the store and the viewer's per-process state.
- `Serving`: what `rollway serve` adds (the backend pool, the chat template, the turn service, leases, weight
  publishing, metrics); None under `rollway view`, which serves the viewer over a store alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
from fastapi import FastAPI, Request

from gateway.changes import Changes
from gateway.errors import ServiceUnavailable
from gateway.malloc_tuning import keep_heap_top
from gateway.metrics import Metrics
from gateway.pool import Backend, BackendPool
from gateway.registry import Registry
from gateway.samples import DEPRECATED_GAMMA, LeaseSamples
from gateway.sessions_cache import SessionCache
from gateway.settings import Settings
from gateway.sglang import BackendError
from gateway.sign_in import SESSION_TTL_S, SignInLimiter
from gateway.store.db import create_engine
from gateway.store.leases import Leases
from gateway.store.store import Store
from gateway.templating import ChatTemplate
from gateway.turns import TurnService
from gateway.ui.tokens import ChainCache, TokenText
from gateway.weight_sync import ProcessGroupSync
from gateway.weights import Admission, Publisher

log = logging.getLogger("rollway.gateway")


class EngineSupervision(Protocol):
    """`rollway serve`'s embedded engine, restarted when it dies (rollway/embedded.py `EngineSupervisor`): its
    deaths take its backend out of the pool, and GET /ready reports it."""

    @property
    def state(self) -> str: ...

    @property
    def last_death(self) -> str | None: ...

    @property
    def restarts(self) -> int: ...

    def attach(self, loop: asyncio.AbstractEventLoop, pool: BackendPool) -> None: ...

    def status(self) -> dict[str, object]: ...


@dataclass(slots=True)
class Serving:
    """What a serving gateway (`rollway serve`) has beyond the viewer's store."""

    pool: BackendPool
    template: ChatTemplate
    metrics: Metrics
    leases: Leases
    publisher: Publisher
    admission: Admission
    registry: Registry
    turns: TurnService
    weight_sync: ProcessGroupSync
    """The publish over torch process groups (routes/weight_sync.py)."""
    context_length: int
    model_name: str
    """The served model name (`--served-model-name`, else the tokenizer folder's name)."""
    completions: Changes = field(default_factory=lambda: Changes(poll_s=0.25))
    """A group completed: lease long-polls look again."""
    budget: Changes = field(default_factory=lambda: Changes(poll_s=1.0))
    """Room under the staleness budget: a waiting creation looks again."""
    engine_supervisor: EngineSupervision | None = None
    ready_backends_seen: set[str] = field(default_factory=set)
    """Backend ids that have answered GET /health since they joined (GET /ready)."""


@dataclass(slots=True)
class Services:
    """Everything a request handler reaches, on `app.state.services` (`install`)."""

    settings: Settings
    admin_key: str
    store: Store
    serving: Serving | None = None
    """None under `rollway view`."""
    ui_chains: ChainCache = field(default_factory=ChainCache)
    """The viewer's chains of the last sessions looked at."""
    ui_token_text: TokenText | None = None
    """Token ids' texts for the viewer; made on first use from the served template's tokenizer, or at start by
    `rollway view --tokenizer`."""
    ui_sign_in_limiter: SignInLimiter = field(default_factory=SignInLimiter)
    ui_session_ttl_s: float = SESSION_TTL_S
    ui_overview: tuple[float, dict[str, object]] | None = None
    """The viewer overview's last computation: (monotonic time, its JSON)."""
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    """The loop the app serves on (its lifespan's): handlers take it from here, where `asyncio.get_running_loop()`
    makes a getpid() system call each time on Python 3.11."""

    @property
    def view_only(self) -> bool:
        return self.serving is None


SERVICES_ATTRIBUTE = "rollway_services"
"""The app attribute `install` also puts the services on: read by `services` and `serving` several times a call,
where `app.state`'s `__getattr__` was a Python call each time."""


def install(app: FastAPI, svc: Services) -> None:
    app.state.services = svc
    setattr(app, SERVICES_ATTRIBUTE, svc)


def app_services(app: FastAPI) -> Services:
    """The services of a started app (its lifespan built them)."""
    svc: Services = app.state.services
    return svc


def app_serving(app: FastAPI) -> Serving:
    """The serving services of a started `rollway serve` app."""
    on = app_services(app).serving
    if on is None:
        raise ServiceUnavailable("this process serves the viewer only (rollway view)")
    return on


def scope_metrics(scope: dict[str, object]) -> Metrics | None:
    """The metrics of the serving app an ASGI scope reached (`RequestMetrics`); None before its lifespan built
    them, or under `rollway view`."""
    app = scope["app"]
    assert isinstance(app, FastAPI)
    try:
        on = app_services(app).serving
    except AttributeError:  # not started
        return None
    return on.metrics if on is not None else None


def services(request: Request) -> Services:
    """A route's services: the one accessor every handler uses."""
    svc: Services = getattr(request.scope["app"], SERVICES_ATTRIBUTE)
    return svc


def serving(request: Request) -> Serving:
    """A route's serving services; a 503 under `rollway view` (which mounts none of the routes that ask)."""
    svc: Services = getattr(request.scope["app"], SERVICES_ATTRIBUTE)
    if svc.serving is None:
        raise ServiceUnavailable("this process serves the viewer only (rollway view)")
    return svc.serving


# --- the factory ----------------------------------------------------------------------------------------------

def load_template(settings: Settings) -> ChatTemplate:
    from transformers import AutoTokenizer

    if not settings.tokenizer:
        raise ValueError("no tokenizer: pass --tokenizer DIR (an HF model folder with a chat template)")
    tok = AutoTokenizer.from_pretrained(settings.tokenizer)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {settings.tokenizer} has no chat template")
    template = ChatTemplate(tok, tool_parser=settings.tool_parser, reasoning_parser=settings.reasoning_parser,
                            allow_special_tokens_in_content=settings.allow_special_tokens_in_content)
    template.warm_decoder()  # its table of each id's bytes, built before the first reply needs it
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


@contextlib.asynccontextmanager
async def open_services(settings: Settings, *, admin_key: str, serve: bool = True, tokenizer: str | None = None,
                        engine_supervisor: EngineSupervision | None = None) -> AsyncIterator[Services]:
    """The services of one app, for the length of its lifespan. `serve`: the whole gateway (store, backend pool,
    template, turn service, leases, publishing; the idle sweeper and the registry's follower run meanwhile).
    Else the viewer's: the store at `settings.db_url` alone, and the token texts of `tokenizer` when given."""
    if not serve:
        store = Store(create_engine(settings.db_url))
        svc = Services(settings=settings, admin_key=admin_key, store=store)
        if tokenizer:
            from transformers import AutoTokenizer

            svc.ui_token_text = TokenText(AutoTokenizer.from_pretrained(tokenizer))
        _tune_gc()  # as rollway serve does: no full collection walks what start-up loaded (a 90-190 ms pause)
        try:
            yield svc
        finally:
            await store.close()
        return

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
    turns = TurnService(
        store=store, template=template, cache=SessionCache(store), metrics=metrics, context_length=ctx,
        reasoning=settings.reasoning, chat_template_kwargs=settings.chat_template_kwargs,
        loop=asyncio.get_running_loop(),
    )
    on = Serving(pool=pool, template=template, metrics=metrics, leases=leases, publisher=publisher,
                 admission=Admission(leases, settings, metrics), registry=registry, turns=turns,
                 weight_sync=ProcessGroupSync(publisher), context_length=ctx, model_name=served_name(settings),
                 engine_supervisor=engine_supervisor)
    store.on_group_end = lambda state: (on.completions.notify() if state == "complete" else on.budget.notify_one())
    svc = Services(settings=settings, admin_key=admin_key, store=store, serving=on)
    await pool.start()
    if engine_supervisor is not None:  # `rollway serve`'s embedded engine (rollway/embedded.py): deaths and restarts
        engine_supervisor.attach(asyncio.get_running_loop(), pool)
    sweeper = asyncio.create_task(_sweep_idle(store, settings.session_idle_timeout_s))
    follower = asyncio.create_task(registry.follow(settings.health_interval_s))
    _tune_gc()
    keep_heap_top()
    log.info("gateway started: %d backend(s), context length %d (GET /ready says whether one answers)",
             len(pool.backends()), ctx)
    try:
        yield svc
    finally:
        sweeper.cancel()
        follower.cancel()
        await pool.stop()
        await http.close()
        await store.close()


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
