"""`rollway serve`: migrations, admin key, the embedded engine when no backend is given, then uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from rollway.embedded import admin_key, engine_process, ensure_tiny_model


def prepare_database(url: str) -> None:
    """SQLite: bring the embedded file to head. PostgreSQL: refuse to start when behind (docs/architecture.md
    "The store")."""
    from gateway.store import db

    if db.is_sqlite(url):
        db.upgrade(url)
        return
    current, head = db.current_revision(url), db.head_revision()
    if current != head:
        raise SystemExit(f"the database is at revision {current or 'none'}, the code at {head}: "
                         f"run `rollway db upgrade --db {url}`")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import Settings
    from rollway.cli import settings_from_args

    # One precedence: a flag given on the command line > ROLLWAY_* environment > Settings' default.
    settings = Settings(**settings_from_args(args))
    data_dir = settings.data_dir
    if not settings.is_loopback and not settings.admin_key:
        raise SystemExit(f"refusing to bind {settings.host} without ROLLWAY_ADMIN_KEY set explicitly")
    if settings.model and settings.backends:
        raise SystemExit("--model is for the embedded CPU engine; with --backend, give --tokenizer DIR instead")
    key, generated = admin_key(data_dir)
    if generated:
        print(f"admin key (stored in {data_dir / 'admin_key'}; shown once): {key}", file=sys.stderr)
    prepare_database(settings.db_url)
    with contextlib.ExitStack() as stack:
        if not settings.backends:
            model = Path(settings.model) if settings.model else ensure_tiny_model(data_dir)
            url = stack.enter_context(engine_process(model, log_path=data_dir / "engine.log"))
            settings = settings.model_copy(update={"backends": [url], "tokenizer": settings.tokenizer or str(model)})
            print(f"embedded CPU engine at {url} serving {model}", file=sys.stderr)
        elif not settings.tokenizer:
            raise SystemExit("--tokenizer DIR is required with --backend (the gateway tokenizes itself)")
        app = create_app(settings, admin_key=key)
        print(f"gateway on http://{settings.host}:{settings.port}  (agents: POST /v1/groups for keys)",
              file=sys.stderr)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                    loop="uvloop", http="httptools", timeout_graceful_shutdown=5)
    return 0
