"""`/release_memory_occupation` and `/resume_memory_occupation`, as SGLang 0.5.23 answers them
(srt/entrypoints/http_server.py; srt/managers/scheduler_components/weight_updater.py): a colocated trainer asks the
server to give back memory for its optimizer step, and to take it again after (docs/scaling.md "One device").

Body `{"tags": ["kv_cache"] | ["weights"] | ["cuda_graph"] | null}` (null or empty: all three). Here the frees are
real: `kv_cache` drops the running rows' cache (the rows are retracted to the queue and prefilled again after the
resume), `weights` drops the served model's tensors (they come back as zeros: a weight update must fill them before
the server generates, as with SGLang's memory saver without a CPU backup). While anything is released, nothing
generates. The server must be idle or paused (`/pause_generation`), as SGLang asserts; otherwise 400.
Success answers `null` (SGLang's route returns nothing); a failure `{"error": {"message"}}` with 400.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")


def parse_tags(body: Any) -> list[str]:
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is None or tags == []:
        return list(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError("tags must be a list of strings")
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise ValueError(f"unknown tags {unknown}: use {list(ALL_TAGS)}")
    return tags


def add_memory_routes(app: FastAPI, engine: Any, json_body: Any) -> None:
    scheduler = engine.scheduler

    async def body_of(request: Request) -> Any:
        return await json_body(request) if request.method == "POST" else {}

    def error(e: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e)}}, status_code=400)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> JSONResponse:
        try:
            tags = parse_tags(await body_of(request))
            freed = await asyncio.wrap_future(scheduler.call(lambda: scheduler.release_memory(tags)))
        except (ValueError, RuntimeError) as e:
            return error(e)
        log.info("released %s: %.1f MB freed", tags, freed / 1e6)
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        try:
            tags = parse_tags(await body_of(request))
            await asyncio.wrap_future(scheduler.call(lambda: scheduler.resume_memory(tags)))
        except (ValueError, RuntimeError) as e:
            return error(e)
        return JSONResponse(None)
