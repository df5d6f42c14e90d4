"""The streaming machinery the tool-call formats share (gateway.tool_formats holds the formats, one module each).

Most formats are a block between an opening marker and a closing one (or the end of the reply):
`BlockScanner` finds the blocks while the reply streams, holding back a partial marker or an open block, and
the format's decoder turns a block's inside into calls. A format that is not a block has a scanner of its own
(Llama 3's calls are the whole reply: gateway.tool_formats.llama3_json).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.tool_decoders import Decoder, ParsedToolCall, Schemas, new_call_id

DeltaKind = Literal["reasoning_content", "content"]
Delta = tuple[DeltaKind, str]
"""A piece of a streamed reply and the field it belongs to."""


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ReplyParser(Protocol):
    """A reply's parser (gateway.tool_parsers' `StreamingReplyParser`, or harmony's): what the routes use."""

    @property
    def tool_calls(self) -> list[ParsedToolCall]: ...

    def feed(self, delta_text: str) -> list[Delta]: ...

    def finish(self) -> ParsedReply: ...


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
