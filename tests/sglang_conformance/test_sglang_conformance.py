"""Conformance to SGLang 0.5.23 checked with SGLang's own code, not ours (issue 27; docs/sglang-contract.md).

SGLang cannot serve here (no GPU kernels), but its request parsing runs on a CPU: in a venv of its own
(`sglang_venv.py`: the wheel without dependencies, plus msgspec), `in_venv.py` runs

(a) every `/generate` body the gateway sent while the capture tests below ran (a recording fake,
    `tests/fakes/sglang.py` RECORD_ENV) through `api_contract.generate_contract_error` (its generated
    `GenerateRequest.from_json_value`, which `http_server.generate_request` calls) and `SamplingParams(...)`,
    `.normalize`, `.verify` (what its tokenizer manager does before scheduling); each option a send site can set
    (stream or not, json_schema, structural_tag, lora_path, top_logprobs_num, sampling_seed, stop, a resubmission)
    must have at least one captured body. Also every JSON schema the gateway checks is judged by SGLang's
    `validate_xgrammar_json_schema`: ours must give the same verdict and words;
(b) every SGLang endpoint the gateway calls (the paths in gateway/sglang.py and gateway/weight_sync.py, and
    docker-compose.yml's healthcheck) against the routes `http_server.py` declares (read with `ast`: importing
    the real `http_server.app` needs the server's ~25 further packages, which this suite does not install), each
    captured control body's keys against the fields of the request type the route declares (io_struct.py),
    the `meta_info` keys the gateway reads and the engine and fake send against those the tokenizer manager
    fills, and compose's launch flags against ServerArgs' fields;
(c) the version: the wheel's is `SGLANG_VERSION`, compose's default image tag names it.

The capture runs the tests in CAPTURE (SQLite only) in a subprocess, or reads ROLLWAY_SGLANG_CAPTURE (a JSON-lines
file written by an earlier run with ROLLWAY_RECORD_SGLANG set). Counts are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollway_common.json_schema_check import unsupported_reason
from tests.fakes.sglang import RECORD_ENV
from tests.gateway.test_sglang_refusals import REFUSED
from tests.sglang_conformance.sglang_venv import SGLANG_VERSION, ensure_venv

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = [
    "tests/gateway/test_tool_choice.py",          # chat: forced tool_choice (structural_tag), streaming
    "tests/gateway/test_tool_choice_resubmit.py",  # grammar replies resubmitted
    "tests/gateway/test_sglang_refusals.py",       # every streaming route; json_schema
    "tests/gateway/test_openai_surface.py",        # chat and completions: seeds, stop, logprobs, response_format
    "tests/gateway/test_anthropic_api.py",         # messages
    "tests/gateway/test_responses_stream.py",      # responses
    "tests/gateway/test_adapters.py",              # LoRA: lora_path
]
GATEWAY_RID = re.compile(r"^[0-9a-f]{32}-(\d+)$")
"""The rid of every attempt the gateway sends (`generation.generate`): bodies with another one came from a test."""
REQUIRED = ["stream", "not stream", "json_schema", "structural_tag", "lora_path", "top_logprobs_num",
            "sampling_seed", "stop", "resubmission"]
LEGACY_ONLY = {"/get_model_info", "/get_server_info"}
"""Paths the client falls back to on a 404 from older servers; 0.5.23 may lack them."""
GATEWAY_READS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
                 "output_token_logprobs", "output_top_logprobs"}
"""The `meta_info` keys `gateway/sglang.py` `_parse` / `_chunk` read."""
SAMPLE_SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}},
    {"type": "string", "minLength": 1, "maxLength": 3},
    {"type": "object", "properties": {"f": {"format": "date", "type": "integer", "pattern": "x"}}},
    {"type": ["string", "null"], "format": "email", "maxLength": 4},
    {"anyOf": [{"type": "integer", "multipleOf": 5}, {"type": "null"}]},
    {"dependencies": {"a": {"not": {}}}, "items": [{"uniqueItems": True}]},
    {"properties": {"a/b~c": {"format": 3}}},
    {"type": "object", "properties": {"x": {"type": "array", "contains": {"type": "integer"}, "minContains": 1}}},
]


def route_of(test: str) -> str:
    name = test.lower()
    if "anthropic" in name or "messages" in name:
        return "messages"
    if "responses" in name:
        return "responses"
    if "completions" in name and "chat" not in name:
        return "completions"
    if "adapters" in name:
        return "chat (LoRA)"
    return "chat"


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    given = os.environ.get("ROLLWAY_SGLANG_CAPTURE")
    if given:
        path = Path(given)
    else:
        path = tmp_path_factory.mktemp("capture") / "bodies.jsonl"
        env = {**os.environ, RECORD_ENV: str(path), "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not postgres",
                            *CAPTURE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
        assert r.returncode == 0, f"the capture tests failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gateway_bodies(captured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in captured if c["path"] == "/generate" and GATEWAY_RID.match(str(c["body"].get("rid", "")))]


def compose_flags() -> list[str]:
    text = (ROOT / "docker-compose.yml").read_text()
    block = text[text.index("  sglang:"):]
    command = block[block.index("command:"):block.index("environment:")]
    return sorted(set(re.findall(r"--[a-z][a-z0-9-]+", command)))


def schemas(captured: list[dict[str, Any]]) -> list[Any]:
    out = [s for s, _ in REFUSED] + SAMPLE_SCHEMAS
    for c in gateway_bodies(captured):
        text = (c["body"].get("sampling_params") or {}).get("json_schema")
        if text and text != "$$ANY$$":
            out.append(json.loads(text))
    return out


@pytest.fixture(scope="module")
def report(captured: list[dict[str, Any]]) -> dict[str, Any]:
    python = ensure_venv()
    request = {"generate": [c["body"] for c in gateway_bodies(captured)],
               "schemas": [[s, unsupported_reason(s)] for s in schemas(captured)],
               "flags": compose_flags(), "vocab_size": 151936}
    r = subprocess.run([str(python), str(Path(__file__).with_name("in_venv.py"))], input=json.dumps(request),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out: dict[str, Any] = json.loads(r.stdout)
    out["request"] = request
    return out


def features(body: dict[str, Any]) -> set[str]:
    sp = body.get("sampling_params") or {}
    found = {"stream" if body.get("stream") else "not stream"}
    found |= {k for k in ("json_schema", "structural_tag", "sampling_seed", "stop") if sp.get(k) is not None}
    found |= {k for k in ("lora_path", "top_logprobs_num") if body.get(k) is not None}
    match = GATEWAY_RID.match(str(body.get("rid", "")))
    if match and int(match.group(1)) > 0:
        found.add("resubmission")
    return found


def test_c_the_wheel_is_the_pinned_version(report: dict[str, Any]) -> None:
    assert report["version"] == SGLANG_VERSION
    assert f"lmsysorg/sglang:${{SGLANG_TAG:-v{SGLANG_VERSION}}}" in (ROOT / "docker-compose.yml").read_text()
    assert f'"{SGLANG_VERSION}+rollway"' in (ROOT / "engine" / "server.py").read_text()


def test_a_every_generate_body_is_accepted(captured: list[dict[str, Any]], report: dict[str, Any]) -> None:
    bodies = gateway_bodies(captured)
    refused = [(c["test"], c["body"], e) for c, e in zip(bodies, report["generate"], strict=True) if e is not None]
    assert not refused, refused[:5]
    by_route = Counter(route_of(c["test"]) for c in bodies)
    by_feature = Counter(f for c in bodies for f in features(c["body"]))
    print(f"\n/generate bodies checked by SGLang {report['version']}: {len(bodies)}; by route (of the test that sent "
          f"it): {dict(by_route)}; by option: {dict(by_feature)}")
    missing = [f for f in REQUIRED if not by_feature[f]]
    assert not missing, f"no captured body exercises {missing}: add a test that sends one"
    assert {"chat", "completions", "responses", "messages"} <= set(by_route)


def test_a_schema_refusals_agree_with_sglangs(report: dict[str, Any]) -> None:
    ours = [o for _, o in report["request"]["schemas"]]
    theirs = report["schemas"]
    assert ours == theirs, [(s, o, t) for (s, o), t in zip(report["request"]["schemas"], theirs, strict=True) if o != t]
    print(f"\nJSON schemas judged by SGLang and by rollway: {len(ours)} ({sum(t is not None for t in theirs)} refused)")


def called_paths() -> set[str]:
    paths: set[str] = set()
    for f in ("gateway/sglang.py", "gateway/weight_sync.py"):
        paths |= set(re.findall(r'"(/[a-z_]+)"', (ROOT / f).read_text()))
    compose = (ROOT / "docker-compose.yml").read_text()
    block = compose[compose.index("  sglang:"):compose.index("\n  gateway:")] if "\n  gateway:" in compose else ""
    paths |= set(re.findall(r"SGLANG_PORT:-30000\}(/[a-z_]+)", block))
    return paths - {"/v1"}


def test_b_every_endpoint_exists_with_its_fields(captured: list[dict[str, Any]], report: dict[str, Any]) -> None:
    routes = report["routes"]
    paths = called_paths()
    missing = sorted(p for p in paths - LEGACY_ONLY if p not in routes)
    assert not missing, f"SGLang {report['version']} has no route {missing}"
    compared = 0
    bad = []
    for c in captured:
        path = c["path"]
        if path == "/generate" or "aiohttp" not in c["agent"]:
            continue  # /generate: checked in (a); other agents: a test's own call, not the gateway's
        route = routes.get(path)
        assert route is not None, path
        assert "POST" in route["methods"], (path, route)
        fields = set(report["types"].get(route["type"] or "", []))
        for key in c["body"]:
            compared += 1
            if key not in fields:
                bad.append((path, key, route["type"]))
    assert not bad, f"body fields SGLang's request types do not define: {sorted(set(bad))}"
    print(f"\nendpoints checked: {len(paths)} ({len(routes)} routes in http_server.py); control body fields "
          f"compared: {compared}")


def test_b_answers_carry_the_fields_sglang_fills(report: dict[str, Any], tiny_model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from engine.server import create_app
    from tests.fakes.sglang import FakeSGLang

    sglang_keys = set(report["meta_info"])
    assert sglang_keys >= GATEWAY_READS, GATEWAY_READS - sglang_keys
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
            "top_logprobs_num": 2, "rid": "r"}
    app = create_app(tiny_model_dir, max_batch_size=2)
    try:
        with TestClient(app) as client:
            engine_meta = client.post("/generate", json=body).json()["meta_info"]
    finally:
        app.state.engine.scheduler.stop()
    with FakeSGLang() as fake:
        import httpx

        fake_meta = httpx.post(f"{fake.url}/generate", json=body, timeout=30).json()["meta_info"]
    for who, meta in (("engine", engine_meta), ("fake", fake_meta)):
        assert set(meta) <= sglang_keys, f"{who} sends meta_info keys SGLang never fills: {set(meta) - sglang_keys}"
        assert set(meta) >= GATEWAY_READS, f"{who} lacks {GATEWAY_READS - set(meta)}"
    print(f"\nmeta_info keys compared: engine {len(engine_meta)}, fake {len(fake_meta)} against SGLang's "
          f"{len(sglang_keys)}")


def test_b_compose_flags_are_sglangs(report: dict[str, Any]) -> None:
    unknown = [f for f, known in report["flags"].items() if not known]
    assert report["flags"] and not unknown, unknown
