"""Hermes: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, anywhere in the reply (Qwen2.5,
Qwen3, QwQ, Hermes 2/3, Granite 4)."""

from __future__ import annotations

from typing import Any

from gateway.tool_decoders import ParsedToolCall, Schemas, json_call, loads
from gateway.tool_formats.base import GrammarShape, ToolFormat, json_call_tag, quoted


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    call = json_call(loads(inner.strip()), ("arguments", "parameters"))
    return None if call is None else [call]


def _call(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return json_call_tag(f'<tool_call>\n{{"name": {quoted(name)}, "arguments": ', params, "}\n</tool_call>")


FORMAT = ToolFormat(
    name="hermes",
    families="Qwen2.5, Qwen3, QwQ, Hermes 2/3, Granite 4",
    example='`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the reply',
    signs=(("<tool_call>",),),
    start="<tool_call>", end="</tool_call>", decoder=decode,
    grammar=GrammarShape(_call, "\n"),
    aliases=("qwen25",),
)
