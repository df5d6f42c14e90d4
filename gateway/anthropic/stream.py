"""Streamed Messages: Anthropic's event sequence as a `StreamFormat` of the one streaming core
(`routes.streaming.stream_turn`), which generates, parses and stores the turn as for every streamed route.

    message_start, ping,
    per block: content_block_start, content_block_delta (thinking_delta then signature_delta; text_delta;
               input_json_delta), content_block_stop,
    message_delta (stop_reason, stop_sequence, usage), message_stop;
    after the answer started, a failure is an `error` event.

Thinking and text arrive as the reply grows; a block closes when the other kind starts. Tool calls are
known once the reply is whole (the parsers hold their markup back), so their tool_use blocks come at the end,
with the stored turn's call ids and each call's arguments as one input_json_delta.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.anthropic.translate import context_cut, sign_thinking, stop_reason, usage
from gateway.errors import GatewayError, anthropic_error
from gateway.generation import Generation
from gateway.tool_parsers import ParsedReply
from gateway.turn_types import FinishedTurn, PreparedTurn


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageEvents:
    """One streamed Messages reply (see the module docstring)."""

    def __init__(self, prepared: PreparedTurn, *, model: str, key: bytes, omit_thinking: bool,
                 context_management: dict[str, Any] | None = None) -> None:
        self.prepared = prepared
        self.context_management = context_management
        """Sent on message_delta (the request's context edits), as Anthropic's API sends it."""
        self.model = model
        self.key = key
        self.omit_thinking = omit_thinking
        self.index = -1
        self.open: str | None = None
        """The kind of the open block ("thinking" or "text"), None between blocks."""
        self.thinking: list[str] = []

    def start(self, gen: Generation) -> list[bytes]:
        message: dict[str, Any] = {"id": self.prepared.turn_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(len(self.prepared.prompt_ids), 0, gen.cached_tokens)}
        return [event("message_start", {"type": "message_start", "message": message}), event("ping", {"type": "ping"})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _begin(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.open = block["type"]
        return event("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": block})

    def _close(self) -> list[bytes]:
        out = []
        if self.open == "thinking":
            text = "" if self.omit_thinking else "".join(self.thinking)
            out.append(self._delta({"type": "signature_delta",
                                    "signature": sign_thinking(self.key, self.prepared.turn_id, text)}))
            self.thinking = []
        if self.open is not None:
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def text(self, kind: str, piece: str, span: Any) -> list[bytes]:
        if not piece:
            return []
        want = "thinking" if kind == "reasoning_content" else "text"
        out = []
        if self.open != want:
            out += self._close()
            out.append(self._begin({"type": "thinking", "thinking": "", "signature": ""} if want == "thinking"
                                   else {"type": "text", "text": ""}))
        if want == "text":
            out.append(self._delta({"type": "text_delta", "text": piece}))
        else:
            self.thinking.append(piece)
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": piece}))
        return out

    def tokens(self, span: Any) -> list[bytes]:
        return []

    def end(self, done: FinishedTurn, final: ParsedReply, gen: Generation) -> list[bytes]:
        out = self._close()
        for call in done.parsed.tool_calls:  # the stored turn's ids: the ones a tool_result will name
            out.append(self._begin({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}))
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            out += self._close()
        reason, sequence = stop_reason(done.finish_reason, gen, self.prepared.req.stop, context_cut(self.prepared))
        delta: dict[str, Any] = {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(len(self.prepared.prompt_ids), len(gen.ids), gen.cached_tokens)}
        if self.context_management is not None:
            delta["context_management"] = self.context_management
        out.append(event("message_delta", delta))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    def error(self, exc: GatewayError) -> list[bytes]:
        return [event("error", anthropic_error(exc.status, exc.message)[1])]
