"""Split a model's reply text into reasoning, content and tool calls, whole or while it streams.

The text is the decoded completion with special tokens kept (`<think>`, `<tool_call>` and
`<|python_tag|>` are special tokens in most vocabularies, so `skip_special_tokens=True` would erase the
markers) and the final stop token dropped.

One incremental scanner per tool-call format serves both paths: `parse_reply` feeds it the whole text
at once, `StreamingReplyParser` feeds it deltas. The streamed deltas are therefore a prefix of the final
parse by construction, and text that ends up inside a tool call is never streamed as content.

Normalisation (the same on both paths): reasoning and content are stripped of surrounding whitespace;
content is `None` when it is empty and there are tool calls, else a string. A malformed tool call
(bad JSON, no name, unclosed block) stays content; the parsers never raise on model output.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

DeltaKind = Literal["reasoning_content", "content"]
Delta = tuple[DeltaKind, str]


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str
    """A JSON object as text (json.dumps of the parsed arguments, ensure_ascii=False)."""


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _tool_call(obj: Any, arg_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """A call from a decoded JSON value, or None when it is not one (then it stays text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if args is None:
        args = {}
    elif isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# --- tool-call scanners ------------------------------------------------------------------------------


class ToolCallScanner(Protocol):
    """Consumes content text in order; returns the text now known to be content (not a tool call)."""

    calls: list[ParsedToolCall]

    def feed(self, text: str) -> str: ...

    def flush(self) -> str: ...


class _NoToolsScanner:
    """Everything is content (no tools offered, or tool_choice "none")."""

    def __init__(self) -> None:
        self.calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> str:
        return text

    def flush(self) -> str:
        return ""


class HermesScanner:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks anywhere in the reply."""

    def __init__(self) -> None:
        self.calls: list[ParsedToolCall] = []
        self._buf = ""  # undecided text: a partial opening marker, or an open block
        self._in_block = False
        self._search = len(HERMES_OPEN)  # where to look for the closing marker of an open block

    def feed(self, text: str) -> str:
        self._buf += text
        out: list[str] = []
        while True:
            if self._in_block:
                end = self._buf.find(HERMES_CLOSE, self._search)
                if end < 0:
                    self._search = max(len(HERMES_OPEN), len(self._buf) - len(HERMES_CLOSE) + 1)
                    break
                block = self._buf[: end + len(HERMES_CLOSE)]
                self._buf, self._in_block = self._buf[len(block) :], False
                call = self._decode(block[len(HERMES_OPEN) : end])
                if call is None:
                    out.append(block)
                else:
                    self.calls.append(call)
            else:
                start = self._buf.find(HERMES_OPEN)
                if start < 0:
                    keep = _partial_marker_len(self._buf, HERMES_OPEN)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.append(self._buf[:start])
                self._buf, self._in_block, self._search = self._buf[start:], True, len(HERMES_OPEN)
        return "".join(out)

    def flush(self) -> str:
        rest, self._buf, self._in_block = self._buf, "", False
        return rest

    @staticmethod
    def _decode(inner: str) -> ParsedToolCall | None:
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError:
            return None
        return _tool_call(obj, ("arguments", "parameters"))


class Llama3JsonScanner:
    """Llama 3.1 JSON calls: the whole reply is `[<|python_tag|>]{"name", "parameters"}[; {...}]*`.

    A reply that starts (after whitespace) with `{` or the python tag is held back until the end,
    because only the complete text tells a tool call from a JSON answer; any other reply streams.
    """

    def __init__(self) -> None:
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
            s = s[len(PYTHON_TAG) :].lstrip()
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(s):
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except json.JSONDecodeError:
                return None
            call = _tool_call(obj, ("parameters", "arguments"))
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


@dataclass(frozen=True, slots=True)
class ToolParser:
    """A tool-call format: its name and a factory of fresh scanners (one per reply)."""

    name: str
    new_scanner: Callable[[], ToolCallScanner]


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", HermesScanner),
    "llama3_json": ToolParser("llama3_json", Llama3JsonScanner),
}
NO_TOOLS = ToolParser("none", _NoToolsScanner)


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


# --- reasoning + content ----------------------------------------------------------------------------


class _Stripper:
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
        self.pending = text[len(core) :]
        if core:
            self.emitted.append(core)
        return core

    def value(self) -> str:
        return "".join(self.emitted)


class StreamingReplyParser:
    """Feed reply text deltas; get the reasoning/content deltas that are safe to show now.

    Held back: text that may still become a marker (`<think>`, `</think>`, `<tool_call>`, the python
    tag, a leading `{` for llama3_json), an open tool-call block, and trailing whitespace. `finish()`
    returns the final parse; every field's emitted deltas, concatenated, are a prefix of that field
    there, and the caller sends the rest (`final.content[len(emitted):]`).

    `in_reasoning=True` is for templates whose generation prompt already opened `<think>` (the reply
    then starts inside the reasoning and only closes it).
    """

    def __init__(
        self, tool_parser: ToolParser | None, reasoning: bool = True, *, in_reasoning: bool = False
    ) -> None:
        self._scanner = (tool_parser or NO_TOOLS).new_scanner()
        self._phase: Literal["start", "reasoning", "content"] = (
            "reasoning" if reasoning and in_reasoning else "start" if reasoning else "content"
        )
        self._saw_think = self._phase == "reasoning"
        self._buf = ""  # undecided text of the start and reasoning phases
        self._reasoning = _Stripper()
        self._content = _Stripper()
        self._finished: ParsedReply | None = None

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        """Calls complete so far (hermes finds them mid-stream; llama3_json only at the end)."""
        return self._scanner.calls

    def feed(self, delta_text: str) -> list[Delta]:
        if self._finished is not None:
            raise RuntimeError("feed() after finish()")
        out: list[Delta] = []
        if self._phase == "content":
            self._emit_content(self._scanner.feed(delta_text), out)
            return out
        self._buf += delta_text
        if self._phase == "start":
            head = self._buf.lstrip()
            if not head or (THINK_OPEN.startswith(head) and head != THINK_OPEN):
                return out
            if head.startswith(THINK_OPEN):
                self._phase, self._saw_think = "reasoning", True
                self._buf = head[len(THINK_OPEN) :]
            else:
                self._phase, rest, self._buf = "content", self._buf, ""
                self._emit_content(self._scanner.feed(rest), out)
                return out
        end = self._buf.find(THINK_CLOSE)
        if end >= 0:
            self._emit_reasoning(self._buf[:end], out)
            self._phase, rest, self._buf = "content", self._buf[end + len(THINK_CLOSE) :], ""
            self._emit_content(self._scanner.feed(rest), out)
        else:
            keep = _partial_marker_len(self._buf, THINK_CLOSE)
            self._emit_reasoning(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
        return out

    def finish(self) -> ParsedReply:
        """The final parse of everything fed (idempotent)."""
        if self._finished is not None:
            return self._finished
        if self._phase == "reasoning":  # never closed: the whole rest was reasoning
            self._reasoning.push(self._buf)
        elif self._phase == "start":  # only whitespace or part of "<think>": that is content
            self._content.push(self._scanner.feed(self._buf))
        self._buf = ""
        self._content.push(self._scanner.flush())
        calls = list(self._scanner.calls)
        content: str | None = self._content.value()
        if not content and calls:
            content = None
        reasoning = self._reasoning.value() if self._saw_think else None
        self._finished = ParsedReply(content, reasoning or None, calls)
        return self._finished

    def _emit_reasoning(self, text: str, out: list[Delta]) -> None:
        piece = self._reasoning.push(text)
        if piece:
            out.append(("reasoning_content", piece))

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        piece = self._content.push(text)
        if piece:
            out.append(("content", piece))


def parse_reply(
    text: str, tool_parser: ToolParser | None, *, reasoning: bool = True, in_reasoning: bool = False
) -> ParsedReply:
    """The whole reply at once; `tool_parser=None` parses no tool calls (no tools were offered)."""
    parser = StreamingReplyParser(tool_parser, reasoning, in_reasoning=in_reasoning)
    parser.feed(text)
    return parser.finish()
