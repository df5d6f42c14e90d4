"""Request-body parsing shared by the routes: size limit, JSON, pydantic -> OpenAI-shaped 400s."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from gateway.errors import BadRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M]) -> M:
    limit: int = request.app.state.settings.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body is {length} bytes; the limit is {limit}")
    raw = await request.body()
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)
