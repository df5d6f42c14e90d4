"""Fuzz the gateway from its own OpenAPI document (schemathesis + Hypothesis), with the admin key and with a
session key, on SQLite and PostgreSQL.

Asserts, for every generated request: no 5xx (a 503 only where documented and not from the store, which is
up); no 2xx on an admin route for a session key; the status is one the operation documents; every error is
in the OpenAI envelope. Prints a route x status table (`pytest -s` shows it). The default run makes a
bounded number of examples per operation and key; `pytest -m slow tests/gateway/test_fuzz.py` makes more.

    ROLLWAY_FUZZ_EXAMPLES=200 pytest -s -m slow tests/gateway/test_fuzz.py   # longer
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.anthropic.api import ROUTES as ANTHROPIC_ROUTES
from gateway.app import create_app
from gateway.errors import ANTHROPIC_TYPES
from gateway.openapi import OPERATIONS
from gateway.routes.openai_api import ROUTES as OPENAI_ROUTES
from gateway.routes.responses import ROUTES as RESPONSES_ROUTES
from gateway.settings import Settings
from tests.harness import ADMIN_KEY, LiveGateway

DEFAULT_EXAMPLES = 12
SLOW_EXAMPLES = int(os.environ.get("ROLLWAY_FUZZ_EXAMPLES", "60"))


def test_every_route_is_documented(tiny_model_dir: Any) -> None:
    """Each FastAPI route and each plain-ASGI OpenAI route has an entry in the OpenAPI table, and no more."""
    from fastapi.routing import APIRoute

    app = create_app(Settings(backends=["http://127.0.0.1:9"], tokenizer=str(tiny_model_dir)), admin_key="k")

    def flat(routes: list[Any]) -> list[Any]:  # routers included in routers, at any depth (the weight sync's)
        return [r for route in routes
                for r in [route, *flat(getattr(getattr(route, "original_router", None), "routes", []))]]

    routes = flat(list(app.routes))
    # the /ui pages (and the browser's /favicon.ico) are for a browser (docs/viewer-auth.md), not the API document
    # path_format: the path as OpenAPI writes it, without a converter ({model_id:path} is {model_id})
    served = {(m, r.path_format) for r in routes
              if isinstance(r, APIRoute) and not r.path.startswith(("/ui", "/favicon")) for m in r.methods}
    for path, (method, _) in {**OPENAI_ROUTES, **RESPONSES_ROUTES, **ANTHROPIC_ROUTES}.items():
        served |= {(method, path), (method, "/sessions/{session_id}" + path)}
    assert served == set(OPERATIONS)
    doc = app.openapi()
    for (method, path), op in OPERATIONS.items():
        operation = doc["paths"][path][method.lower()]
        assert set(operation["responses"]) == {str(s) for s in op.statuses}
        assert ("requestBody" in operation) == (op.body is not None)


class Fuzz:
    """Runs generated requests against one live gateway; collects a route x status table and the problems."""

    def __init__(self, gw: LiveGateway) -> None:
        self.gw = gw
        own = gw.group(2)["sessions"][0]
        other = gw.group(1)["sessions"][0]
        viewer = gw.admin.post("/v1/viewer_keys", json={"name": "fuzz"})
        assert viewer.status_code == 201, viewer.text
        self.keys = {"admin": ADMIN_KEY, "session": own["api_key"], "viewer": viewer.json()["key"]}
        self.session_ids = [own["session_id"], other["session_id"]]
        self.table: Counter[tuple[str, str, int]] = Counter()
        self.problems: list[str] = []
        self.client = httpx.Client(timeout=60)

    def run(self, examples: int) -> None:
        import schemathesis

        schema = schemathesis.openapi.from_url(f"{self.gw.url}/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            for who in self.keys:
                self._runner(operation, who, examples)()
        self.client.close()

    def _runner(self, operation: Any, who: str, examples: int) -> Any:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(), use_real=st.booleans(), pick=st.integers(0, 1))
        def run(case: Any, use_real: bool, pick: int) -> None:
            self.check(operation.method.upper(), operation.path, who, case, use_real, pick)

        return run

    def check(self, method: str, path: str, who: str, case: Any, use_real: bool, pick: int) -> None:
        op = OPERATIONS[(method, path)]
        if use_real and case.path_parameters and "session_id" in case.path_parameters:
            case.path_parameters["session_id"] = self.session_ids[pick]
        kwargs = case.as_transport_kwargs(base_url=self.gw.url)
        body = kwargs.get("json")
        if (method, path) in (("POST", "/v1/batches"), ("POST", "/v1/groups")) and isinstance(body, dict) \
                and isinstance(body.get("wait_seconds"), int | float) and body["wait_seconds"] > 2:
            body["wait_seconds"] = 2.0  # a lease or a group creation waits as long as asked (up to 600 s): not here
        if (method, path) == ("POST", "/v1/weights/sync/init") and isinstance(body, dict) \
                and isinstance(body.get("timeout_s"), int | float) and body["timeout_s"] > 2:
            body["timeout_s"] = 2.0  # it waits that long for the publish lock, and a plan holds it that long + 30 s
        headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "authorization"}
        if op.auth != "session_path":
            headers["Authorization"] = f"Bearer {self.keys[who]}"
        r = self.client.request(method, kwargs["url"], headers=headers, params=kwargs.get("params"),
                                content=_content(kwargs))
        self.table[(who, f"{method} {path}", r.status_code)] += 1
        if path == "/v1/weights/sync/init" and r.status_code == 200 and r.json().get("sync_id"):
            self.abandon_sync(r.json())
        if path == "/v1/weights/memory/release" and r.status_code == 200 and r.json().get("backends"):
            self.resume_memory()  # (a server that could not release was continued by the gateway itself)
        where = f"[{who}] {method} {r.url} -> {r.status_code}: {r.text[:300]}"
        if r.status_code >= 500 and not (r.status_code == 503 and 503 in op.errors
                                         and (r.json().get("error") or {}).get("code") != "store_unavailable"):
            self.problems.append("5xx " + where)
        if who == "session" and op.auth == "admin" and r.status_code < 300:
            self.problems.append("session key got 2xx on an admin route " + where)
        if who == "viewer" and op.auth not in ("none", "session_path") and r.status_code < 300:
            self.problems.append("viewer key got 2xx outside /ui " + where)
        if r.status_code not in op.statuses:
            self.problems.append("undocumented status " + where)
        if r.status_code >= 400:
            err = r.json().get("error")
            if not (isinstance(err, dict) and err.get("message") and err.get("type")):
                self.problems.append("not the error envelope " + where)
            if path.removeprefix("/sessions/{session_id}").startswith("/v1/messages") and (
                    r.json().get("type") != "error" or not isinstance(err, dict) or set(err) != {"type", "message"}
                    or err["type"] != ANTHROPIC_TYPES.get(r.status_code, "invalid_request_error")):
                self.problems.append("not Anthropic's error shape " + where)
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            self.problems.extend(p + " " + where for p in stream_problems(path, r.text))


    def abandon_sync(self, plan: dict[str, Any]) -> None:
        """A planned sync holds the publish lock until its sync arrives (or 30 s past its timeout): a sync of the
        wrong version ends it at once (a 400), so the next publish in the fuzz does not wait for it."""
        r = self.client.post(f"{self.gw.url}/v1/weights/sync", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                             json={"sync_id": plan["sync_id"], "version": plan["version"] - 1 if plan["version"] > 1 else 2,
                                   "buckets": [{"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}]})
        if r.status_code != 400:
            self.problems.append(f"abandoning sync {plan['sync_id']}: {r.status_code} {r.text[:200]}")


    def resume_memory(self) -> None:
        """A release leaves the servers paused with their memory given back until a resume (a colocated trainer's
        step): resume at once, so the calls after it in the fuzz are served."""
        r = self.client.post(f"{self.gw.url}/v1/weights/memory/resume", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                             json={})
        if r.status_code != 200 or r.json().get("failed_backends"):
            self.problems.append(f"resuming after a release: {r.status_code} {r.text[:200]}")


STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def stream_problems(path: str, text: str) -> list[str]:
    """What is wrong with a streamed answer: every event's data is JSON (or `[DONE]`); chat and completions end
    with `[DONE]`, an error in the stream is the envelope; Responses events are numbered 0, 1, ... and end with
    a terminal event (docs/conformance-openai.md)."""
    import json
    import re

    # SSE lines end at CR, LF or CR LF only. str.splitlines also splits at U+2028, U+2029, U+0085 and a few
    # others, which JSON leaves unescaped inside a string: a generated token holding one split an event in two.
    lines = re.split(r"\r\n|\r|\n", text)
    route = path.removeprefix("/sessions/{session_id}")
    datas = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not datas:
        return ["an empty stream"]
    events = []
    for d in datas:
        if d == "[DONE]":
            continue
        try:
            events.append(json.loads(d))
        except ValueError:
            return [f"a stream event that is not JSON: {d[:100]}"]
    problems = []
    if route in ("/v1/chat/completions", "/v1/completions"):
        if datas[-1] != "[DONE]":
            problems.append("a stream that does not end with [DONE]")
        for e in events:
            if "error" in e and not (isinstance(e["error"], dict) and e["error"].get("message")):
                problems.append("an error event without the envelope")
    elif route == "/v1/responses":
        if [e.get("sequence_number") for e in events] != list(range(len(events))):
            problems.append("Responses events not numbered 0, 1, ...")
        if not events or events[-1].get("type") not in ("response.completed", "response.incomplete",
                                                        "response.failed"):
            problems.append("a Responses stream without its terminal event")
    elif route == "/v1/messages":  # Anthropic's named events (docs/conformance-anthropic.md "Streaming")
        names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
        if names != [e.get("type") for e in events]:
            problems.append("Messages events whose data type is not the event's name")
        if not names or names[0] != "message_start" or names[-1] not in ("message_stop", "error"):
            problems.append("a Messages stream not from message_start to message_stop (or error)")
        for e in events:
            if e.get("type") == "error" and set(e.get("error") or {}) != {"type", "message"}:
                problems.append("a Messages error event not in Anthropic's shape")
    return problems


class StreamFuzz(Fuzz):
    """The OpenAI routes that stream, each generated body sent with `stream: true`."""

    def run(self, examples: int) -> None:
        import schemathesis

        schema = schemathesis.openapi.from_url(f"{self.gw.url}/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path.removeprefix("/sessions/{session_id}") in STREAMED:
                self._runner(operation, "session", examples)()
        self.client.close()

    def check(self, method: str, path: str, who: str, case: Any, use_real: bool, pick: int) -> None:
        if isinstance(case.body, dict):
            case.body["stream"] = True
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if isinstance(case.body.get(name), int) and case.body[name] > 32:
                    case.body[name] = 32  # a stream of the whole context is slow, and adds nothing here
        super().check(method, path, who, case, use_real, pick)


@pytest.mark.slow
def test_fuzz_streams(gateway: LiveGateway, db_url: str) -> None:
    """Generated bodies, all streamed: no 5xx, documented statuses, and every stream well formed (~2 min on 2
    busy cores; `test_fuzz` checks the streams among its own bodies too)."""
    fuzz = StreamFuzz(gateway)
    fuzz.run(DEFAULT_EXAMPLES)
    _report(fuzz.table, fuzz.problems, db_url.split(":")[0])
    assert sum(n for (_, _, s), n in fuzz.table.items() if s == 200), "no streamed call succeeded"
    assert not fuzz.problems, "\n".join(fuzz.problems[:20])


def _fuzz(gw: LiveGateway, examples: int) -> tuple[Counter[tuple[str, str, int]], list[str]]:
    fuzz = Fuzz(gw)
    fuzz.run(examples)
    return fuzz.table, fuzz.problems


def _content(kwargs: dict[str, Any]) -> bytes | None:
    import json

    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data") or kwargs.get("content")
    return data.encode() if isinstance(data, str) else data


def _report(table: Counter[tuple[str, str, int]], problems: list[str], db: str) -> None:
    routes = sorted({(route, who) for who, route, _ in table})
    statuses = sorted({s for _, _, s in table})
    print(f"\nfuzz on {db}: {sum(table.values())} requests "
          f"(admin key {sum(n for (w, _, _), n in table.items() if w == 'admin')}, "
          f"session key {sum(n for (w, _, _), n in table.items() if w == 'session')}), "
          f"5xx: {sum(n for (_, _, s), n in table.items() if s >= 500)}")
    print(f"{'route':<52} {'key':<8} " + " ".join(f"{s:>4}" for s in statuses))
    for route, who in routes:
        print(f"{route:<52} {who:<8} " + " ".join(f"{table.get((who, route, s), 0) or '':>4}" for s in statuses))
    for p in problems[:20]:
        print("PROBLEM", p)


def test_fuzz(gateway: LiveGateway, db_url: str) -> None:
    table, problems = _fuzz(gateway, DEFAULT_EXAMPLES)
    _report(table, problems, db_url.split(":")[0])
    assert not problems, "\n".join(problems[:20])


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2 min of CPU on a quiet 2-core machine: the 300 s default guard tripped at load 6
def test_fuzz_long(gateway: LiveGateway, db_url: str) -> None:
    table, problems = _fuzz(gateway, SLOW_EXAMPLES)
    _report(table, problems, db_url.split(":")[0])
    assert not problems, "\n".join(problems[:20])
