"""Split a model's reply text into reasoning, content and tool calls, whole or while it streams.

The text is the decoded completion with special tokens kept (`<think>`, `<tool_call>` and
`<|python_tag|>` are special tokens in most vocabularies, so `skip_special_tokens=True` would erase the
markers) and the final stop token dropped.

One incremental scanner per tool-call format (gateway.tool_formats) serves both paths: `parse_reply`
feeds it the whole text at once, `StreamingReplyParser` feeds it deltas. The streamed deltas are therefore
a prefix of the final parse by construction, and text that ends up inside a tool call is never streamed
as content. Reasoning is a block at the start of the reply between the reasoning format's markers
(`<think>`/`</think>`, Magistral's `[THINK]`/`[/THINK]`); a generation prompt that already opened it
(DeepSeek-R1, a thinking DeepSeek V3.1) makes the reply start inside it (`in_reasoning`). gpt-oss's
harmony format is channels rather than markers and has its own parser (gateway.harmony), chosen by
`reply_parser` when the tool or reasoning format has one (`ToolFormat.reply_parser`).

Normalisation (the same on both paths): reasoning and content are stripped of surrounding whitespace;
content is `None` when it is empty and there are tool calls, else a string. A malformed tool call
(bad JSON, no name, unclosed block) stays content; the parsers never raise on model output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from gateway.tool_decoders import ParsedToolCall, tool_schemas
from gateway.tool_formats import (
    THINK,
    ReasoningFormat,
    ToolFormat,
    get_reasoning_format,
    get_tool_format,
)
from gateway.tool_scanners import (
    Delta,
    NoToolsScanner,
    ParsedReply,
    ReplyParser,
    Stripper,
    partial_marker_len,
)

__all__ = ["ParsedReply", "ParsedToolCall", "ReasoningParser", "ReplyParser", "StreamingReplyParser", "ToolParser",
           "get_reasoning_parser", "get_tool_parser", "parse_reply", "reply_parser"]


ToolParser = ToolFormat
"""A tool-call format (gateway.tool_formats): the parsers read its scanner and, for harmony, its reply parser."""
ReasoningParser = ReasoningFormat

NO_TOOLS = ToolFormat("none", "", "", (), scanner=NoToolsScanner)
get_tool_parser = get_tool_format
get_reasoning_parser = get_reasoning_format


# --- reasoning + content ----------------------------------------------------------------------------


class StreamingReplyParser:
    """Feed reply text deltas; get the reasoning/content deltas that are safe to show now.

    Held back: text that may still become a marker (`<think>`, `</think>`, `<tool_call>`, the python
    tag, a leading `{` for llama3_json, ...), an open tool-call block, and trailing whitespace. `finish()`
    returns the final parse; every field's emitted deltas, concatenated, are a prefix of that field
    there, and the caller sends the rest (`final.content[len(emitted):]`).

    `in_reasoning=True` is for templates whose generation prompt already opened `<think>` (the reply
    then starts inside the reasoning and only closes it).
    """

    def __init__(
        self, tool_parser: ToolParser | None, reasoning: bool | ReasoningParser | None = True, *,
        in_reasoning: bool = False, tools: Sequence[Any] | None = None,
    ) -> None:
        """`reasoning`: the reasoning format (True: `<think>`; False or None: no reasoning split);
        `tools`: the request's tools (XML formats read argument types from their schemas)."""
        self._scanner = (tool_parser or NO_TOOLS).new_scanner(tool_schemas(tools))
        markers = THINK if reasoning is True else reasoning or None
        self._open, self._close = (markers.open, markers.close) if markers else ("", "")
        self._phase: Literal["start", "reasoning", "content"] = (
            "reasoning" if reasoning and in_reasoning else "start" if reasoning else "content"
        )
        self._saw_think = self._phase == "reasoning"
        self._buf = ""  # undecided text of the start and reasoning phases
        self._reasoning = Stripper()
        self._content = Stripper()
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
            if not head or (self._open.startswith(head) and head != self._open):
                return out
            if head.startswith(self._open):
                self._phase, self._saw_think = "reasoning", True
                self._buf = head[len(self._open) :]
            else:
                self._phase, rest, self._buf = "content", self._buf, ""
                self._emit_content(self._scanner.feed(rest), out)
                return out
        end = self._buf.find(self._close)
        if end >= 0:
            self._emit_reasoning(self._buf[:end], out)
            self._phase, rest, self._buf = "content", self._buf[end + len(self._close) :], ""
            self._emit_content(self._scanner.feed(rest), out)
        else:
            keep = partial_marker_len(self._buf, self._close)
            self._emit_reasoning(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
        return out

    def finish(self) -> ParsedReply:
        """The final parse of everything fed (idempotent)."""
        if self._finished is not None:
            return self._finished
        if self._phase == "reasoning":  # never closed: the whole rest was reasoning
            self._reasoning.push(self._buf)
        elif self._phase == "start":  # only whitespace or part of the opening marker: that is content
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


def reply_parser(
    tool_parser: ToolParser | None, reasoning: bool | ReasoningParser | None, *, in_reasoning: bool = False,
    tools: Sequence[Any] | None = None,
) -> ReplyParser:
    """A fresh parser for one reply; `tool_parser=None` parses no tool calls (no tools were offered)."""
    whole = tool_parser.reply_parser if tool_parser is not None else None
    if whole is None and isinstance(reasoning, ReasoningFormat):
        whole = reasoning.reply_parser
    if whole is not None:  # channels rather than markers (harmony): its own parser reads the whole reply
        return whole(tool_parser is not None)
    return StreamingReplyParser(tool_parser, reasoning, in_reasoning=in_reasoning, tools=tools)


def parse_reply(
    text: str, tool_parser: ToolParser | None, *, reasoning: bool | ReasoningParser | None = True,
    in_reasoning: bool = False, tools: Sequence[Any] | None = None,
) -> ParsedReply:
    """The whole reply at once; `tool_parser=None` parses no tool calls (no tools were offered)."""
    parser = reply_parser(tool_parser, reasoning, in_reasoning=in_reasoning, tools=tools)
    parser.feed(text)
    return parser.finish()
