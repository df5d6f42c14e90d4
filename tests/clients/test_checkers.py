"""The checkers the client tests rely on fail when they should: the Anthropic event grammar, and the
proxy's reading of a /generate stream (incremental and cumulative chunks)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import TypeAdapter

from tests.clients.anthropic_events import fold_events
from tests.clients.proxy import last_sse_state


def _events(raw: list[dict[str, Any]]) -> list[Any]:
    from anthropic.types import RawMessageStreamEvent

    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    return [SimpleNamespace(type="ping") if e["type"] == "ping" else adapter.validate_python(e) for e in raw]


USAGE = {"input_tokens": 5, "output_tokens": 0}
START = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                                              "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": USAGE}}
END = [{"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 7}}, {"type": "message_stop"}]
THINK = [{"type": "content_block_start", "index": 0,
          "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
         {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}},
         {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}},
         {"type": "content_block_stop", "index": 0}]
TOOL = [{"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "calculate", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"a": '}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "1}"}},
        {"type": "content_block_stop", "index": 1}]


def test_fold_events_builds_the_message() -> None:
    folded = fold_events(_events([START, {"type": "ping"}, *THINK, *TOOL, *END]))
    assert folded["content"] == [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                 {"type": "tool_use", "id": "toolu_1", "name": "calculate", "input": {"a": 1}}]
    assert folded["stop_reason"] == "tool_use" and folded["output_tokens"] == 7


@pytest.mark.parametrize("broken", [
    [START, *TOOL, *THINK, *END],                           # blocks out of index order
    [START, *THINK[:-1], *TOOL, *END],                      # a block never stopped before the next
    [START, *THINK, *TOOL[:2], *END],                       # the last block never stopped
    [START, *THINK, *TOOL, END[1]],                         # no message_delta
    [*THINK, *TOOL, *END],                                  # no message_start
    [START, THINK[0], {**TOOL[1], "index": 0}, THINK[3], *END],  # a delta of another block's kind
])
def test_fold_events_refuses_a_broken_sequence(broken: list[dict[str, Any]]) -> None:
    with pytest.raises(AssertionError):
        fold_events(_events(broken))


def _sse(chunks: list[tuple[list[int], int, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps({"output_ids": ids, "meta_info": {"completion_tokens": n,
                                            "finish_reason": finish}}).encode() + b"\n\n"
                    for ids, n, finish in chunks) + b"data: [DONE]\n\n"


def test_last_sse_state_incremental_and_cumulative() -> None:
    stop = {"type": "stop"}
    assert last_sse_state(_sse([([1, 2], 2, None), ([3], 3, None), ([], 3, stop)])) == ([1, 2, 3], stop)
    assert last_sse_state(_sse([([1, 2], 2, None), ([1, 2, 3], 3, stop)])) == ([1, 2, 3], stop)
