"""What the tool-call formats share (gateway.tool_formats holds the formats, one module each): the parsed call,
the gateway's call ids, the request's tool schemas, and helpers that turn decoded names and arguments into
calls.

XML-style formats carry argument values as text: a value is kept a string when the tool's schema says
so, else read as JSON when it parses (`3` -> 3), else kept as the string (`typed`). A block that does not
decode stays content; nothing here raises on model output.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str
    """A JSON object as text (json.dumps of the parsed arguments, ensure_ascii=False)."""



def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)




Schemas = Mapping[str, Mapping[str, Any]]
"""Function name -> its parameters' JSON-schema properties (from the request's tools)."""


def tool_schemas(tools: Sequence[Any] | None) -> Schemas:
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def call_from_args(name: Any, args: Any) -> ParsedToolCall | None:
    """A call from a name and decoded arguments (a dict, a JSON string of one, or None), else None."""
    if not isinstance(name, str) or not name:
        return None
    if args is None:
        args = {}
    elif isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, too deep, or an integer past int_max_str_digits: no call
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def json_call(obj: Any, arg_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """A call from a decoded JSON value `{"name", <arg key>}`, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), None)
    return call_from_args(obj.get("name"), args)


def loads(text: str) -> Any:
    """`text` as JSON, or `INVALID`."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # ValueError: not JSON, or an integer past int_max_str_digits
        return INVALID


INVALID = object()


def typed(value: str, schema: Mapping[str, Any] | None) -> Any:
    """An argument value given as text: a string when the schema says so, else JSON when it parses."""
    kind = (schema or {}).get("type")
    if kind == "string":
        return value
    parsed = loads(value)
    return value if parsed is INVALID else parsed



# --- decoders: a block's inside -> calls (None: not a tool call; the block stays content) ----------------

Decoder = Callable[[str, Schemas], "list[ParsedToolCall] | None"]


def repeated(
    pattern: re.Pattern[str], text: str, make: Callable[[re.Match[str]], ParsedToolCall | None]
) -> list[ParsedToolCall] | None:
    """Calls from back-to-back matches of `pattern` covering all of `text` but whitespace."""
    calls, pos = [], 0
    while pos < len(text) and text[pos:].strip():
        m = pattern.match(text, pos)
        if m is None:
            return None
        call = make(m)
        if call is None:
            return None
        calls.append(call)
        pos = m.end()
    return calls or None


def decode_json_list(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """`[{"name", "arguments"}, ...]` (or one object), as Mistral Nemo and Granite 3 write calls."""
    value = loads(inner.strip())
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item, ("arguments", "parameters")) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]
