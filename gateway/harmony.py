"""gpt-oss replies in OpenAI's harmony format: channels, not markers around a part of the text.

The generation prompt ends with `<|start|>assistant`, so a reply is a run of messages, each a header up to
`<|message|>` and a body up to `<|end|>` (the reply's last body ends where the reply ends: its stop token,
`<|return|>` or `<|call|>`, is dropped before parsing), the later ones after `<|start|>assistant`:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}

`analysis` is reasoning, `final` is content, a message whose header names a recipient `to=functions.NAME`
(before or after the channel) is a tool call with its body as the arguments, and `commentary` without a
recipient (a preamble the model shows the user) is content. Header text never reaches any field. Bodies
stream as they come; a tool call's arguments are complete only when its message ends.
"""

from __future__ import annotations

import re

from gateway.tool_decoders import call_from_args
from gateway.tool_scanners import (
    Delta,
    DeltaKind,
    ParsedReply,
    ParsedToolCall,
    Stripper,
    partial_marker_len,
)

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_STOPS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=(?:functions\.)?([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyReplyParser:
    """The harmony counterpart of `tool_parsers.StreamingReplyParser` (same feed/finish contract)."""

    def __init__(self, tools: bool) -> None:
        self._tools = tools
        self._buf = ""
        self._header: str | None = None  # the current message's header once `<|message|>` is seen
        self._body = ""  # the current tool call's arguments so far
        self._reasoning = Stripper()
        self._content = Stripper()
        self.calls: list[ParsedToolCall] = []
        self._finished: ParsedReply | None = None

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        return self.calls

    def feed(self, delta_text: str) -> list[Delta]:
        self._buf += delta_text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedReply:
        """The final parse of everything fed (idempotent)."""
        if self._finished is None:
            while self._step([], final=True):
                pass
            content = self._content.value()
            reasoning = self._reasoning.value()
            self._finished = ParsedReply(content or (None if self.calls else ""), reasoning or None, list(self.calls))
        return self._finished

    def _step(self, out: list[Delta], *, final: bool) -> bool:
        """Consume what can be decided now; True when it made progress."""
        if self._header is None:
            at = self._buf.find(MESSAGE)
            if at < 0:
                if final:
                    self._buf = ""  # a header cut off: nothing of it is shown
                return False
            self._header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE):]
            return True
        ends = [i for i in (self._buf.find(s) for s in (*_STOPS, START)) if i >= 0]
        if ends:
            at = min(ends)
            body, rest = self._buf[:at], self._buf[at:]
            for marker in (*_STOPS, START):
                if rest.startswith(marker):
                    rest = rest[len(marker):]
                    break
            self._emit(body, out, done=True)
            self._header, self._buf = None, rest
            return True
        if final:
            self._emit(self._buf, out, done=True)
            self._header, self._buf = None, ""
            return False
        keep = max(partial_marker_len(self._buf, m) for m in (*_STOPS, START))
        self._emit(self._buf[: len(self._buf) - keep], out, done=False)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _emit(self, text: str, out: list[Delta], *, done: bool) -> None:
        header = self._header or ""
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self._tools:
            self._body += text
            if done:
                body, self._body = self._body, ""
                call = call_from_args(recipient.group(1), body.strip() or None)
                if call is not None:
                    self.calls.append(call)
                else:  # not JSON arguments: the body stays content, as other formats keep a bad call
                    self._show("content", body + "\n", out)
            return
        channel = _CHANNEL.search(header)
        kind: DeltaKind = "reasoning_content" if channel is not None and channel.group(1) == "analysis" else "content"
        self._show(kind, text + ("\n" if done else ""), out)

    def _show(self, kind: DeltaKind, text: str, out: list[Delta]) -> None:
        """Messages of one kind are joined by a line break (trailing whitespace is held back, so it shows
        only between two)."""
        piece = (self._reasoning if kind == "reasoning_content" else self._content).push(text)
        if piece:
            out.append((kind, piece))
