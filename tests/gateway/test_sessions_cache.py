"""The session view's memory stays linear in the session (gateway/sessions_cache.py): token ids once per turn,
each message once, a bounded number of rendered prompts; and a view rebuilt from stored rows answers as the one
kept turn by turn."""

from __future__ import annotations

import copy
from array import array
from typing import Any

import orjson

from gateway.generation import input_ids
from gateway.sessions_cache import (
    PROMPT_TEXTS_KEPT,
    PromptIds,
    SessionView,
    ids_json,
    join_json,
    share_messages,
    view_from_rows,
)
from gateway.store.store import TurnRow
from rollway_common.wire import pack

SYSTEM = {"role": "system", "content": "You are an agent."}


def _session(turns: int) -> tuple[SessionView, list[TurnRow], list[list[int]]]:
    """A session built turn by turn as the gateway does (each request re-parsed: new message objects), the
    rows the store would hold, and each turn's full ids."""
    view = SessionView(0)
    rows: list[TurnRow] = []
    fulls: list[list[int]] = []
    conversation: list[dict[str, Any]] = [SYSTEM]
    parent: str | None = None
    for i in range(turns):
        conversation.append({"role": "user", "content": f"observation {i} " + "x" * 50})
        request = copy.deepcopy(conversation)  # what a client sends: a fresh copy every time
        if view.candidates:
            share_messages(request, view.candidates[-1].messages)
        delta = [i] * 7 if parent else list(range(20))
        completion = [100 + i] * 5
        reply = {"role": "assistant", "content": f"answer {i}"}
        view.add(f"t{i}", i + 1, request, reply, None, parent, delta, completion, prompt_text="p" * 100 + str(i))
        rows.append(TurnRow(f"t{i}", i + 1, parent, {"messages": copy.deepcopy(request), "tools": None}, reply,
                            pack(delta, "int32"), pack(completion, "int32"), b"", b"", 1.0, "stop", "extends",
                            None, False, None, 0, {}))
        fulls.append([*(fulls[-1] if parent else []), *delta, *completion])
        conversation.append(dict(reply))
        parent = f"t{i}"
    return view, rows, fulls


def test_full_ids_and_recorded_from_segments() -> None:
    view, _, fulls = _session(40)
    for i, full in enumerate(fulls):
        assert view.full_ids(f"t{i}").tolist() == full
        assert view.lengths[f"t{i}"] == len(full)
        assert view.completion(f"t{i}") == [100 + i] * 5
    assert view.recorded == sum(map(len, fulls))
    # each turn keeps only its own ids
    assert sum(len(own) for _, own, _ in view.segments.values()) == 20 + 39 * 7 + 40 * 5


def test_each_message_kept_once() -> None:
    view, _, _ = _session(60)
    distinct = {id(m) for c in view.candidates for m in c.messages}
    # the system message, 60 observations and 60 replies (the client's echo of each is byte for byte the reply)
    assert len(distinct) == 1 + 60 + 60
    assert len(view.prompt_texts) == PROMPT_TEXTS_KEPT
    assert list(view.prompt_texts) == ["t58", "t59"]


def test_view_from_rows_answers_as_the_kept_view() -> None:
    kept, rows, fulls = _session(30)
    rebuilt = view_from_rows(rows)
    assert rebuilt.turn_count == kept.turn_count == 30
    assert rebuilt.recorded == kept.recorded
    assert [rebuilt.full_ids(f"t{i}").tolist() for i in range(30)] == fulls
    assert [c.key() for c in rebuilt.candidates] == [c.key() for c in kept.candidates]
    assert len({id(m) for c in rebuilt.candidates for m in c.messages}) == 1 + 30 + 30


def test_share_messages_only_byte_for_byte() -> None:
    parent = [SYSTEM, {"role": "user", "content": "a", "name": "x"}, {"role": "user", "content": "b"}]
    same_order = [dict(SYSTEM), {"role": "user", "content": "a", "name": "x"}, {"role": "user", "content": "c"}]
    share_messages(same_order, parent)
    assert same_order[0] is parent[0] and same_order[1] is parent[1] and same_order[2] is not parent[2]
    reordered = [dict(SYSTEM), {"name": "x", "role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    share_messages(reordered, parent)
    assert reordered[1] is not parent[1] and list(reordered[1]) == ["name", "role", "content"]
    assert reordered[2] is not parent[2]  # stops at the first that differs


def test_an_extending_prompt_carries_the_json_of_its_ids() -> None:
    """The prompt sent for a turn that extends its parent is its ids' JSON kept from turn to turn
    (`PromptIds`): byte for byte what serialising the whole list gives, resubmitted tokens included, whether
    the parent's JSON was kept or is made from its ids."""
    view = SessionView(0)
    full: list[int] = []
    parent: str | None = None
    for i in range(12):
        delta = [i * 1000 + k - 5 for k in range(3 + i)]  # negative ids too: any int32 serialises the same
        if parent is None:
            prompt: Any = [*delta]
        else:
            if i == 6:
                view.full_json.clear()  # a view reloaded from the store keeps no JSON: made from the ids
            prompt = view.extended_prompt(parent, delta)
            assert prompt.tolist() == [*full, *delta]
            assert prompt.json == orjson.dumps([*full, *delta])[1:-1]
            for more in ([], [7], [2**31 - 1, -(2**31)]):
                payload = {"input_ids": input_ids(prompt, more), "sampling_params": {"max_new_tokens": 3}}
                expected = {"input_ids": [*full, *delta, *more], "sampling_params": {"max_new_tokens": 3}}
                assert orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(expected)
        completion = [i, i + 1]
        kept = join_json(prompt.json, ids_json(completion)) if isinstance(prompt, PromptIds) else None
        view.add(f"t{i}", i + 1, [SYSTEM], {"role": "assistant", "content": str(i)}, None, parent, delta,
                 completion, full_json=kept)
        full = [*full, *delta, *completion]
        parent = f"t{i}"
    assert len(view.full_json) == PROMPT_TEXTS_KEPT
    assert view.full_json["t11"] == orjson.dumps(full)[1:-1]
    empty = SessionView(0)
    empty.add("a", 1, [SYSTEM], {"role": "assistant", "content": ""}, None, None, [], [])
    big = [(k * 7919) % 300_000 - 150_000 for k in range(5000)]  # over SMALL_IDS: NumPy's serialisation
    assert ids_json(array("i", big)) == ids_json(big) == orjson.dumps(big)[1:-1]
    assert orjson.dumps(input_ids(empty.extended_prompt("a", []), [])) == b"[]"
    assert orjson.dumps(input_ids(empty.extended_prompt("a", [5]), [6])) == b"[5,6]"
