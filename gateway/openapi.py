"""The gateway's OpenAPI document: every route, its body, its query parameters, and the statuses it can answer.

The REST routes read their bodies themselves (`routes.common.read_body`: strict pydantic models, depth and
NUL checks, a body timeout) and the OpenAI routes are plain ASGI in front of FastAPI (`routes.dispatch`), so
FastAPI's own document knows neither the bodies nor the OpenAI routes. `OPERATIONS` describes each one, and
`openapi_document` builds the served `/openapi.json` from it. The fuzz test (`tests/gateway/test_fuzz.py`)
generates requests from this document and checks every answer against it, so the table is the contract: a
route that answers a status it does not list here fails the test, and a route missing from the table too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.protocol import (
    AbandonRequest,
    ChatCompletionRequest,
    CompletionRequest,
    CreateGroupRequest,
    GroupRewardsRequest,
    ResponsesRequest,
    RewardRequest,
)

Auth = Literal["admin", "session", "session_path", "admin_or_session", "none"]


@dataclass(frozen=True)
class Query:
    name: str
    schema: dict[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    summary: str
    auth: Auth
    ok: int
    errors: tuple[int, ...]
    body: type[BaseModel] | None = None
    query: tuple[Query, ...] = field(default_factory=tuple)

    @property
    def statuses(self) -> tuple[int, ...]:
        return (self.ok, *self.errors)


# What any route with a body can answer before it looks at it: not JSON / wrong shape (400), the body too
# slow (408) or too large (413); and the store locked or away (503).
BODY = (400, 408, 413)
STORE = (503,)
ADMIN = (401, 403)  # no key or an unknown one; a session key on an admin route
SESSION = (401, 403)  # no key or an unknown one; the admin key has no session
ONE_SESSION = (401, 403, 404)  # admin or that session's key; a key of another session is 403; no such id 404
# An OpenAI call: the session ended (409), staleness admission (429), no backend answered, or the store (503).
TURN = (409, 429, 503)


def _operations() -> dict[tuple[str, str], Operation]:
    from gateway.routes.backends import AddBackend
    from gateway.routes.training import AckBody, LeaseBody, PublishBody, RenewBody
    from gateway.routes.training_reports import TrainingStepBody
    from gateway.routes.viewer_keys import CreateViewerKey
    from gateway.routes.weight_sync import MemoryBody, SyncBody, SyncInitBody

    sessions_query = (
        Query("state", {"type": "string", "enum": ["active", "finished", "abandoned"]}, "only sessions in this state"),
        Query("since", {"type": "number"}, "only sessions created at or after this time (epoch seconds)"),
        Query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}, "page size"),
        Query("after", {"type": "string"}, "cursor: the `next_after` of the previous page"),
        Query("include_turns", {"type": "boolean", "default": False}, "full records instead of summaries"),
    )
    ops: dict[tuple[str, str], Operation] = {
        ("GET", "/health"): Operation("Liveness: the process answers", "none", 200, ()),
        ("GET", "/ready"): Operation("Readiness: at least one backend is healthy", "none", 200, (503,)),
        ("GET", "/metrics"): Operation("Prometheus metrics", "none", 200, STORE),
        ("POST", "/v1/groups"): Operation("Create a group of n sessions for one task", "admin", 201,
                                          (*BODY, *ADMIN, 429, *STORE), CreateGroupRequest),
        ("GET", "/v1/groups/{group_id}"): Operation("A group and its sessions", "admin", 200,
                                                    (*ADMIN, 404, *STORE)),
        ("POST", "/v1/groups/{group_id}/rewards"): Operation(
            "Reward (and finish) several sessions of a group in one transaction", "admin", 200,
            (*BODY, *ADMIN, 404, 409, *STORE), GroupRewardsRequest),
        ("GET", "/v1/sessions"): Operation("Sessions, oldest first, a page at a time", "admin", 200,
                                           (400, *ADMIN, *STORE), query=sessions_query),
        ("GET", "/v1/sessions/{session_id}"): Operation("One session's structured record", "admin_or_session", 200,
                                                        (*ONE_SESSION, *STORE)),
        ("POST", "/v1/sessions/{session_id}/reward"): Operation(
            "Reward a session (and finish it with finish: true)", "admin_or_session", 200,
            (*BODY, *ONE_SESSION, 409, *STORE), RewardRequest),
        ("POST", "/v1/sessions/{session_id}/finish"): Operation("Finish a session", "admin_or_session", 200,
                                                                (*ONE_SESSION, 409, *STORE)),
        ("POST", "/v1/sessions/{session_id}/abandon"): Operation("Abandon a session", "admin_or_session", 200,
                                                                 (*BODY, *ONE_SESSION, 409, *STORE), AbandonRequest),
        ("POST", "/v1/batches"): Operation("Lease complete groups for training", "admin", 200,
                                           (*BODY, *ADMIN, *STORE), LeaseBody),
        ("POST", "/v1/batches/{batch_id}/renew"): Operation("Extend a lease", "admin", 200,
                                                            (*BODY, *ADMIN, 404, 409, *STORE), RenewBody),
        ("POST", "/v1/batches/{batch_id}/ack"): Operation("Acknowledge a lease's groups", "admin", 200,
                                                          (*BODY, *ADMIN, 404, 409, *STORE), AckBody),
        ("POST", "/v1/weights"): Operation("Publish weights: pause, load, resume every backend", "admin", 200,
                                           (*BODY, *ADMIN, 404, 409, *STORE), PublishBody),
        ("GET", "/v1/weights"): Operation("The current weight version and path", "admin", 200, (*ADMIN, *STORE)),
        # Publishing over process groups (docs/http-api.md "Weight sync over process groups"): 409 for a version
        # that is not newer or a sync_id that is not the pending one, 503 while another publish holds the lock
        # or when no backend answers.
        ("POST", "/v1/weights/sync/init"): Operation("Plan a weight sync over process groups (takes the publish "
                                                     "lock)", "admin", 200, (*BODY, *ADMIN, 409, *STORE),
                                                     SyncInitBody),
        ("POST", "/v1/weights/sync"): Operation("Run the planned weight sync: the backends receive the buckets",
                                                "admin", 200, (*BODY, *ADMIN, 409, *STORE), SyncBody),
        ("GET", "/v1/weights/sync"): Operation("The weight sync in progress, if any", "admin", 200,
                                               (*ADMIN, *STORE)),
        # A trainer colocated with its servers (docs/http-api.md): pause + /release_memory_occupation, and back.
        ("POST", "/v1/weights/memory/release"): Operation("Pause every backend and release its memory (tags)",
                                                          "admin", 200, (*BODY, *ADMIN), MemoryBody),
        ("POST", "/v1/weights/memory/resume"): Operation("Resume every backend's memory and continue", "admin", 200,
                                                         (*BODY, *ADMIN), MemoryBody),
        ("GET", "/v1/backends"): Operation("The inference servers", "admin", 200, ADMIN),
        ("POST", "/v1/backends"): Operation("Add an inference server", "admin", 201,
                                            (*BODY, *ADMIN, *STORE), AddBackend),
        ("DELETE", "/v1/backends/{backend_id}"): Operation("Remove an inference server", "admin", 200,
                                                           (*ADMIN, 404, *STORE)),
        ("POST", "/v1/viewer_keys"): Operation("Create a read-only viewer key for the /ui pages (shown once)",
                                               "admin", 201, (*BODY, *ADMIN, *STORE), CreateViewerKey),
        ("GET", "/v1/viewer_keys"): Operation("The viewer keys (no key material)", "admin", 200, (*ADMIN, *STORE)),
        ("DELETE", "/v1/viewer_keys/{key_id}"): Operation("Revoke a viewer key and end its /ui sign-ins", "admin",
                                                          200, (*ADMIN, 404, *STORE)),
        ("POST", "/v1/training/steps"): Operation("The trainer's report of a step: figures and advantages",
                                                  "admin", 200, (*BODY, *ADMIN, *STORE), TrainingStepBody),
    }
    openai: dict[str, Operation] = {
        "/v1/chat/completions": Operation("OpenAI chat completions (recorded)", "session", 200,
                                          (*BODY, *TURN), ChatCompletionRequest),
        "/v1/completions": Operation("OpenAI completions (recorded)", "session", 200,
                                     (*BODY, *TURN), CompletionRequest),
        "/v1/responses": Operation("OpenAI Responses API, stateless (recorded)", "session", 200,
                                   (*BODY, *TURN), ResponsesRequest),
        "/v1/models": Operation("The served model", "session", 200, (*STORE,)),
    }
    for path, op in openai.items():
        method = "GET" if path == "/v1/models" else "POST"
        ops[(method, path)] = Operation(op.summary, "session", op.ok, (*SESSION, *op.errors), op.body)
        ops[(method, "/sessions/{session_id}" + path)] = Operation(
            op.summary + "; the session by the id in the path (no key)", "session_path", op.ok,
            (404, *op.errors), op.body)
    # Anthropic's Messages API (errors in Anthropic's shape: a 503 is its 529 overloaded_error).
    from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest

    anthropic = {
        ("POST", "/v1/messages"): Operation("Anthropic Messages API (recorded)", "session", 200,
                                            (*BODY, 409, 429, 529), MessagesRequest),
        ("POST", "/v1/messages/count_tokens"): Operation("Anthropic token count: the exact prompt length, nothing "
                                                         "stored", "session", 200, (*BODY, 409, 529),
                                                         CountTokensRequest),
        # With an anthropic-version header /v1/models answers in Anthropic's shape, its store error as a 529.
        ("GET", "/v1/models"): Operation("The served model", "session", 200, (503, 529)),
        ("GET", "/v1/models/{model_id}"): Operation("The served model by id (OpenAI or Anthropic shape)",
                                                    "session", 200, (404, 503, 529)),
    }
    for (method, path), op in anthropic.items():
        ops[(method, path)] = Operation(op.summary, "session", op.ok, (*SESSION, *op.errors), op.body)
        ops[(method, "/sessions/{session_id}" + path)] = Operation(
            op.summary + "; the session by the id in the path (no key)", "session_path", op.ok,
            tuple(dict.fromkeys((404, *op.errors))), op.body)
    return ops


OPERATIONS = _operations()

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_REASONS = {200: "OK", 201: "Created", 400: "Bad request", 401: "No key or an unknown key",
            403: "A valid key without the right to this route", 404: "No such id", 408: "The body did not arrive in time",
            409: "Conflict with the resource's state", 413: "Body too large", 429: "Admission: retry after Retry-After",
            503: "Store or backend unavailable: retry after Retry-After",
            529: "Anthropic routes: store or backend unavailable (Anthropic's overloaded_error); retry"}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="rollway's gateway: OpenAI-compatible, recording every call for RL.")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = _ERROR
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    paths: dict[str, Any] = {}
    for (method, path), op in sorted(OPERATIONS.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in re.findall(r"{(\w+)}", path)]
        params += [{"name": q.name, "in": "query", "required": False, "schema": q.schema,
                    "description": q.description} for q in op.query]
        operation: dict[str, Any] = {
            "summary": op.summary,
            "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
            "parameters": params,
            "responses": {
                str(code): {"description": _REASONS.get(code, "error"),
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}
                                                             if code >= 400 else {}}}}
                for code in op.statuses
            },
        }
        if op.auth in ("admin", "session", "admin_or_session"):
            operation["security"] = [{"bearer": []}]
        if op.body is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": _schema(op.body, components)}}}
        paths.setdefault(path, {})[method.lower()] = operation
    doc["paths"] = paths
    return doc


def install(app: FastAPI) -> None:
    """Serve `openapi_document` at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
