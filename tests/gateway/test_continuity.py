"""Message equality and the choice of a new turn's parent (docs/architecture.md "Continuity and chains";
pure, no tokenizer)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gateway.continuity import (
    Candidate,
    CanonicalMessage,
    ParentChoice,
    ParentIndex,
    canonical_message,
    canonical_tools,
    chain_digests,
    choose_parent,
    message_digest,
    messages_equal,
    tools_digest,
    tools_key,
)
from gateway.protocol import ChatMessage

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}
ANSWER = {"role": "assistant", "content": "Sunny, 21 °C."}
USER2 = {"role": "user", "content": "And Rome?"}


def test_canonical_form_keeps_what_the_model_saw() -> None:
    assert canonical_message(CALL) == CanonicalMessage(
        role="assistant",
        content="",
        tool_calls=(("get_weather", '{"city":"Paris","unit":"C"}'),),
        tool_call_id=None,
    )
    assert canonical_message(RESULT) == CanonicalMessage("tool", "sunny, 21", (), "call_1")
    assert hash(canonical_message(CALL)) == hash(canonical_message(dict(reversed(CALL.items()))))


@pytest.mark.parametrize(
    "variant",
    [
        {"content": "Weather in Paris?", "role": "user"},  # key order
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
        },
        {
            "role": "user",
            "content": "Weather in Paris?",
            "name": None,
            "tool_calls": None,
            "tool_call_id": None,
        },
        {"role": "user", "content": "Weather in Paris?", "tool_calls": []},
    ],
)
def test_equal_user_message_variants(variant: dict[str, Any]) -> None:
    assert messages_equal(USER, variant)


@pytest.mark.parametrize(
    "variant",
    [
        # arguments re-serialised: other whitespace and key order
        {
            **CALL,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{\n  "unit": "C",\n  "city": "Paris"\n}',
                    },
                }
            ],
        },
        # arguments as an object, content "" and reasoning kept or dropped, other call id, extra nulls
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "They want Paris.",
            "refusal": None,
            "tool_calls": [
                {
                    "id": "call_renamed",
                    "type": "function",
                    "function": {"arguments": {"unit": "C", "city": "Paris"}, "name": "get_weather"},
                }
            ],
        },
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'}}],
        },
    ],
)
def test_equal_assistant_message_variants(variant: dict[str, Any]) -> None:
    assert messages_equal(CALL, variant)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (USER, {"role": "user", "content": "Weather in Paris? "}),  # whitespace is text
        (USER, {"role": "system", "content": "Weather in Paris?"}),
        (RESULT, {**RESULT, "tool_call_id": "call_2"}),
        (
            CALL,
            {**CALL, "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        ),
        (
            CALL,
            {
                **CALL,
                "tool_calls": [
                    {"function": {"name": "get_time", "arguments": '{"city": "Paris", "unit": "C"}'}}
                ],
            },
        ),
        (CALL, {**CALL, "tool_calls": []}),
        (CALL, {**CALL, "tool_calls": CALL["tool_calls"] * 2}),
        (CALL, {**CALL, "content": "Checking."}),
    ],
)
def test_unequal_messages(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert not messages_equal(a, b)


def test_arguments_that_are_not_json_compare_as_strings() -> None:
    def call(args: str) -> dict[str, Any]:
        return {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}

    assert messages_equal(call("{oops"), call("{oops"))
    assert not messages_equal(call("{oops"), call("{oops "))
    assert not messages_equal(call('"{}"'), call("{}"))  # a JSON string is not an object


def test_non_text_parts_are_compared_part_by_part() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:x", "detail": None}}
    a = {"role": "user", "content": [{"type": "text", "text": "see"}, image]}
    b = {
        "role": "user",
        "content": [{"text": "see", "type": "text"}, {"image_url": {"url": "data:x"}, "type": "image_url"}],
    }
    assert messages_equal(a, b)
    assert not messages_equal(a, {"role": "user", "content": "see"})


def test_pydantic_messages_compare_like_dicts() -> None:
    model = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}
    )
    assert messages_equal(model, USER)
    call = ChatMessage.model_validate(CALL)
    assert messages_equal(call, CALL)


def test_tools_compare_by_content() -> None:
    reordered = [
        {
            "function": {
                "parameters": TOOLS[0]["function"]["parameters"],
                "name": "get_weather",
                "description": "Weather in a city",
                "strict": None,
            },
            "type": "function",
        }
    ]
    assert canonical_tools(TOOLS) == canonical_tools(reordered)
    assert canonical_tools(None) == canonical_tools([]) == "[]"
    assert canonical_tools(TOOLS) != canonical_tools([*TOOLS, *TOOLS])


# --- choose_parent ---------------------------------------------------------------------------------


def cand(turn_id: str, messages: list[dict[str, Any]], order: int, tools: Any = TOOLS) -> Candidate:
    return Candidate(turn_id, messages, tools, order)


T1 = [SYSTEM, USER, CALL]  # turn 1: request [SYSTEM, USER] + its reply CALL
T2 = [SYSTEM, USER, CALL, RESULT, ANSWER]  # turn 2: request + RESULT, reply ANSWER


def test_first_turn() -> None:
    assert choose_parent([], [SYSTEM, USER], TOOLS) == ParentChoice(None, "first_turn")


def test_longest_prefix_wins() -> None:
    cands = [cand("t1", T1, 1), cand("t2", T2, 2)]
    assert choose_parent(cands, [*T1, RESULT], TOOLS) == ParentChoice("t1", None)
    assert choose_parent(cands, [*T2, USER2], TOOLS) == ParentChoice("t2", None)
    # order of the candidate list does not matter
    assert choose_parent(cands[::-1], [*T2, USER2], TOOLS) == ParentChoice("t2", None)


def test_latest_wins_on_ties() -> None:
    """Two identical turns (e.g. the agent retried turn 1): the later one is the parent."""
    cands = [cand("t1", T1, 1), cand("t1-retry", T1, 2), cand("t1-old", T1, 0)]
    assert choose_parent(cands, [*T1, RESULT], TOOLS) == ParentChoice("t1-retry", None)


def test_replayed_variants_still_extend() -> None:
    """What clients do to the history they send back does not break the chain (AReaL#1455)."""
    replay = [
        {"content": "You are terse.", "role": "system", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call_1",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.dumps({"unit": "C", "city": "Paris"}, indent=2),
                    },
                }
            ],
        },
        RESULT,
    ]
    assert choose_parent([cand("t1", T1, 1)], replay, TOOLS) == ParentChoice("t1", None)


def test_tools_must_match() -> None:
    cands = [cand("t1", T1, 1)]
    assert choose_parent(cands, [*T1, RESULT], None) == ParentChoice(None, "different_tools")
    assert choose_parent([cand("t1", T1, 1, tools=None)], [*T1, RESULT], []) == ParentChoice("t1", None)


def test_template_kwargs_must_match() -> None:
    """A turn rendered with other chat_template_kwargs (thinking on vs off) renders another prompt: not a parent,
    and the reason says so; the same kwargs in another key order, or none on both sides, extend."""
    on = Candidate("t1", T1, TOOLS, 1, {"enable_thinking": True, "x": 1})
    assert choose_parent([on], [*T1, RESULT], TOOLS, {"enable_thinking": False}) == \
        ParentChoice(None, "different_template_kwargs")
    assert choose_parent([on], [*T1, RESULT], TOOLS, {"x": 1, "enable_thinking": True}) == ParentChoice("t1", None)
    assert choose_parent([on], [*T1, RESULT], None, {"enable_thinking": False}) == ParentChoice(None, "different_tools")
    assert choose_parent([cand("t1", T1, 1)], [*T1, RESULT], TOOLS, {}) == ParentChoice("t1", None)
    assert choose_parent([cand("t1", T1, 1)], [*T1, RESULT], TOOLS, {"enable_thinking": False}) == \
        ParentChoice(None, "different_template_kwargs")


def test_edited_message() -> None:
    edited = [SYSTEM, {"role": "user", "content": "Weather in Lyon?"}, CALL, RESULT]
    assert choose_parent([cand("t1", T1, 1)], edited, TOOLS) == ParentChoice(None, "edited_message")
    # an edited reply: the client changed the model's tool call
    changed = [
        SYSTEM,
        USER,
        {**CALL, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{}"}}]},
        RESULT,
    ]
    assert choose_parent([cand("t1", T1, 1)], changed, TOOLS) == ParentChoice(None, "edited_message")


def test_removed_message() -> None:
    """The agent trimmed its history (here: dropped the tool call and its result)."""
    trimmed = [SYSTEM, USER, ANSWER, USER2]
    assert choose_parent([cand("t2", T2, 2)], trimmed, TOOLS) == ParentChoice(None, "removed_message")


def test_retried_and_no_prefix() -> None:
    cands = [cand("t1", T1, 1)]
    assert choose_parent(cands, [SYSTEM, USER], TOOLS) == ParentChoice(None, "retried")
    assert choose_parent(cands, T1, TOOLS) == ParentChoice(None, "retried")  # nothing new to answer
    other = [{"role": "system", "content": "Summarise."}, USER]
    assert choose_parent(cands, other, TOOLS) == ParentChoice(None, "no_prefix")


def test_reason_comes_from_the_closest_candidate() -> None:
    """t2 shares 4 messages before the edit, t1 only 2 (and has other tools): edited_message wins."""
    cands = [cand("t1", T1, 1, tools=None), cand("t2", T2, 2)]
    new = [SYSTEM, USER, CALL, RESULT, {"role": "assistant", "content": "Rainy."}, USER2]
    assert choose_parent(cands, new, TOOLS) == ParentChoice(None, "edited_message")
    # with t2 gone, t1 would be a prefix but for its tools
    assert choose_parent(cands[:1], new, TOOLS) == ParentChoice(None, "different_tools")


def test_long_session_is_linear_and_cached() -> None:
    """100 turns, each extending the previous one: every turn finds its parent, and candidates
    canonicalise their messages once (re-using them across calls)."""
    msgs: list[dict[str, Any]] = [SYSTEM]
    cands: list[Candidate] = []
    started = time.perf_counter()
    for i in range(100):
        msgs = [*msgs, {"role": "user", "content": f"question {i}"}]
        choice = choose_parent(cands, msgs, TOOLS)
        assert choice == (
            ParentChoice(cands[-1].turn_id, None) if cands else ParentChoice(None, "first_turn")
        )
        msgs = [*msgs, {"role": "assistant", "content": f"answer {i}"}]
        cands.append(cand(f"t{i}", msgs, i))
    assert time.perf_counter() - started < 2.0  # ~0.05 s on a shared 2-core machine
    assert all(c._canon is not None for c in cands[:-1])


# --- ParentIndex: the same answer as choose_parent, by digests -----------------------------------------


def _indexed(cands: list[Candidate]) -> ParentIndex:
    index = ParentIndex()
    for c in cands:
        index.add(c)
    return index


REQUESTS = [
    [SYSTEM, USER],
    [*T1, RESULT],
    [*T2, USER2],
    T1,
    [SYSTEM, {"role": "user", "content": "Weather in Lyon?"}, CALL, RESULT],
    [SYSTEM, USER, ANSWER, USER2],
    [{"role": "system", "content": "Summarise."}, USER],
    [SYSTEM, USER, CALL, RESULT, {"role": "assistant", "content": "Rainy."}, USER2],
    [  # re-serialised by a client: null fields, text parts, other key order and spacing in the arguments
        {"content": "You are terse.", "role": "system", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "renamed", "function": {
            "name": "get_weather", "arguments": json.dumps({"unit": "C", "city": "Paris"}, indent=2)}}]},
        RESULT,
    ],
]
CANDIDATE_SETS = [
    [],
    [cand("t1", T1, 1)],
    [cand("t1", T1, 1), cand("t2", T2, 2)],
    [cand("t1", T1, 1), cand("t1-retry", T1, 2), cand("t1-old", T1, 0)],
    [cand("t1", T1, 1, tools=None), cand("t2", T2, 2)],
    [cand("t1", T1, 1, tools=None)],
    [Candidate("t1", T1, TOOLS, 1, {"enable_thinking": True})],
]


@pytest.mark.parametrize("cands", CANDIDATE_SETS)
@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": True}, {"enable_thinking": False}])
def test_index_answers_as_choose_parent(cands: list[Candidate], tools: Any, kwargs: Any) -> None:
    index = _indexed(cands)
    for request in REQUESTS:
        choice, parent, digest = index.find(cands, request, tools, kwargs)
        assert choice == choose_parent(cands, request, tools, kwargs), request
        assert (parent.turn_id if parent else None) == choice.parent_turn_id
        assert digest == chain_digests(message_digest(m) for m in request)[-1]


def test_candidate_key_from_its_request_digest() -> None:
    """A candidate given its request's digest keys as one that digests all its messages itself."""
    _, _, digest = ParentIndex().find([], T1[:-1], TOOLS)
    assert Candidate("a", T1, TOOLS, 1, prefix_digest=digest).key() == cand("b", T1, 1).key()
    assert cand("b", T1, 1).key() != cand("c", T1, 1, tools=None).key()


def test_index_on_a_long_session_compares_no_candidate() -> None:
    """300 turns each extending the last: every turn finds its parent through the index, without canonical
    forms of any candidate (the message-by-message comparison never runs)."""
    msgs: list[dict[str, Any]] = [SYSTEM]
    cands: list[Candidate] = []
    index = ParentIndex()
    digest = b""
    for i in range(300):
        msgs = [*msgs, {"role": "user", "content": f"question {i}"}]
        choice, _, digest = index.find(cands, msgs, TOOLS)
        assert choice == (ParentChoice(cands[-1].turn_id, None) if cands else ParentChoice(None, "first_turn"))
        msgs = [*msgs, {"role": "assistant", "content": f"answer {i}"}]
        cands.append(Candidate(f"t{i}", msgs, TOOLS, i, prefix_digest=digest))
        index.add(cands[-1])
    assert all(c._canon is None for c in cands)


def test_index_digests_cache_by_exact_json() -> None:
    """A message sent again as it was is found in the cache; one re-serialised (other key order, nulls) is put in
    canonical form again and digests the same."""
    index = ParentIndex()
    first = index.digests([SYSTEM, CALL])
    assert len(index._raw) == 2
    again = index.digests([dict(SYSTEM), json.loads(json.dumps(CALL))])
    assert again == first and len(index._raw) == 2
    reordered = index.digests([{"content": "You are terse.", "role": "system", "name": None}, CALL])
    assert reordered == first and len(index._raw) == 3


def test_tools_key_cached_by_exact_json_answers_as_uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached key of tools and kwargs is the canonical form and its digest, whatever the spelling: tools
    reordered or with nulls key the same, other tools or kwargs differently; pydantic tools (not plain JSON) are
    keyed without the cache; past its byte bound the cache starts over."""
    import gateway.continuity as continuity

    monkeypatch.setattr(continuity, "_tools_keys", {})
    monkeypatch.setattr(continuity, "_tools_keys_bytes", 0)
    reordered = [{"function": {**TOOLS[0]["function"], "strict": None}, "type": "function"}]
    for tools, kwargs in ((TOOLS, None), (reordered, {}), (None, None), ([], {"enable_thinking": True}),
                          ([*TOOLS, *TOOLS], None)):
        text = canonical_tools(tools) + "\0" + json.dumps(kwargs or {}, sort_keys=True, separators=(",", ":"))
        assert tools_key(tools, kwargs) == (text, tools_digest(text))
        assert tools_key(tools, kwargs) == (text, tools_digest(text))  # from the cache
    assert tools_key(TOOLS, None) == tools_key(reordered, {})
    assert tools_key(TOOLS, None) != tools_key(TOOLS, {"enable_thinking": False})
    assert len(continuity._tools_keys) == 6

    class Tool:  # not JSON: canonical_tools dumps it, the cache cannot key it
        def model_dump(self) -> dict[str, Any]:
            return TOOLS[0]

    assert tools_key([Tool()], None) == tools_key(TOOLS, None)
    assert len(continuity._tools_keys) == 6
    monkeypatch.setattr(continuity, "TOOLS_CACHE_BYTES", continuity._tools_keys_bytes + 10)
    big = [{"type": "function", "function": {"name": "x" * 20, "parameters": {}}}]
    assert tools_key(big, None)[0].startswith("[{")
    assert list(continuity._tools_keys) == [continuity.orjson.dumps((big, None))]


def test_candidate_keys_with_the_cached_tools_key() -> None:
    """A candidate's key starts with the digest of its tools and kwargs: a request with the same tools in another
    spelling finds it; with other kwargs it does not."""
    index = ParentIndex()
    c = Candidate("t1", T1, [{"function": {**TOOLS[0]["function"], "strict": None}, "type": "function"}], 1)
    index.add(c)
    assert index.find([c], [*T1, RESULT], TOOLS)[1] is c
    assert index.find([c], [*T1, RESULT], TOOLS, {"enable_thinking": True})[1] is None


def test_message_digest_kept_across_sessions_equals_the_canonical_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """`message_digest` kept by exact JSON answers what the canonical form gives; re-serialised variants digest the
    same; a message that is not plain JSON is digested without the cache; past its bound the cache starts over."""
    import hashlib

    import gateway.continuity as continuity

    monkeypatch.setattr(continuity, "_message_digests", {})
    monkeypatch.setattr(continuity, "_message_digests_bytes", 0)

    def uncached(m: Any) -> bytes:
        return hashlib.blake2b(continuity.orjson.dumps(tuple(canonical_message(m))), digest_size=16).digest()

    variants = [SYSTEM, {"content": "You are terse.", "role": "system", "name": None}, CALL, RESULT, ANSWER,
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}, USER]
    for m in variants * 2:
        assert message_digest(m) == uncached(m)
    assert message_digest(variants[1]) == message_digest(SYSTEM)
    assert message_digest(variants[5]) == message_digest(USER)
    assert len(continuity._message_digests) == len(variants)
    assert message_digest(ChatMessage.model_validate(USER)) == message_digest(USER)  # not a dict: not kept
    assert len(continuity._message_digests) == len(variants)
    monkeypatch.setattr(continuity, "MESSAGE_DIGESTS_BYTES", continuity._message_digests_bytes + 5)
    message_digest(USER2)
    assert list(continuity._message_digests) == [continuity.orjson.dumps(USER2)]
