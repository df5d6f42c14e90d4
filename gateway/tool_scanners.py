"""Incremental scanners that find tool calls in a reply's content text while it streams, one per format.

Every format but Llama 3's is a block between an opening marker and a closing one (or the end of the reply);
`BlockScanner` finds the blocks, holding back a partial marker or an open block, and the format's decoder
(`gateway.tool_decoders`, which lists the formats) turns a block's inside into calls. Llama 3's calls are
the whole reply (`Llama3JsonScanner`). `SCANNERS` names them for `--tool-parser`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.tool_decoders import (
    Decoder,
    ParsedToolCall,
    Schemas,
    decode_deepseek,
    decode_glm45,
    decode_hermes,
    decode_json_list,
    decode_kimi_k2,
    decode_mistral,
    decode_qwen3_coder,
    json_call,
    mistral_call_id,
    new_call_id,
)

PYTHON_TAG = "<|python_tag|>"

DeltaKind = Literal["reasoning_content", "content"]
Delta = tuple[DeltaKind, str]
"""A piece of a streamed reply and the field it belongs to."""


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class Stripper:
    """Streams a text with its surrounding whitespace removed: drops leading whitespace, holds trailing
    whitespace until more text follows it (so the stream stays a prefix of `full.strip()`)."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""
        self.emitted: list[str] = []

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        core = text.rstrip()
        self.pending = text[len(core):]
        if core:
            self.emitted.append(core)
        return core

    def value(self) -> str:
        return "".join(self.emitted)



def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0



# --- scanners -------------------------------------------------------------------------------------------


class ToolCallScanner(Protocol):
    """Consumes content text in order; returns the text now known to be content (not a tool call)."""

    calls: list[ParsedToolCall]

    def feed(self, text: str) -> str: ...

    def flush(self) -> str: ...


class NoToolsScanner:
    """Everything is content (no tools offered, or tool_choice "none")."""

    def __init__(self, schemas: Schemas | None = None) -> None:
        self.calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> str:
        return text

    def flush(self) -> str:
        return ""


class BlockScanner:
    """Blocks `open ... close` anywhere in the reply (`close=None`: the block runs to the end of the reply,
    decoded when it ends). Text before, between and after blocks is content, as is a block that does not
    decode; a partial opening marker at the end of what came so far is held back."""

    def __init__(self, open_: str, close: str | None, decode: Decoder, schemas: Schemas,
                 new_id: Callable[[], str] = new_call_id, *, close_optional: bool = False) -> None:
        """`close_optional`: a block still open when the reply ends is decoded too (DeepSeek-R1's template
        writes no `<｜tool▁calls▁end｜>` after a single call, and models trained on it may not either)."""
        self.calls: list[ParsedToolCall] = []
        self._open, self._close, self._decode, self._schemas = open_, close, decode, schemas
        self._new_id = new_id
        self._close_optional = close_optional
        self._buf = ""  # undecided text: a partial opening marker, or an open block
        self._in_block = False
        self._search = len(open_)  # where to look for the closing marker of an open block

    def feed(self, text: str) -> str:
        self._buf += text
        out: list[str] = []
        while True:
            if self._in_block:
                if self._close is None:
                    break
                end = self._buf.find(self._close, self._search)
                if end < 0:
                    self._search = max(len(self._open), len(self._buf) - len(self._close) + 1)
                    break
                block = self._buf[: end + len(self._close)]
                self._buf, self._in_block = self._buf[len(block):], False
                self._take(block, block[len(self._open): end], out)
            else:
                start = self._buf.find(self._open)
                if start < 0:
                    keep = partial_marker_len(self._buf, self._open)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.append(self._buf[:start])
                self._buf, self._in_block, self._search = self._buf[start:], True, len(self._open)
        return "".join(out)

    def flush(self) -> str:
        rest, self._buf = self._buf, ""
        if self._in_block and (self._close is None or self._close_optional):
            self._in_block = False
            out: list[str] = []
            self._take(rest, rest[len(self._open):], out)
            return "".join(out)
        self._in_block = False
        return rest

    def _take(self, block: str, inner: str, out: list[str]) -> None:
        calls = self._decode(inner, self._schemas)
        if calls is None:
            out.append(block)
            return
        if self._new_id is not new_call_id:
            for call in calls:
                call.id = self._new_id()
        self.calls.extend(calls)


class Llama3JsonScanner:
    """Llama 3.x JSON calls: the whole reply is `[<|python_tag|>]{"name", "parameters"}[; {...}]*`.

    A reply that starts (after whitespace) with `{` or the python tag is held back until the end,
    because only the complete text tells a tool call from a JSON answer; any other reply streams.
    """

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
        calls = self._decode(rest) if self._mode == "held" else None
        if calls is None:
            return rest
        self.calls.extend(calls)
        return ""

    @staticmethod
    def _decode(text: str) -> list[ParsedToolCall] | None:
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


def block_format(
    open_: str, close: str | None, decode: Decoder, new_id: Callable[[], str] = new_call_id, *,
    close_optional: bool = False,
) -> Callable[[Schemas], ToolCallScanner]:
    return lambda schemas: BlockScanner(open_, close, decode, schemas, new_id, close_optional=close_optional)


SCANNERS: dict[str, Callable[[Schemas], ToolCallScanner]] = {
    "hermes": block_format("<tool_call>", "</tool_call>", decode_hermes),
    "qwen3_coder": block_format("<tool_call>", "</tool_call>", decode_qwen3_coder),
    "glm45": block_format("<tool_call>", "</tool_call>", decode_glm45),
    "kimi_k2": block_format("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", decode_kimi_k2),
    "deepseek": block_format("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", decode_deepseek, close_optional=True),
    "mistral": block_format("[TOOL_CALLS]", None, decode_mistral, mistral_call_id),
    "granite": block_format("<|tool_call|>", None, decode_json_list),
    "llama3_json": Llama3JsonScanner,
}
"""Tool-call format name -> a factory of fresh scanners (one per reply), given the request's tool schemas."""
