"""Anthropic's streamed event grammar, checked event by event and folded into the message it describes."""

from __future__ import annotations

import json
from typing import Any

RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
              "message_delta", "message_stop", "ping"}
DELTA_OF_BLOCK = {"text_delta": "text", "input_json_delta": "tool_use", "thinking_delta": "thinking",
                  "signature_delta": "thinking"}


def fold_events(events: list[Any]) -> dict[str, Any]:
    """The message a stream of raw events builds, asserting the order Anthropic's API sends: message_start
    (empty content, no stop_reason), then each content block as start, its deltas (of the block's kind),
    stop, one at a time in index order, then one message_delta with the stop_reason, then message_stop.
    `ping` may come anywhere after message_start."""
    kinds = [e.type for e in events]
    assert set(kinds) <= RAW_EVENTS, kinds
    body = [e for e in events if e.type != "ping"]
    assert body and body[0].type == "message_start", kinds
    assert [e.type for e in body[-2:]] == ["message_delta", "message_stop"], kinds
    start = body[0].message
    assert start.role == "assistant" and start.type == "message" and start.content == []
    assert start.stop_reason is None
    blocks: list[dict[str, Any]] = []
    partial_json = ""
    open_index: int | None = None
    for e in body[1:-2]:
        if e.type == "content_block_start":
            assert open_index is None and e.index == len(blocks), (e.index, open_index, len(blocks))
            block = e.content_block.model_dump(exclude_none=True)
            if block["type"] == "tool_use":
                assert block["input"] == {}, block  # the input arrives as input_json_delta
                partial_json = ""
            blocks.append(block)
            open_index = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_index, (e.index, open_index)
            block, delta = blocks[e.index], e.delta
            assert DELTA_OF_BLOCK.get(delta.type) == block["type"], (delta.type, block["type"])
            if delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] = delta.signature
            else:
                partial_json += delta.partial_json
        else:
            assert e.type == "content_block_stop" and e.index == open_index, (e.type, e.index, open_index)
            if blocks[e.index]["type"] == "tool_use":
                blocks[e.index]["input"] = json.loads(partial_json)
            open_index = None
    assert open_index is None, "a content block was never stopped"
    end = body[-2]
    assert end.delta.stop_reason is not None
    return {"id": start.id, "content": blocks, "stop_reason": end.delta.stop_reason,
            "input_tokens": start.usage.input_tokens, "output_tokens": end.usage.output_tokens}
