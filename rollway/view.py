"""`rollway view --db URL`: the /ui viewer alone over an existing store, e.g. a finished run's or the demo's.

No engine, no backend, no tokenizer: the pages read the store. Besides /ui it serves the viewer-key routes
(the admin hands out read-only keys) and /health; every other route is a 404 that says where it lives
(`rollway serve`). The admin key comes from --admin-key, ROLLWAY_ADMIN_KEY or DATA_DIR/admin_key, else it is
generated for this run and printed once; `--data-dir OUT` takes the store and the key file a gateway or the demo left in OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

log = logging.getLogger("rollway.view")

DEFAULT_PORT = 8001
"""Beside a `rollway serve` on 8000."""

DESCRIPTION = """Serve the trajectory viewer (/ui) alone over an existing store: the runs, groups, sessions and
every token a gateway recorded, and the figures its trainer reported. Nothing else runs: no inference engine,
no backend, no tokenizer; the OpenAI and REST routes are not served (`rollway serve` serves them).

Sign in at http://HOST:PORT/ui with the admin key, with a read-only viewer key (create one: POST
/v1/viewer_keys with the admin key, on this server or the gateway), or with a session key (its own session
only). The admin key is --admin-key, else ROLLWAY_ADMIN_KEY, else DATA_DIR/admin_key (as rollway serve and the demo
keep it), else generated for this run and printed once.

A SQLite store is brought to the current schema first (tables are only added); a PostgreSQL one must already
be (`rollway db upgrade --db URL`)."""

EPILOG = """examples:
  rollway view --db sqlite:///rollway-demo/rollway.db          # the demo's store
  rollway view --data-dir rollway-demo                          # the same, with the demo's admin key
  rollway view --db postgresql://user@db-host/rollway --host 0.0.0.0 --port 8001"""


def add_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    v = sub.add_parser("view", formatter_class=formatter, help="the trajectory viewer alone over a store (no engine)",
                       description=DESCRIPTION, epilog=EPILOG)
    v.add_argument("--db", default=None, metavar="URL",
                   help="the store: sqlite:///FILE or postgresql://... (env ROLLWAY_DB; empty: rollway.db in "
                   "--data-dir)")
    v.add_argument("--data-dir", default=os.environ.get("ROLLWAY_DATA_DIR", "rollway-data"),
                   help="where the default SQLite store and the admin_key file are (env ROLLWAY_DATA_DIR)")
    v.add_argument("--host", default="127.0.0.1", help="bind address")
    v.add_argument("--port", type=int, default=DEFAULT_PORT, help="port")
    v.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a tokenizer folder, to show the token view's ids as text (default: the first of "
                   "DATA_DIR/model-init (the demo's), DATA_DIR/tiny-model (rollway serve's) and any other folder of "
                   "DATA_DIR holding a tokenizer, when one exists; else ids only)")
    v.add_argument("--admin-key", default=None, metavar="KEY",
                   help="admin key of this viewer (default: env ROLLWAY_ADMIN_KEY, else DATA_DIR/admin_key, else generated "
                   "and printed; "
                   "prefer the variable: a flag is visible to other users in the process list)")
    v.set_defaults(fn=main)


def db_url(args: argparse.Namespace) -> str:
    if args.db or os.environ.get("ROLLWAY_DB"):
        return str(args.db or os.environ["ROLLWAY_DB"])
    return f"sqlite:///{(Path(args.data_dir) / 'rollway.db').resolve()}"


def check_store(url: str) -> None:
    """An existing store at the current schema (SQLite: upgraded; a missing file is an error, never created)."""
    from gateway.store import db

    try:
        sqlite = db.is_sqlite(url)
    except Exception as e:  # an URL SQLAlchemy cannot parse
        raise SystemExit(f"rollway view: not a database URL {url!r}: {e}") from None
    if sqlite:
        from sqlalchemy.engine import make_url

        path = make_url(url).database
        if not path or path == ":memory:" or not Path(path).is_file():
            raise SystemExit(f"rollway view: no store at {url}: give the --db of a gateway's store "
                             "(sqlite:///FILE or postgresql://...)")
    from rollway.serve import prepare_database

    try:
        prepare_database(url)
    except ValueError as e:
        raise SystemExit(f"rollway view: {e}") from None


VIEW_ONLY = ("`rollway view` serves only the viewer (/ui) over a store; the OpenAI and REST routes are served "
             "by `rollway serve`")


def create_view_app(url: str, admin_key: str, tokenizer: str | None = None) -> Any:
    """The viewer's FastAPI app over the store at `url`: /ui (sign-in and the pages), the viewer-key routes,
    /health. Its services are the gateway's factory's (`open_services(serve=False)`): the store and the viewer's
    state, no `Serving` (no pool, engine, template or metrics): `Services.view_only` is True."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import RedirectResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from gateway.errors import GatewayError, NotFound
    from gateway.routes import ui_sign_in, viewer_keys
    from gateway.routes.common import error_response, json_response
    from gateway.services import install, open_services
    from gateway.settings import Settings
    from gateway.store.db import STORE_UNAVAILABLE

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_services(Settings(db=url), admin_key=admin_key, serve=False, tokenizer=tokenizer) as svc:
            install(app, svc)
            yield

    app = FastAPI(title="rollway viewer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    async def handle(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    for exc_type in (GatewayError, RequestValidationError, StarletteHTTPException, *STORE_UNAVAILABLE, Exception):
        app.add_exception_handler(exc_type, handle)
    app.include_router(viewer_keys.router)
    ui_sign_in.install(app)
    mount_pages(app)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        return json_response({"status": "ok", "mode": "view"})

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/ui", 303)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def elsewhere(path: str) -> Response:
        if path == "ui" or path.startswith("ui/"):
            raise NotFound(f"no page /{path[:200]}")
        raise NotFound(f"/{path[:200]} is not served here: {VIEW_ONLY}", code="viewer_only")

    return app


def mount_pages(app: Any) -> bool:
    """The pages of gateway/ui/ (its `install(app)`, else its `router`); False while there are none."""
    try:
        import gateway.ui as ui
    except ImportError:
        return False
    install = getattr(ui, "install", None)
    if callable(install):
        install(app)
        return True
    router = getattr(ui, "router", None)
    if router is not None:
        app.include_router(router)
        return True
    return False


KNOWN_MODEL_DIRS = ("model-init", "tiny-model", "sft")
"""Where `rollway demo` (model-init, sft) and `rollway serve` (tiny-model) keep a model in their data folder."""


def find_tokenizer(data_dir: Path) -> str | None:
    """The data folder's tokenizer: a known model folder first, else any folder in it (or one level down, as
    the trainer's weights/v12) holding tokenizer_config.json. None when there is none."""
    def ok(d: Path) -> bool:
        return (d / "tokenizer_config.json").is_file()

    for name in KNOWN_MODEL_DIRS:
        if ok(data_dir / name):
            return str(data_dir / name)
    if not data_dir.is_dir():
        return None
    subs = sorted(p for p in data_dir.iterdir() if p.is_dir())
    for d in subs:
        if ok(d):
            return str(d)
    for d in subs:
        for inner in sorted(p for p in d.iterdir() if p.is_dir()):
            if ok(inner):
                return str(inner)
    return None


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from rollway.keys import ENV, find_admin_key
    from rollway.serve import listen_socket, local_url

    url = db_url(args)
    check_store(url)
    key = args.admin_key or find_admin_key(args.data_dir) or ""  # the variable, else DATA_DIR/admin_key
    generated = not key
    if generated:
        key = "rw-admin-" + secrets.token_urlsafe(32)
    sock = listen_socket(args.host, args.port)
    tokenizer = args.tokenizer or find_tokenizer(Path(args.data_dir))
    if tokenizer:
        print(f"rollway view: token text from {tokenizer}", flush=True)
    app = create_view_app(url, key, tokenizer)
    from sqlalchemy.engine import make_url

    shown = make_url(url).render_as_string(hide_password=True)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    print(f"rollway view: {local_url(args.host, port)}/ui over {shown}", flush=True)
    if generated:
        print(f"admin key (generated for this run; set {ENV} to choose one): {key}", flush=True)
    config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                            proxy_headers=False)  # X-Forwarded-* believed from nobody (gateway.proxies)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
