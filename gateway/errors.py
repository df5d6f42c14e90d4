"""Errors the gateway answers with, mapped to OpenAI's envelope in one place (`app.py`).

    GatewayError (status, type, code)
    ├── BadRequest            400 invalid_request_error
    │   └── ContextLengthExceeded   400 code=context_length_exceeded
    ├── Unauthorized          401 authentication_error
    ├── Forbidden             403 permission_error
    ├── NotFound              404 not_found_error
    ├── RequestTimeout        408 (the body did not arrive in time)
    ├── Conflict              409 conflict (ended session, trained group, old version)
    ├── PayloadTooLarge       413
    ├── TooManyRequests       429 + Retry-After (staleness admission)
    └── ServiceUnavailable    503 + Retry-After (no backend answered)

On the Anthropic Messages routes the same errors go out in Anthropic's shape (`anthropic_error`).
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Conflict(GatewayError):
    status = 409
    type = "conflict_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class TooManyRequests(GatewayError):
    status = 429
    type = "rate_limit_error"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "backend_unavailable"


# --- Anthropic's shape, on the Messages routes (gateway.anthropic.errors) ---------------------------------

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   529: "overloaded_error"}
"""Anthropic's error type per status; any other 4xx is an invalid_request_error, any other 5xx an api_error."""


def anthropic_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """The status and body Anthropic's API would answer for a gateway error of `status`: a 503 (no backend
    answered, the store busy: retry) is Anthropic's 529 overloaded_error."""
    if status == 503:
        status = 529
    kind = ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}
