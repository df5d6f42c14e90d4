"""Constrained decoding on the real CPU engine over HTTP (uvicorn), with the random tiny model: whatever the
weights, a json_schema reply parses and matches the schema, a regex reply matches the regex; rows with and
without a grammar share a batch without touching each other; logprobs are the masked distribution's;
bad grammars are SGLang's 400s."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

import httpx
import jsonschema
import pytest

from tests.engine.conftest import LiveServer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "rain": {"type": "boolean"},
    # A pattern, not maxLength: xgrammar 0.2.8 (SGLang's default backend, the engine's until llguidance) lets
    # a length-bounded string take raw control characters (invalid JSON); docs/sglang-contract.md
    # "Constrained decoding".
    "note": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
}, "required": ["city", "days", "rain", "note"]}
REGEX = r"[0-9]{3}-[a-z]{2}(!|\?)"


async def generate(url: str, sampling: dict[str, Any], prompt: list[int], **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as c:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 80, **sampling}, "return_logprob": True,
                **extra}
        return await c.post(f"{url}/generate", json=body)


def test_json_schema_and_regex_hold_in_a_mixed_batch(live_engine: LiveServer) -> None:
    """Eight requests at once: json_schema, regex and free rows decoded together in one batch."""
    kinds = ["json", "regex", "free", "json", "regex", "free", "json", "free"]

    def sampling(kind: str, i: int) -> dict[str, Any]:
        extra = {"json": {"json_schema": json.dumps(SCHEMA)}, "regex": {"regex": REGEX}, "free": {}}[kind]
        return {"temperature": 1.0, "sampling_seed": i, **extra}

    async def run() -> list[httpx.Response]:
        return await asyncio.gather(*(generate(live_engine.url, sampling(k, i), [5, 6, 7, i + 10])
                                      for i, k in enumerate(kinds)))

    answers = asyncio.run(run())
    for kind, r in zip(kinds, answers, strict=True):
        assert r.status_code == 200, r.text
        out = r.json()
        if kind == "json":
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
            assert out["meta_info"]["finish_reason"]["type"] == "stop"
        elif kind == "regex":
            assert re.fullmatch(REGEX, out["text"]), out["text"]
            assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # A seeded free row draws the same tokens alone as beside constrained rows: no mask leaks across rows.
    alone = asyncio.run(generate(live_engine.url, sampling("free", 2), [5, 6, 7, 12])).json()
    assert alone["output_ids"] == answers[2].json()["output_ids"]


def test_ebnf_and_the_masked_logprobs(live_engine: LiveServer) -> None:
    # One allowed token at the first step (the one-letter vocabulary entry): the masked distribution gives it
    # probability 1 (SGLang reports masked logprobs); the free model's logprob of that token there is below 0.
    forced = asyncio.run(generate(live_engine.url, {"ebnf": 'root ::= "a"', "temperature": 1.0}, [5, 6, 7])).json()
    assert forced["text"] == "a"
    first_id = forced["output_ids"][0]
    lps = [lp for lp, _, _ in forced["meta_info"]["output_token_logprobs"]]
    assert lps[0] == pytest.approx(0.0, abs=1e-5)
    free = asyncio.run(generate(live_engine.url, {"max_new_tokens": 1, "temperature": 1.0}, [5, 6, 7],
                                top_logprobs_num=2000)).json()
    raw = {t: lp for lp, t, _ in free["meta_info"]["output_top_logprobs"][0]}
    assert raw[first_id] < -0.01


@pytest.mark.parametrize(("sampling", "needle"), [
    ({"regex": "[0-9"}, "Failed to compile regex grammar"),
    ({"json_schema": "{not json"}, "Failed to compile json grammar"),
    ({"ebnf": "root ::= "}, "Failed to compile ebnf grammar"),
    ({"structural_tag": json.dumps({"type": "structural_tag"})}, "Failed to compile structural_tag grammar"),
    ({"json_schema": "{}", "regex": "a"}, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
    ({"regex": "a", "structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})},
     "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
])
def test_bad_grammars_are_400s_in_sglangs_shape(live_engine: LiveServer, sampling: dict[str, Any], needle: str) -> None:
    r = asyncio.run(generate(live_engine.url, sampling, [5, 6]))
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


def test_structural_tag_forces_a_hermes_call(live_engine: LiveServer) -> None:
    """The gateway's forced tool_choice grammar (gateway/tool_grammar.py) on the engine: a Hermes tool call."""
    from gateway.tool_formats.hermes import decode as decode_hermes
    from gateway.tool_grammar import ForcedTools, structural_tag

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    tag = structural_tag("hermes", [tool], ForcedTools("get_weather", parallel=False))
    for seed in range(3):
        out = asyncio.run(generate(live_engine.url, {"structural_tag": tag, "sampling_seed": seed,
                                                     "max_new_tokens": 120, "skip_special_tokens": False}, [5, 6, seed + 7])).json()
        text = out["text"]
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        calls = decode_hermes(text[len("<tool_call>"):-len("</tool_call>")], None)
        assert calls is not None and len(calls) == 1, text
        assert calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


def _grammar_formats() -> list[str]:
    from gateway.tool_formats import FORMATS

    return [f.name for f in FORMATS if f.grammar is not None and f.name != "hermes"]  # hermes: the test above


@pytest.mark.parametrize("fmt", _grammar_formats())
def test_structural_tag_forces_a_call_in_each_format(live_engine: LiveServer, fmt: str) -> None:
    """Every registered format with a grammar, on the engine: the reply it forces is a call the format's parser
    reads back, its arguments held to the schema."""
    from gateway.tool_formats import get_tool_format
    from gateway.tool_grammar import ForcedTools, structural_tag
    from gateway.tool_parsers import parse_reply

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    tag = structural_tag(fmt, [tool], ForcedTools("get_weather", parallel=False))
    out = asyncio.run(generate(live_engine.url, {"structural_tag": tag, "sampling_seed": 1, "max_new_tokens": 120,
                                                 "skip_special_tokens": False}, [5, 6, 8])).json()
    reply = parse_reply(out["text"], get_tool_format(fmt), tools=[tool])
    assert [c.name for c in reply.tool_calls] == ["get_weather"] and reply.content is None, out["text"]
    jsonschema.validate(json.loads(reply.tool_calls[0].arguments), SCHEMA)


def test_the_grammar_library_is_llguidance_alone(live_engine: LiveServer) -> None:
    """The engine (in this process) compiles and masks with llguidance: no xgrammar (its triton is ~1 GB) and
    not llguidance.torch (it imports torch's compiler for a torch.compile'd kernel)."""
    r = asyncio.run(generate(live_engine.url, {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 4}, [5, 6]))
    assert r.status_code == 200, r.text
    assert "llguidance" in sys.modules
    assert "xgrammar" not in sys.modules and "llguidance.torch" not in sys.modules


def test_structural_tag_forms_beside_the_gateways(live_engine: LiveServer) -> None:
    """The legacy form (free text, a structure after its trigger) compiles and holds; a format the engine does
    not translate is SGLang's 400, naming it."""
    legacy = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": '<tool_call>{"name": "f", "arguments": ', "schema": SCHEMA, "end": "}</tool_call>"}]}
    for seed in range(2):
        out = asyncio.run(generate(live_engine.url, {"structural_tag": json.dumps(legacy), "sampling_seed": seed,
                                                     "skip_special_tokens": False}, [5, 6, seed + 7]))
        assert out.status_code == 200, out.text
        text = out.json()["text"]
        for call in text.split("<tool_call>")[1:]:  # every structure begun is held to its schema
            if "</tool_call>" in call:
                body = call[:call.index("</tool_call>")]
                assert body.startswith('{"name": "f", "arguments": ') and body.endswith("}"), text
                jsonschema.validate(json.loads(body[len('{"name": "f", "arguments": '):-1]), SCHEMA)
    triggered = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a>"], "tags": []}}
    r = asyncio.run(generate(live_engine.url, {"structural_tag": json.dumps(triggered)}, [5, 6]))
    assert r.status_code == 400
    assert "Failed to compile structural_tag grammar" in r.json()["error"]["message"]
    assert "'triggered_tags' is not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "integer", "multipleOf": 3}, "JSON Schema at # is not supported by xgrammar: keyword(s) multipleOf"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "color"}}},
     "JSON Schema at #/properties/d is not supported by xgrammar: string format 'color' is not implemented"),
    ({"type": "string", "format": "date", "pattern": "^2"}, "constraints format, pattern cannot be enforced together"),
])
def test_schemas_sglang_refuses_are_refused(live_engine: LiveServer, schema: Any, needle: str) -> None:
    """SGLang 0.5.23's `validate_xgrammar_json_schema` (issue 27 item 4), in its words; not in a structural tag."""
    r = asyncio.run(generate(live_engine.url, {"json_schema": json.dumps(schema)}, [5, 6]))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"Failed to compile json grammar: {needle}" or needle in r.text
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    r = asyncio.run(generate(live_engine.url, {"structural_tag": json.dumps(tag), "max_new_tokens": 4}, [5, 6]))
    assert r.status_code == 200, r.text


def test_a_streamed_bad_grammar_is_an_abort_chunk_with_status_400(live_engine: LiveServer) -> None:
    """As SGLang streams it (issue 27 item 3): HTTP 200, one chunk finishing with abort, status_code 400."""
    r = asyncio.run(generate(live_engine.url, {"regex": "[0-9"}, [5, 6], stream=True, rid="g1"))
    assert r.status_code == 200
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")
              and "[DONE]" not in line]
    (chunk,) = events
    finish = chunk["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 400 and finish["err_type"] == "BadRequestError"
    assert finish["message"].startswith("Failed to compile regex grammar")
    assert chunk["output_ids"] == [] and chunk["meta_info"]["id"] == "g1"
