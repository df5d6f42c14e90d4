"""Qwen3-Coder: `<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`."""

from __future__ import annotations

import re

from gateway.tool_decoders import ParsedToolCall, Schemas, call_from_args, typed
from gateway.tool_formats.base import ToolFormat
from gateway.tool_formats.hermes import decode as decode_hermes

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """Qwen3-Coder's XML, or Hermes JSON (the same model family sometimes answers so)."""
    match = _FUNCTION.fullmatch(inner)
    if match is None:
        return decode_hermes(inner, schemas)
    name, body = match.group(1).strip(), match.group(2)
    props = schemas.get(name, {})
    args = {k.strip(): typed(v, props.get(k.strip())) for k, v in _PARAMETER.findall(body)}
    if _PARAMETER.sub("", body).strip():
        return None  # text between the parameters: not the format
    call = call_from_args(name, args)
    return None if call is None else [call]


FORMAT = ToolFormat(
    name="qwen3_coder",
    families="Qwen3-Coder",
    example="`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`",
    signs=(("<function=", "<parameter="),),
    start="<tool_call>", end="</tool_call>", decoder=decode,
)
