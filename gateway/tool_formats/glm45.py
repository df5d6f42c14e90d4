"""GLM-4.5+: `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>`."""

from __future__ import annotations

import re

from gateway.tool_decoders import ParsedToolCall, Schemas, call_from_args, typed
from gateway.tool_formats.base import ToolFormat

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """The name up to the first line break or `<arg_key>`, then key/value pairs."""
    cut = min((i for i in (inner.find("\n"), inner.find("<arg_key>")) if i >= 0), default=len(inner))
    name, body = inner[:cut].strip(), inner[cut:]
    props = schemas.get(name, {})
    args = {k.strip(): typed(v, props.get(k.strip())) for k, v in _ARG.findall(body)}
    if _ARG.sub("", body).strip():
        return None
    call = call_from_args(name, args)
    return None if call is None else [call]


FORMAT = ToolFormat(
    name="glm45",
    families="GLM-4.5, 4.6, 4.7",
    example="`<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>`",
    signs=(("<arg_key>",),),
    start="<tool_call>", end="</tool_call>", decoder=decode,
)
