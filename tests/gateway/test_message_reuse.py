"""A replayed history is validated and converted once (gateway/routes/message_reuse.py), with the same results and
the same errors as validating every message."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.protocol import ChatCompletionRequest
from gateway.routes.common import check_json_shape, parse_body
from gateway.routes.message_reuse import MIN_MESSAGES, MessageReuse
from gateway.routes.openai_api import chat_turn_request, message_dict


def _history(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Go."}]
    for t in range(turns):
        out.append({"role": "assistant", "content": None, "tool_calls": [  # no id: the conversion names it by index
            {"type": "function", "function": {"name": "run", "arguments": json.dumps({"cmd": f"ls {t}"})}}]})
        out.append({"role": "tool", "content": f"output {t}", "tool_call_id": f"call_{2 * t + 2}_0"})
    return out


def _parse(reuse: MessageReuse | None, body: dict[str, Any]) -> ChatCompletionRequest:
    keys = None

    def swap(data: dict[str, Any]) -> None:
        nonlocal keys
        if reuse is not None:
            keys = reuse.swap(data)

    parsed = parse_body(orjson.dumps(body), ChatCompletionRequest, swap)
    if reuse is not None and keys is not None:
        reuse.keep(keys, parsed.messages)
    return parsed


def _messages(reuse: MessageReuse | None, parsed: ChatCompletionRequest) -> list[dict[str, Any]]:
    if reuse is None:
        return chat_turn_request(parsed).messages
    return [reuse.converted(m, i, message_dict) for i, m in enumerate(parsed.messages)]


def test_a_replayed_history_is_validated_once_with_the_same_results() -> None:
    reuse = MessageReuse()
    history = _history(10)
    first = _parse(reuse, {"messages": history, "model": "m"})
    assert _messages(reuse, first) == _messages(None, _parse(None, {"messages": history, "model": "m"}))
    longer = [*history, {"role": "assistant", "content": "done"}, {"role": "user", "content": "again"}]
    second = _parse(reuse, {"messages": longer, "model": "m"})
    # every message of the first call is the model validated then; the new ones are validated now
    assert all(a is b for a, b in zip(first.messages, second.messages, strict=False))
    assert _messages(reuse, second) == _messages(None, _parse(None, {"messages": longer, "model": "m"}))
    # converted once per index: the same dicts again
    assert all(a is b for a, b in zip(_messages(reuse, first), _messages(reuse, second), strict=False))
    # the same message at another index gets that index's default tool-call id
    shifted = [{"role": "user", "content": "first"}, *history]
    got = _messages(reuse, _parse(reuse, {"messages": shifted, "model": "m"}))
    assert got == _messages(None, _parse(None, {"messages": shifted, "model": "m"}))
    assert got[3]["tool_calls"][0]["id"] == "call_3_0"


@pytest.mark.parametrize("bad", [
    {"role": "robot", "content": "x"},
    {"role": "user", "content": 5},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
])
def test_a_bad_message_after_reused_ones_is_refused_as_before(bad: dict[str, Any]) -> None:
    reuse = MessageReuse()
    history = _history(6)
    _parse(reuse, {"messages": history})
    body = {"messages": [*history, bad]}

    def outcome(r: MessageReuse | None) -> tuple[str | None, str | None]:
        try:
            _messages(r, _parse(r, body))
        except BadRequest as e:
            return str(e), e.param
        return None, None

    assert outcome(reuse) == outcome(None) != (None, None)


def test_short_calls_are_left_alone_and_memory_is_bounded() -> None:
    reuse = MessageReuse(max_bytes=2000)
    assert reuse.swap({"messages": _history(1)[: MIN_MESSAGES - 1]}) is None
    for n in range(10, 40):
        _parse(reuse, {"messages": _history(n)})
    assert reuse._bytes <= 2000
    assert len(reuse._dicts) == len(reuse._models)


@pytest.mark.parametrize("extra", [
    {},
    {"metadata": {"a": [[[[1]]]]}},
    {"metadata": {"k\u0000": 1}},
    {"metadata": ["x\u0000"]},
    {"metadata": json.loads("[" * 200 + "]" * 200)},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 200 + "]" * 200}}]}]},
    {"messages": [{"role": "user", "content": "[" * 300}]},  # brackets in a string nest nothing
])
def test_walking_without_the_byte_scans_refuses_the_same_bodies(extra: dict[str, Any]) -> None:
    """`check_json_shape(walk=True)` (a body whose replayed messages were handed over as models) answers as
    the scans and the walk do."""
    body = {"model": "m", **extra}
    raw = orjson.dumps(body)

    def outcome(walk: bool) -> str | None:
        try:
            check_json_shape(raw, orjson.loads(raw), walk=walk)
        except BadRequest as e:
            return str(e)
        return None

    assert outcome(True) == outcome(False)
