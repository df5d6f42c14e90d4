"""The floor a recording gateway is compared with: a minimal FastAPI + aiohttp pass-through.

It takes an OpenAI chat request, parses its JSON, sends one `/generate` call with fixed prompt ids over
one shared aiohttp session and returns the backend's JSON as it came. No templating, no tokenizing, no
auth, no recording. `benchmarks/gateway.py` starts it:

    python benchmarks/passthrough.py --port 8100 --backend http://127.0.0.1:30000 --ids-file ids.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response


def create_app(backend: str, input_ids: list[int], sampling: dict[str, Any]) -> FastAPI:
    url = backend.rstrip("/") + "/generate"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            app.state.http = http
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        payload = {
            "input_ids": input_ids,
            "sampling_params": {**sampling, "max_new_tokens": body.get("max_tokens") or 64},
            "return_logprob": bool(body.get("logprobs")),
            "stream": False,
        }
        async with request.app.state.http.post(url, json=payload) as r:
            data = await r.read()
            return Response(data, status_code=r.status, media_type="application/json")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ids-file", required=True, help="JSON: {input_ids, sampling_params}")
    args = parser.parse_args()
    spec = json.loads(Path(args.ids_file).read_text())
    app = create_app(args.backend, spec["input_ids"], spec["sampling_params"])
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning")


if __name__ == "__main__":
    main()
