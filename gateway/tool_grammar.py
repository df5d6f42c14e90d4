"""Forced tool choice (`tool_choice: "required"`, a named function, `parallel_tool_calls: false`) as a
grammar the backend decodes under, written in the tool-call format of the model's family.

The grammar is an SGLang `structural_tag` in its current form (`{"type": "structural_tag", "format": ...}`,
compiled by SGLang's grammar backend, xgrammar by default, and by the CPU engine with llguidance;
docs/sglang-contract.md "Constrained decoding"): a sequence of tags, one per call, each the family's own
markup around the tool's name, with the arguments held to the tool's JSON schema. So the reply is a tool call
the gateway's parser reads back, whatever the weights, and the model writes it in the tokens its template
taught it. Each format's record (gateway.tool_formats) holds its grammar shape; formats without one are
refused with a 400 naming the format.

A turn decoded under a grammar is recorded as constrained: its tokens are not samples of the policy the
trainer recomputes, and they are kept out of the loss by default (gateway/samples.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.tool_formats import FORMATS

_TOOL_FORMATS = {f.name: f for f in FORMATS}

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A tool without `parameters` takes an empty object (as SGLang's own tool_choice constraint does)."""


@dataclass(frozen=True, slots=True)
class ForcedTools:
    """What a forced tool_choice asks for: a call to `name` (None: to any offered tool); `parallel`: one or
    more calls, else exactly one."""

    name: str | None
    parallel: bool = True


def resolve_tool_choice(
    tool_choice: Any, tools: list[dict[str, Any]] | None, parallel_tool_calls: bool | None = None
) -> tuple[list[dict[str, Any]] | None, ForcedTools | None]:
    """(the tools the prompt offers, what is forced) for OpenAI's tool_choice: "auto" / absent, "none" (no
    tools rendered), "required", or {"type": "function", "function": {"name": ...}}. The Responses API's
    {"type": "function", "name": ...} and Anthropic's any / tool are mapped to these by their routes.
    A `parallel_tool_calls: false` alone (auto) forces nothing: the reply may hold no call at all."""
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice == "auto":
        return tools, None
    if tool_choice == "none":
        return None, None
    if not tools:
        raise BadRequest("tool_choice was given but no tools were offered", param="tool_choice")
    if tool_choice == "required":
        return tools, ForcedTools(None, parallel)
    name = _named(tool_choice)
    if name is None:
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if name not in {_function(t).get("name") for t in tools}:
        raise BadRequest(f"tool_choice names function {name!r}, which is not among the tools offered",
                         param="tool_choice")
    return tools, ForcedTools(name, parallel)


def _named(choice: Any) -> str | None:
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    return name if isinstance(name, str) and name else None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else {}


def structural_tag(
    tool_parser: str | None, tools: list[dict[str, Any]], forced: ForcedTools, *, reasoning_close: str | None = None
) -> str:
    """The `structural_tag` sampling parameter (a JSON text) forcing `forced` in the family's format.

    `reasoning_close`: the generation prompt opened the reasoning block (the reply starts inside it), so the
    reply may reason freely up to this closing marker before the calls."""
    tool_format = _TOOL_FORMATS.get(tool_parser or "")
    family = tool_format.grammar if tool_format is not None else None
    if family is None:
        supported = ", ".join(sorted(f.name for f in FORMATS if f.grammar is not None))
        raise BadRequest(
            f"tool_choice 'required' or a named function is decoded under a grammar in the model's tool-call "
            f"format; this model's format ({tool_parser or 'unknown'}) is not one the gateway can constrain "
            f"(supported: {supported}); use tool_choice 'auto'", param="tool_choice", code="unsupported_tool_choice")
    chosen = [t for t in tools if forced.name is None or _function(t).get("name") == forced.name]
    tags = []
    for tool in chosen:
        fn = _function(tool)
        params = fn.get("parameters") or NO_PARAMETERS
        if not isinstance(params, dict):
            raise BadRequest(f"the parameters of tool {fn.get('name')!r} must be a JSON schema object", param="tools")
        tags.append(family.call(str(fn.get("name")), params))
    calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": family.separator,
                             "at_least_one": True, "stop_after_first": not forced.parallel}
    elements: list[dict[str, Any]] = []
    if reasoning_close:
        elements.append({"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": reasoning_close})
    if family.before:
        elements.append({"type": "const_string", "value": family.before})
    elements.append(calls)
    if family.after:
        elements.append({"type": "const_string", "value": family.after})
    fmt = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def response_format_schema(response_format: Any) -> str | None:
    """The `json_schema` sampling parameter for OpenAI's response_format (None for text or absent):
    json_schema's `schema` (an empty one allows any object), json_object any JSON object."""
    if response_format is None:
        return None
    kind = getattr(response_format, "type", None)
    if kind == "json_schema":
        spec = getattr(response_format, "json_schema", None)
        if not isinstance(spec, dict):  # OpenAI's API refuses it too, rather than allow any object
            raise BadRequest("a response_format of type json_schema needs its json_schema object",
                             param="response_format.json_schema")
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise BadRequest(f"response_format.json_schema.schema must be a JSON schema object, got "
                             f"{type(schema).__name__}", param="response_format.json_schema.schema")
        return json.dumps(schema or {"type": "object"})
    if kind == "json_object":
        return json.dumps({"type": "object"})
    return None
