"""The insides of tool-call blocks, per model family: a decoder turns the text between a format's markers into
calls (`gateway.tool_scanners` finds the blocks while the reply streams). The formats, as each family's chat template
renders an assistant message with tool calls (the parsers read back what the template writes):

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3, Hermes, Granite 4)
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
    glm45         <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
                  <|tool_call_end|>...<|tool_calls_section_end|>
    deepseek      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
                  (V3.1; R1's `function<｜tool▁sep｜>f\\n```json\\n{...}\\n```` inside too)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   (Nemo) or
                  [TOOL_CALLS]f[CALL_ID]id[ARGS]{...}[TOOL_CALLS]...     (Small 3.2, Devstral) to the end
    granite       <|tool_call|>[{"name": "f", "arguments": {...}}, ...]  to the end (Granite 3.x)
    llama3_json   [<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]*  as the whole reply

XML-style formats carry argument values as text: a value is kept a string when the tool's schema says
so, else read as JSON when it parses (`3` -> 3), else kept as the string. A block that does not decode
stays content; nothing here raises on model output.
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


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id() -> str:
    """Mistral's templates refuse a tool-call id that is not nine letters and digits; an agent sends the id
    back with the call and its result, so the gateway's own ids must be of that kind."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


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
        except (json.JSONDecodeError, RecursionError):  # a model's output too deep to parse is no call
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


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _INVALID


_INVALID = object()


def _typed(value: str, schema: Mapping[str, Any] | None) -> Any:
    """An argument value given as text: a string when the schema says so, else JSON when it parses."""
    kind = (schema or {}).get("type")
    if kind == "string":
        return value
    parsed = _loads(value)
    return value if parsed is _INVALID else parsed



# --- decoders: a block's inside -> calls (None: not a tool call; the block stays content) ----------------

Decoder = Callable[[str, Schemas], "list[ParsedToolCall] | None"]


def decode_hermes(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    call = json_call(_loads(inner.strip()), ("arguments", "parameters"))
    return None if call is None else [call]


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def decode_qwen3_coder(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """Qwen3-Coder's XML, or Hermes JSON (the same model family sometimes answers so)."""
    match = _FUNCTION.fullmatch(inner)
    if match is None:
        return decode_hermes(inner, schemas)
    name, body = match.group(1).strip(), match.group(2)
    props = schemas.get(name, {})
    args = {k.strip(): _typed(v, props.get(k.strip())) for k, v in _PARAMETER.findall(body)}
    if _PARAMETER.sub("", body).strip():
        return None  # text between the parameters: not the format
    call = call_from_args(name, args)
    return None if call is None else [call]


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def decode_glm45(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """GLM-4.5+: the name up to the first line break or `<arg_key>`, then key/value pairs."""
    cut = min((i for i in (inner.find("\n"), inner.find("<arg_key>")) if i >= 0), default=len(inner))
    name, body = inner[:cut].strip(), inner[cut:]
    props = schemas.get(name, {})
    args = {k.strip(): _typed(v, props.get(k.strip())) for k, v in _GLM_ARG.findall(body)}
    if _GLM_ARG.sub("", body).strip():
        return None
    call = call_from_args(name, args)
    return None if call is None else [call]


_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?([^\s<]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.S)


def decode_kimi_k2(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    return _repeated(_KIMI_CALL, inner, lambda m: call_from_args(m.group(1), m.group(2).strip()))


_DS_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_DS_R1_ARGS = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.S)


def _deepseek_call(m: re.Match[str]) -> ParsedToolCall | None:
    head, rest = m.group(1).strip(), m.group(2)
    r1 = _DS_R1_ARGS.fullmatch(rest) if head == "function" else None
    if r1 is not None:  # R1: function<｜tool▁sep｜>name\n```json\n{...}\n```
        return call_from_args(r1.group(1).strip(), r1.group(2).strip())
    return call_from_args(head, rest.strip())


def decode_deepseek(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    return _repeated(_DS_CALL, inner, _deepseek_call)


def _repeated(
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
    value = _loads(inner.strip())
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item, ("arguments", "parameters")) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


_MISTRAL_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]", re.S)


def decode_mistral(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """After `[TOOL_CALLS]`: a JSON list (v3 tokenizers), or `name[CALL_ID]id[ARGS]{...}` with further
    calls each after its own `[TOOL_CALLS]` (v11+)."""
    if inner.lstrip().startswith(("[", "{")):
        return decode_json_list(inner, schemas)
    calls = []
    for part in inner.split("[TOOL_CALLS]"):
        m = _MISTRAL_CALL.match(part)
        if m is None:
            return None
        call = call_from_args(m.group(1), part[m.end():].strip())
        if call is None:
            return None
        calls.append(call)
    return calls or None
