"""Granite 3.x: `<|tool_call|>[{"name": "f", "arguments": {...}}, ...]` to the end of the reply."""

from __future__ import annotations

from typing import Any

from gateway.tool_decoders import decode_json_list
from gateway.tool_formats.base import GrammarShape, ToolFormat, json_call_tag, quoted


def _call(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return json_call_tag(f'{{"name": {quoted(name)}, "arguments": ', params, "}")


FORMAT = ToolFormat(
    name="granite",
    families="Granite 3.x",
    example='`<|tool_call|>[{"name", "arguments"}, ...]` to the end',
    signs=(("<|tool_call|>",),),
    start="<|tool_call|>", end=None, decoder=decode_json_list,
    grammar=GrammarShape(_call, ", ", before="<|tool_call|>[", after="]"),
)
