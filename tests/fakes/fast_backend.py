"""A minimal, very fast fake `/generate` for benchmarks: a bare ASGI app (no framework, no routing
table) that answers every prompt with the same 30 tokens and their logprobs, so a benchmark measures
the gateway rather than the backend. Served by uvicorn with uvloop and httptools:

    python -m tests.fakes.fast_backend --port 30000 [--context-length 32768]

Streams (cumulative chunks, like SGLang's default) when asked. Echoes `rid`, `weight_version` comes from
the last /update_weights_from_disk. Answers /health, /model_info, /server_info and the control
endpoints with success so the gateway's pool and weight updates work against it; anything else is 404.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

import orjson

from tests.fakes.serve import serve_forever

REPLY_IDS = [1000 + i for i in range(29)] + [2]  # 30 tokens, the last one a stop id
REPLY_LOGPROBS = [-0.01 - 0.1 * (i % 7) for i in range(30)]
CONTEXT_LENGTH = 32768

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_LOGPROB_TRIPLES = [[lp, t, None] for lp, t in zip(REPLY_LOGPROBS, REPLY_IDS, strict=True)]
_FINISH = {"type": "stop", "matched": REPLY_IDS[-1]}


def _result(rid: str, prompt_len: int, logprobs: bool, version: str, n: int = 30) -> bytes:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _FINISH if n == 30 else None,
        "prompt_tokens": prompt_len,
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": version,
    }
    if logprobs:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = _LOGPROB_TRIPLES[:n]
    return orjson.dumps({"output_ids": REPLY_IDS[:n], "meta_info": meta})


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_CONTROL = {
    "/pause_generation": b'{"message":"Generation paused successfully.","status":"ok"}',
    "/continue_generation": b'{"message":"Generation continued successfully.","status":"ok"}',
    "/abort_request": b"",
    "/flush_cache": b"",
    "/health": b"",
    "/health_generate": b"",
}


class FastBackend:
    """The ASGI app; one instance per served backend (it holds the weight version)."""

    def __init__(self, context_length: int = CONTEXT_LENGTH) -> None:
        self.weight_version = "default"
        self.context_length = context_length
        """What /server_info reports (benchmarks/long_sessions.py serves prompts longer than the default)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off; anything else is not ours
            return
        path = scope["path"]
        if path == "/generate":
            await self._generate(receive, send)
        elif path in _CONTROL:
            await _read_body(receive)
            await _send(send, 200, _CONTROL[path])
        elif path == "/update_weights_from_disk":
            body = orjson.loads(await _read_body(receive) or b"{}")
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            await _send(send, 200, b'{"success":true,"message":"ok","num_paused_requests":0}')
        elif path in ("/model_info", "/get_model_info"):
            info = {"model_path": "fast", "is_generation": True, "weight_version": self.weight_version}
            await _send(send, 200, orjson.dumps(info))
        elif path in ("/server_info", "/get_server_info"):
            info = {
                "context_length": self.context_length,
                "max_req_input_len": self.context_length - 1,
                "version": "fast",
            }
            await _send(send, 200, orjson.dumps(info))
        else:
            await _send(send, 404, b'{"detail":"Not Found"}')

    async def _generate(self, receive: Any, send: Any) -> None:
        payload = orjson.loads(await _read_body(receive))
        rid = payload.get("rid") or uuid.uuid4().hex
        prompt_len = len(payload.get("input_ids") or ())
        logprobs = bool(payload.get("return_logprob"))
        if not payload.get("stream"):
            await _send(send, 200, _result(rid, prompt_len, logprobs, self.weight_version))
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        for n in range(1, 31):
            event = b"data: " + _result(rid, prompt_len, logprobs, self.weight_version, n) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


app = FastBackend()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fast fixed-reply fake SGLang /generate for benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context-length", type=int, default=CONTEXT_LENGTH, help="what /server_info reports")
    args = parser.parse_args(argv)
    app.context_length = args.context_length
    serve_forever(app, args.host, args.port, fast=True)


if __name__ == "__main__":
    main()
