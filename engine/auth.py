"""SGLang's `--api-key` / `--admin-api-key` scheme, for the engine's routes (SGLang 0.5.23:
`sglang.srt.utils.auth.decide_request_auth`, and the `@auth_level` marks in its entrypoints/http_server.py).

- /health*, /ready*, /metrics*: always open (probes, scrapers).
- The admin routes (SGLang's ADMIN_OPTIONAL ones that the engine serves: pausing, aborting, weight and adapter
  updates, the cache): with an admin key, that key only; else with an API key, that key; else open.
- Every other route (/generate, the info routes): with an API key, that key; else open (an admin key alone
  leaves them open, as in SGLang).

Keys arrive as `Authorization: Bearer <key>` and are compared in constant time; a refusal is SGLang's
`401 {"error": "Unauthorized"}`. The keys come from `--api-key` / `--admin-api-key`, or from the environment
(`ROLLWAY_ENGINE_API_KEY`, `ROLLWAY_ENGINE_ADMIN_API_KEY`), where a parent can hand them over without them
showing in the process list (`rollway serve` gives its embedded engine a generated admin key this way).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

API_KEY_ENV = "ROLLWAY_ENGINE_API_KEY"
ADMIN_API_KEY_ENV = "ROLLWAY_ENGINE_ADMIN_API_KEY"

ADMIN_ROUTES = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/update_weight_version", "/flush_cache", "/load_lora_adapter", "/unload_lora_adapter",
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/begin_weight_update", "/end_weight_update",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def add_key_arguments(parser: Any) -> None:
    """SGLang's two key flags (an argparse parser); absent, the environment's keys are used."""
    parser.add_argument("--api-key", default=None,
                        help=f"key for /generate and the info routes (Authorization: Bearer; env {API_KEY_ENV})")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"key for the admin routes: pause, abort, weights, adapters (env {ADMIN_API_KEY_ENV})")


def _bearer_is(header: str | None, expected: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), expected.encode())


def allowed(method: str, path: str, authorization: str | None, api_key: str, admin_api_key: str) -> bool:
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_ROUTES:
        key = admin_api_key or api_key
    else:
        key = api_key
    return not key or _bearer_is(authorization, key)


class ApiKeys:
    """ASGI middleware: each request checked against the keys before any other handling."""

    def __init__(self, app: Any, api_key: str = "", admin_api_key: str = "") -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            if not allowed(scope["method"], scope["path"], authorization, self.api_key, self.admin_api_key):
                body = json.dumps({"error": "Unauthorized"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
