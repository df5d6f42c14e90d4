"""The trajectory viewer at /ui (docs/viewer.md): server-rendered Jinja2 pages, a little vanilla JavaScript
and SVG charts drawn by it, every asset in this package. Read-only; who may look is `gateway.viewer_auth`'s."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles


def install(app: FastAPI) -> None:
    """Mount the pages, their JSON and their static files on the gateway."""
    from gateway.ui.routes import router

    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=Path(__file__).parent / "static"), name="ui-static")
