"""`rollway serve`: migrations, admin key, the embedded engine when no backend is given, then uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from rollway.embedded import admin_key, engine_process, ensure_tiny_model


def prepare_database(url: str) -> None:
    """SQLite: bring the embedded file to head. PostgreSQL: refuse to start when behind (design)."""
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

    data_dir = Path(args.data_dir)
    settings = Settings(
        backends=args.backend, tokenizer=args.tokenizer, db=args.db, data_dir=data_dir, host=args.host,
        port=args.port, public_url=args.public_url, served_model_name=args.served_model_name,
        tool_parser=args.tool_parser, context_length=args.context_length,
    )
    if not settings.is_loopback and not settings.admin_key:
        raise SystemExit(f"refusing to bind {args.host} without ROLLWAY_ADMIN_KEY set explicitly")
    key, generated = admin_key(data_dir)
    if generated:
        print(f"admin key (stored in {data_dir / 'admin_key'}; shown once): {key}", file=sys.stderr)
    prepare_database(settings.db_url)
    with contextlib.ExitStack() as stack:
        if not settings.backends:
            model = ensure_tiny_model(data_dir)
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
