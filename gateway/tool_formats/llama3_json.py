"""Llama 3.1, 3.2, 3.3: the whole reply is `[<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]*`."""

from __future__ import annotations

import json
from typing import Any, Literal

from gateway.tool_decoders import ParsedToolCall, Schemas, json_call
from gateway.tool_formats.base import GrammarShape, ToolFormat, json_call_tag, quoted

PYTHON_TAG = "<|python_tag|>"


class Scanner:
    """The calls are the whole reply, so not a block between markers: a reply that starts (after whitespace)
    with `{` or the python tag is held back until the end, because only the complete text tells a tool call
    from a JSON answer; any other reply streams."""

    def __init__(self, schemas: Schemas | None = None) -> None:
        self.calls: list[ParsedToolCall] = []
        self._buf = ""
        self._mode: Literal["undecided", "text", "held"] = "undecided"

    def feed(self, text: str) -> str:
        if self._mode == "text":
            return text
        self._buf += text
        if self._mode == "held":
            return ""
        head = self._buf.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return ""
        if head.startswith(("{", PYTHON_TAG)):
            self._mode = "held"
            return ""
        self._mode, out, self._buf = "text", self._buf, ""
        return out

    def flush(self) -> str:
        rest, self._buf = self._buf, ""
        calls = decode(rest) if self._mode == "held" else None
        if calls is None:
            return rest
        self.calls.extend(calls)
        return ""


def decode(text: str) -> list[ParsedToolCall] | None:
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):].lstrip()
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    pos = 0
    while pos < len(s):
        try:
            obj, pos = decoder.raw_decode(s, pos)
        except json.JSONDecodeError:
            return None
        call = json_call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = s[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        pos = len(s) - len(rest)
    return calls or None


def _call(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return json_call_tag(f'{{"name": {quoted(name)}, "parameters": ', params, "}")


FORMAT = ToolFormat(
    name="llama3_json",
    families="Llama 3.1, 3.2, 3.3",
    example='the whole reply `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several '
            "joined by `;`",
    signs=((PYTHON_TAG,), ('"parameters"', "<|eot_id|>")),
    scanner=Scanner,
    grammar=GrammarShape(_call, "; "),
    aliases=("llama3",),
)
