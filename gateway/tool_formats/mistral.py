"""Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (v3 tokenizers: Nemo) or
`[TOOL_CALLS]f[CALL_ID]id[ARGS]{...}[TOOL_CALLS]...` (v11+: Small 3.2, Devstral), to the end of the reply."""

from __future__ import annotations

import re
import secrets

from gateway.tool_decoders import ParsedToolCall, Schemas, call_from_args, decode_json_list
from gateway.tool_formats.base import ToolFormat

_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]", re.S)
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def call_id() -> str:
    """Mistral's templates refuse a tool-call id that is not nine letters and digits; an agent sends the id
    back with the call and its result, so the gateway's own ids must be of that kind."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """After `[TOOL_CALLS]`: a JSON list (v3 tokenizers), or `name[CALL_ID]id[ARGS]{...}` with further
    calls each after its own `[TOOL_CALLS]` (v11+)."""
    if inner.lstrip().startswith(("[", "{")):
        return decode_json_list(inner, schemas)
    calls = []
    for part in inner.split("[TOOL_CALLS]"):
        m = _CALL.match(part)
        if m is None:
            return None
        call = call_from_args(m.group(1), part[m.end():].strip())
        if call is None:
            return None
        calls.append(call)
    return calls or None


FORMAT = ToolFormat(
    name="mistral",
    families="Mistral Nemo (v3), Small 3.2, Devstral (v11+)",
    example='`[TOOL_CALLS][{"name", "arguments"}, ...]` or `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` to the end',
    signs=(("[TOOL_CALLS]",),),
    start="[TOOL_CALLS]", end=None, decoder=decode, new_id=call_id,
)
