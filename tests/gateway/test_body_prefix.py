"""A body that replays the session's previous one is decoded from its new bytes (gateway/routes/body_prefix.py),
with what decoding it whole gives; anything else is decoded whole, as before."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.continuity import ParentIndex, chain_digests, message_digest
from gateway.malloc_tuning import keep_heap_top
from gateway.protocol import ChatCompletionRequest
from gateway.routes.body_prefix import MAX_MISSES, BodyPrefixes, Decoded

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "required": ["cmd"]}}}]
SERIALISERS: dict[str, Callable[[Any], bytes]] = {
    "sdk": lambda b: json.dumps(b, ensure_ascii=False, separators=(",", ":")).encode(),  # httpx's, the openai SDK's
    "spaced": lambda b: json.dumps(b).encode(),  # ensure_ascii: non-ASCII as \\u escapes
    "orjson": orjson.dumps,
    "indented": lambda b: json.dumps(b, indent=2).encode(),
}


def _turn(t: int) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": f"step {t} ] [", "tool_calls": [
                {"id": f"c{t}", "type": "function", "function": {"name": "run", "arguments": '{"cmd": ["ls"]}'}}]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": "out ]]} [{ \"messages\": [ é 😀 " * t}]


def _body(messages: list[dict[str, Any]], t: int, model_first: bool) -> dict[str, Any]:
    rest = {"tools": TOOLS, "temperature": 0.7 if t % 4 else 0.5, "max_tokens": 64}
    return {"model": "tiny", "messages": messages, **rest} if model_first else {"messages": messages, **rest}


def _same(decoded: Decoded, raw: bytes) -> None:
    whole = orjson.loads(raw)
    data = decoded.data
    assert list(data) == list(whole)
    assert all(orjson.dumps(data[k]) == orjson.dumps(whole[k]) for k in whole if k != "messages")
    assert len(data["messages"]) == len(whole["messages"])
    assert data["messages"][decoded.reused:] == whole["messages"][decoded.reused:]
    kept = [m.model_dump(exclude_unset=True) for m in data["messages"][:decoded.reused]]
    validated = ChatCompletionRequest.model_validate({"messages": whole["messages"][:decoded.reused], "model": "m"})
    assert kept == [m.model_dump(exclude_unset=True) for m in validated.messages]
    assert raw[decoded.end:decoded.end + 1] == b"]"


def _session(prefixes: BodyPrefixes, dumps: Callable[[Any], bytes], model_first: bool, turns: int = 12,
             session: str = "s") -> int:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    hits = 0
    for t in range(turns):
        messages += _turn(t)
        raw = dumps(_body(messages, t, model_first))
        decoded = prefixes.decode(session, raw)
        if decoded is not None:
            _same(decoded, raw)
            hits += 1
        data = decoded.data if decoded is not None else orjson.loads(raw)
        body = ChatCompletionRequest.model_validate(data)
        prefixes.keep(session, raw, data, body.messages, decoded)
    return hits


@pytest.mark.parametrize("model_first", [False, True])
@pytest.mark.parametrize("name", sorted(SERIALISERS))
def test_a_replayed_body_decodes_from_its_tail_as_it_would_whole(name: str, model_first: bool) -> None:
    # turns 0-1 have fewer than MIN_MESSAGES messages; turn 2 is decoded whole and kept; every later one is a hit
    assert _session(BodyPrefixes(), SERIALISERS[name], model_first) == 9


def _kept_prefix() -> tuple[BodyPrefixes, bytes]:
    prefixes = BodyPrefixes()
    _session(prefixes, SERIALISERS["sdk"], True, turns=5)
    kept = prefixes._kept["s"]
    assert kept.raw is not None
    return prefixes, kept.raw[:kept.end]


NEW = b',{"role":"user","content":"x"}'


@pytest.mark.parametrize("tail", [
    NEW + b'],"messages":[{"role":"user","content":"y"}],"model":"m"}',  # a later messages key wins
    NEW + b'],"model":"m","\\u006dessages":[]}',  # the same, escaped
    NEW + b'],"model":"m","messages":["',  # not JSON
    b',],"model":"m"}',  # a trailing comma
    NEW + b']',  # the object left open
    NEW + b'],"model":"m"}}',  # one brace too many
    NEW,  # cut short
])
def test_tails_that_are_not_plain_continuations_are_decoded_whole(tail: bytes) -> None:
    prefixes, head = _kept_prefix()
    raw = head + tail
    decoded = prefixes.decode("s", raw)
    assert decoded is None


@pytest.mark.parametrize("tail", [
    b'],"model":"m"}',  # no new message
    NEW + b'],"model":["tiny"],"tools":[]}',  # a key of the part before the messages again (a later one wins)
    NEW + b' ] , "model" : "m" , "n" : [ 1 , [ 2 ] ] }',
])
def test_other_continuations_decode_as_whole(tail: bytes) -> None:
    prefixes, head = _kept_prefix()
    raw = head + tail
    decoded = prefixes.decode("s", raw)
    assert decoded is not None
    _same(decoded, raw)


def test_a_client_that_re_serialises_is_no_longer_looked_at_and_memory_is_bounded() -> None:
    prefixes = BodyPrefixes()
    flip = [SERIALISERS["sdk"], SERIALISERS["spaced"]]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    for t in range(10):
        messages += _turn(t)
        raw = flip[t % 2](_body(messages, t, True))
        assert prefixes.decode("s", raw) is None  # never the same bytes
        data = orjson.loads(raw)
        prefixes.keep("s", raw, data, ChatCompletionRequest.model_validate(data).messages, None)
    kept = prefixes._kept["s"]
    assert kept.misses >= MAX_MISSES and kept.raw is None and prefixes._bytes == 0
    small = BodyPrefixes(max_bytes=4_000)
    for s in range(5):
        _session(small, SERIALISERS["sdk"], True, turns=6, session=f"s{s}")
    assert 0 < small._bytes <= 4_000 and 0 < len(small._kept) < 5


def test_digests_of_the_same_leading_objects_are_reused_with_the_same_results() -> None:
    index = ParentIndex()
    history: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    for t in range(6):
        history = [*history, *_turn(t)]
        sent = list(history)
        assert index.digests(sent) == chain_digests(message_digest(m) for m in history)
        index.shared(sent)
    # another list with other objects of the same messages, then a changed one: digested as such
    copy = [dict(m) for m in history]
    assert index.digests(copy) == chain_digests(message_digest(m) for m in history)
    changed = [*history[:3], {"role": "user", "content": "other"}, *history[4:]]
    assert index.digests(changed) == chain_digests(message_digest(m) for m in changed)


def test_the_heap_top_is_kept_on_glibc() -> None:
    import platform

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert keep_heap_top() is True
    else:
        assert keep_heap_top() is False


def test_a_tail_with_many_closing_brackets_costs_a_few_whole_decodes_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    # a body after the kept one whose new message holds a hundred `]` and whose rest is not JSON: every `]` is a
    # candidate end of the messages and none fits; the tries stop at MAX_DECODED whole bodies' bytes
    import gateway.routes.body_prefix as bp

    prefixes, prefix = _kept_prefix()
    decoded_bytes = 0
    loads = bp._loads

    def counting(*parts: bytes | memoryview) -> Any:
        nonlocal decoded_bytes
        decoded_bytes += sum(len(p) for p in parts)
        return loads(*parts)

    monkeypatch.setattr(bp, "_loads", counting)
    content = b"]" + b"x" * 3000
    raw = prefix + b',{"role":"user","content":"' + content * 100 + b'"}],"model":tiny}'  # not JSON: no end fits
    assert prefixes.decode("s", raw) is None
    assert decoded_bytes <= (bp.MAX_DECODED + 1) * len(raw)
