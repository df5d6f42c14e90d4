"""docs/conformance-openai.md holds: a field that asks for what the gateway does not do is a 400 naming it (its
inert values pass), Responses' `text.format` reaches the backend as constrained decoding, and every request
field the gateway declares or refuses has a row in the document's table for its API."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.protocol import (
    CHAT_REFUSED,
    COMPLETIONS_REFUSED,
    RESPONSES_REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance-openai.md"
BASE = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 3},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 3},
}
REFUSED = [
    ("/v1/chat/completions", "frequency_penalty", 0.5), ("/v1/chat/completions", "presence_penalty", -1),
    ("/v1/chat/completions", "logit_bias", {"50": 5}), ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"), ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "x"}), ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/completions", "echo", True), ("/v1/completions", "suffix", "end"), ("/v1/completions", "best_of", 2),
    ("/v1/completions", "frequency_penalty", 1), ("/v1/completions", "logit_bias", {"1": 1}),
    ("/v1/responses", "background", True), ("/v1/responses", "conversation", "conv_1"),
    ("/v1/responses", "prompt", {"id": "pmpt_1"}), ("/v1/responses", "top_logprobs", 3),
    ("/v1/responses", "include", ["message.output_text.logprobs"]),
    ("/v1/responses", "previous_response_id", "resp_1"),
]
INERT = [
    ("/v1/chat/completions", {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
                              "modalities": ["text"], "user": "u", "metadata": {"k": "v"}, "store": False}),
    ("/v1/completions", {"echo": False, "best_of": 1, "suffix": "", "frequency_penalty": 0}),
    ("/v1/responses", {"include": [], "top_logprobs": 0, "store": False, "truncation": "disabled",
                       "reasoning": {"effort": "low"}, "background": False}),
]


@pytest.mark.parametrize(("path", "field", "value"), REFUSED, ids=[f"{p}:{f}" for p, f, _ in REFUSED])
def test_field_asking_for_what_is_not_done_is_400(gateway: Any, path: str, field: str, value: Any) -> None:
    cred = gateway.group(2)["sessions"][0]
    r = httpx.post(f"{gateway.url}{path}", json={**BASE[path], field: value},
                   headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert gateway.session(cred["session_id"])["turns"] == []  # refused before anything was generated


@pytest.mark.parametrize(("path", "extra"), INERT, ids=[p for p, _ in INERT])
def test_inert_values_pass(gateway: Any, path: str, extra: dict[str, Any]) -> None:
    cred = gateway.group(2)["sessions"][0]
    r = httpx.post(f"{gateway.url}{path}", json={**BASE[path], **extra},
                   headers={"Authorization": f"Bearer {cred['api_key']}"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_is_constrained_decoding(gateway: Any, fake: Any, stream: bool) -> None:
    cred = gateway.group(2)["sessions"][0]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    client = gateway.openai(cred)
    r = client.responses.create(model="m", input="37+48 as JSON", max_output_tokens=5, text={"format": fmt},
                                stream=stream)
    final = list(r)[-1].response if stream else r
    import json

    assert json.loads(fake.requests[-1]["sampling_params"]["json_schema"]) == schema
    assert final.text.format.type == "json_schema" and final.text.format.name == "answer"
    client.responses.create(model="m", input="any JSON", max_output_tokens=5, text={"format": {"type": "json_object"}})
    assert json.loads(fake.requests[-1]["sampling_params"]["json_schema"]) == {"type": "object"}


def _doc_fields(section: str) -> set[str]:
    """The backticked names in the first column of the request-field table under `## <section>`."""
    text = DOC.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
    return {name for cell in cells for name in re.findall(r"`([a-z_.]+)`", cell)}


@pytest.mark.parametrize(("section", "model", "refused"), [
    ("POST /v1/chat/completions", ChatCompletionRequest, CHAT_REFUSED),
    ("POST /v1/completions", CompletionRequest, COMPLETIONS_REFUSED),
    ("POST /v1/responses", ResponsesRequest, RESPONSES_REFUSED),
])
def test_every_field_has_a_row(section: str, model: Any, refused: dict[str, Any]) -> None:
    names = {f.alias or name for name, f in model.model_fields.items()} | set(refused)
    missing = names - _doc_fields(section)
    assert not missing, f"docs/conformance-openai.md {section} lacks rows for {sorted(missing)}"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_tool_choice_is_constrained(gateway: Any, fake: Any, tokenizer: Any, stream: bool) -> None:
    """tool_choice naming a function (Responses' own form) and parallel_tool_calls: false reach the backend as
    a grammar, as on chat completions; the reply is the call."""
    from tests.gateway.conftest import ids_of

    cred = gateway.group(2)["sessions"][0]
    tool = {"type": "function", "name": "calculate", "description": "math",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "37+48"}}\n</tool_call>'
    fake.script([ids_of(tokenizer, call)])
    r = gateway.openai(cred).responses.create(
        model="m", input="37+48?", tools=[tool], tool_choice={"type": "function", "name": "calculate"},
        parallel_tool_calls=False, max_output_tokens=100, stream=stream)
    final = list(r)[-1].response if stream else r
    assert fake.requests[-1]["sampling_params"].get("structural_tag")
    (fc,) = [o for o in final.output if o.type == "function_call"]
    assert fc.name == "calculate" and fc.arguments == '{"expression": "37+48"}'
    assert final.tool_choice.name == "calculate" and final.parallel_tool_calls is False
