"""NVIDIA Nemotron Nano 2: `<TOOLCALL>[{"name": "f", "arguments": {...}}, ...]</TOOLCALL>`, after the reasoning
the generation prompt opened (`<think>\\n`), anywhere in the reply.

As the family's chat template writes calls (and tells the model to in its system prompt): one block holding
a JSON list, each call an object with `name` and `arguments` (an object, or a JSON string of one).
"""

from __future__ import annotations

from typing import Any

from gateway.tool_decoders import INVALID, ParsedToolCall, Schemas, json_call, loads
from gateway.tool_formats.base import THINK, GrammarShape, ToolFormat, json_call_tag, quoted

START, END = "<TOOLCALL>", "</TOOLCALL>"


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """The block's JSON list of calls; anything else (one bare object, bad JSON, an item without a name)
    is no call, and the block stays content."""
    value = loads(inner.strip())
    if value is INVALID or not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        call = json_call(item, ("arguments",))
        if call is None:
            return None
        calls.append(call)
    return calls


def _call(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return json_call_tag(f'{{"name": {quoted(name)}, "arguments": ', params, "}")


FORMAT = ToolFormat(
    name="nemotron_json",
    families="Nemotron Nano 2 (9B, 12B)",
    example='`<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`, anywhere in the reply',
    signs=((START,),),
    start=START, end=END, decoder=decode,
    grammar=GrammarShape(_call, ", ", before=START + "[", after="]" + END),
    reasoning=THINK,
)
