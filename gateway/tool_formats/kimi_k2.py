"""Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
<|tool_call_end|>...<|tool_calls_section_end|>`."""

from __future__ import annotations

import re

from gateway.tool_decoders import ParsedToolCall, Schemas, call_from_args, repeated
from gateway.tool_formats.base import ToolFormat

_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?([^\s<]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.S)


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    return repeated(_CALL, inner, lambda m: call_from_args(m.group(1), m.group(2).strip()))


FORMAT = ToolFormat(
    name="kimi_k2",
    families="Kimi-K2",
    example="`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}"
            "<|tool_call_end|><|tool_calls_section_end|>`",
    signs=(("<|tool_calls_section_begin|>",),),
    start="<|tool_calls_section_begin|>", end="<|tool_calls_section_end|>", decoder=decode,
)
