"""What every route shares: request-body reading (size limit, JSON, pydantic -> OpenAI-shaped 400s), JSON
responses, and the one mapping of exceptions to OpenAI-shaped error answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import jinja2
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gateway.errors import (
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
    error_body,
)
from gateway.services import services
from gateway.store.db import STORE_UNAVAILABLE as STORE_UNAVAILABLE  # the drivers' errors, named by the store

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("rollway.gateway")


async def read_raw_body(request: Request) -> bytes:
    """The request body, refused with 413 past `max_body_bytes` (by Content-Length before reading any of it), and
    with 408 when it has not all arrived within `body_timeout_s`.

    Reads the ASGI messages directly: Starlette's `Request.body()` stream machinery was ~0.15 ms a call. The time
    limit is `asyncio.timeout`'s protocol (cancel the task when the timer fires; a cancellation that the timer
    alone asked for is the timeout) on the app's loop: `asyncio.timeout` itself asks for the running loop three
    times, each a getpid() system call on Python 3.11, on every call."""
    svc = services(request)
    settings = svc.settings
    limit: int = settings.max_body_bytes
    headers = request.headers
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body is {length} bytes; the limit is {limit}")
    encoding = headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):  # else "not valid UTF-8" misled
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
    loop = svc.loop
    task = asyncio.current_task(loop)
    if task is None:  # not in a task of the app's loop (never under a server): the general timeout
        try:
            async with asyncio.timeout(settings.body_timeout_s):
                return await _receive_body(request.receive, limit)
        except TimeoutError:
            raise RequestTimeout(_late(settings.body_timeout_s)) from None
    expiry = _Expiry(task)
    timer = loop.call_later(settings.body_timeout_s, expiry)
    cancelled = False
    try:
        return await _receive_body(request.receive, limit)
    except asyncio.CancelledError:
        cancelled = True
        raise
    finally:
        timer.cancel()
        if expiry.fired and task.uncancel() == 0 and cancelled:
            raise RequestTimeout(_late(settings.body_timeout_s)) from None


class _Expiry:
    """The body's timer: cancels the reading task, and says it did."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel()


def _late(seconds: float) -> str:
    return f"the request body did not arrive within {seconds:g} s"


async def _receive_body(receive: Any, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


MAX_JSON_DEPTH = 128
"""Nesting accepted in a request body. What is accepted is stored, and the store writes JSON with orjson,
which refuses more than 254 levels: a body nested 300 deep once generated a reply and then failed to store
it. 128 leaves room for the record around the body; no real tool schema or message comes near it."""


def json_text_depth(text: str) -> int:
    """How deep the JSON in `text` nests (brackets inside its strings not counted), without parsing it: a
    tool call's `arguments` string is parsed later (to render the chat template, to compare histories), where
    5,000 levels were a RecursionError and a 990-deep object failed to store."""
    depth = top = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            top = max(top, depth)
        elif ch in "]}":
            depth -= 1
    return top


def check_json_shape(raw: bytes, data: Any, walk: bool = False) -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH and strings holding NUL characters (which PostgreSQL
    can't store in text or JSONB, so SQLite and PostgreSQL would answer differently), tool-call `arguments`
    strings included (JSON text, parsed later). Two scans of the raw bytes at C speed decide whether the walk
    over the parsed value is needed at all: a body with fewer brackets than the limit can't be that deep, nor
    can a string in it, and a NUL can only arrive as the escape `\u0000`.

    `walk`: skip the scans and walk. For a body whose bulk `data` no longer holds as JSON (a long session's
    replayed messages, handed over as the models validated from the same JSON before: `MessageReuse`, which
    the walk does not enter), the walk is over the new messages only, where the scans are over every byte
    (~0.4 ms for a 100k-token session's 600 KB). Either way the same bodies are refused, with the same errors:
    the scans only tell when the walk can't find anything."""
    if walk:
        deep = nul = True
    else:
        deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
        nul = b"\\u0000" in raw
    if not (deep or nul):
        return
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
            for k, v in value.items():
                if nul and "\x00" in k:
                    raise BadRequest("request body holds a NUL character (\\u0000), which is not accepted")
                if (deep and k == "arguments" and isinstance(v, str)
                        and v.count("[") + v.count("{") > MAX_JSON_DEPTH and json_text_depth(v) > MAX_JSON_DEPTH):
                    raise BadRequest(f"tool call arguments are nested more than {MAX_JSON_DEPTH} levels deep",
                                     param="arguments")
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
            stack.extend((v, depth + 1) for v in value)
        elif nul and isinstance(value, str) and "\x00" in value:
            raise BadRequest("request body holds a NUL character (\\u0000), which is not accepted")


def parse_body(raw: bytes, model: type[M], precheck: Callable[[dict[str, Any]], bool | None] | None = None,
               decoded: dict[str, Any] | None = None, new_messages: int | None = None) -> M:
    """`precheck` sees the decoded object first: cheap checks (list lengths) before the walk and validation,
    which cost microseconds per element; it returns True where `check_json_shape` should walk without its byte
    scans first. `decoded`: `raw` already decoded (gateway/routes/body_prefix.py), its `messages` models validated
    before but for the last `new_messages`: the walk, which does not enter a model, goes over those only."""
    if decoded is not None:
        data = decoded
    else:
        try:
            data = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    walk = precheck(data) if precheck is not None else None
    shape = data
    if new_messages is not None and walk and isinstance(data.get("messages"), list):
        messages = data["messages"]
        shape = {**data, "messages": messages[len(messages) - new_messages:]}
    check_json_shape(raw, shape, walk=bool(walk))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


async def read_body(request: Request, model: type[M]) -> M:
    return parse_body(await read_raw_body(request), model)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: Exception) -> Response:
    """The OpenAI-shaped answer to an exception raised by a route; a client never sees a traceback or a 422."""
    if isinstance(exc, GatewayError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after is not None else None
        return json_response(exc.body(), exc.status, headers)
    if isinstance(exc, RequestValidationError):
        return json_response(validation_error_body(exc.errors()), 400)
    if isinstance(exc, StarletteHTTPException):  # its headers kept: a 405 says what is Allow-ed
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(error_body(str(exc.detail), kind), exc.status_code, dict(exc.headers or {}))
    if isinstance(exc, jinja2.TemplateError):
        # The model's chat template refused the conversation (e.g. roles in an order it does not allow).
        return json_response(error_body(f"the chat template refused these messages: {exc}", "invalid_request_error",
                                        "messages"), 400)
    if isinstance(exc, STORE_UNAVAILABLE):
        # SQLite's write lock held past busy_timeout (another process on the file), or the database away or
        # restarting: nothing of this request was stored; the client may retry.
        log.warning("store unavailable: %s", getattr(exc, "orig", exc))
        return json_response(error_body("the trajectory store is busy or unreachable; retry", "server_error",
                                        code="store_unavailable"), 503, {"Retry-After": "1"})
    log.exception("unexpected error", exc_info=exc)
    return json_response(error_body("internal error in the gateway (logged)", "server_error"), 500)


def validation_error_body(errors: Any) -> dict[str, Any]:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return error_body(f"{param}: {msg}" if param else msg, "invalid_request_error", param)
