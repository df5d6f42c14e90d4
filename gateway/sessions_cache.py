"""Per-session view of earlier turns for continuity, cached and checked against the store.

A session's `turn_count` (read with its auth row on every call) tells whether the cached view is
current; another gateway process that stored a turn makes it stale, and it is reloaded from the store.

Memory per session is linear in the session (docs/architecture.md "Continuity and chains"): each turn's own
token ids (its prompt delta and completion, 4 bytes an id; a turn's full ids are put together from its chain
when it is extended), each distinct message object once (a request's messages that are byte for byte its
parent's are the parent's objects, `share_messages`), a list of message references per turn (8 bytes a
message), one index entry per turn, and the rendered prompt text and the JSON of the full ids (prompt +
completion, ~6 bytes an id) of the latest `PROMPT_TEXTS_KEPT` turns only.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson

from gateway.continuity import Candidate, ParentIndex
from gateway.store.store import Store, TurnRow
from gateway.template_segments import RenderCut
from rollway_common.wire import int32_array, unpack

_A = TypeVar("_A", bound=array)

PROMPT_TEXTS_KEPT = 2
"""Rendered prompts kept per session (a turn extending one of these renders one template less; one extending an
older turn renders its parent's prompt again)."""


class PromptIds(array):
    """A prompt extending its parent: its ids (int32) and `json`, the same ids as JSON without the brackets
    (b"1,2,3"), which `gateway.generation.input_ids` sends as they are. The parent's JSON is kept by the session
    view, so a long session's prompt is serialised once, a turn's new ids at a time (100k ids were ~0.5 ms of
    serialisation per call)."""

    __slots__ = ("json",)
    json: bytes


SMALL_IDS = 1024
"""An int32 array up to this long is serialised as a list (NumPy's fixed cost is ~2 us: a short call's prompt)."""


def ids_json(ids: Any) -> bytes:
    """`ids` (a list of ints, or an int32 array) as JSON without the brackets: orjson's own serialisation of
    them, so the bytes sent are those of serialising the whole list."""
    if isinstance(ids, array) and len(ids) > SMALL_IDS:
        return orjson.dumps(np.frombuffer(ids, dtype=np.int32), option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
    return orjson.dumps(ids.tolist() if isinstance(ids, array) else ids)[1:-1]


def join_json(a: bytes, b: bytes, bracket: bool = False) -> bytes:
    """Two JSON lists' contents without brackets, one after the other, or with `bracket` as one JSON list (one
    copy either way: a long session's prompt JSON is ~600 KB, and a temporary of that size is a fresh mapping to
    fault in)."""
    parts = (a, b"," if a and b else b"", b)
    return b"".join((b"[", *parts, b"]") if bracket else parts)


def share_messages(messages: list[dict[str, Any]], parent: list[dict[str, Any]]) -> None:
    """Replace, in place, each leading message of `messages` that serialises byte for byte like `parent`'s
    message at its index by that object: the session's view then holds each message once, not once per turn.
    Stops at the first that differs."""
    for i in range(min(len(messages), len(parent))):
        a, b = messages[i], parent[i]
        if a is b:
            continue
        try:
            same = a == b and orjson.dumps(a) == orjson.dumps(b)  # == first: a quick no; bytes: key order too
        except (TypeError, orjson.JSONEncodeError):
            same = False
        if not same:
            return
        messages[i] = b


@dataclass(slots=True)
class SessionView:
    turn_count: int
    candidates: list[Candidate] = field(default_factory=list)
    index: ParentIndex = field(default_factory=ParentIndex)
    segments: dict[str, tuple[str | None, array[int], int]] = field(default_factory=dict)
    """turn id -> (the turn whose full ids come first, or None; this turn's own ids: prompt delta + completion,
    int32; its completion's length). Arrays, not lists of ints: 4 bytes an id, and nothing for the collector."""
    lengths: dict[str, int] = field(default_factory=dict)
    """turn id -> length of its full ids (prompt + completion)."""
    recorded: int = 0
    """Tokens the session recorded: the sum over its turns of prompt + completion."""
    prompt_texts: OrderedDict[str, str] = field(default_factory=OrderedDict)
    """turn id -> its rendered prompt, for the latest turns this process rendered (not kept in the store)."""
    prompt_cuts: dict[str, RenderCut] = field(default_factory=dict)
    """turn id -> where its rendered prompt may be cut (`ChatTemplate.extension_cut`), for turns in `prompt_texts`."""
    full_json: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    """turn id -> its full ids (prompt + completion) as JSON without brackets (`ids_json`), for the latest turns
    this process sent an extending prompt of."""

    def extended_prompt(self, parent_id: str, ids: list[int]) -> PromptIds:
        """The parent's full ids followed by `ids`, with their JSON (the parent's kept one when there is one)."""
        out = self._chain_into(PromptIds("i"), parent_id)
        head = self.full_json.get(parent_id)
        if head is None:
            head = ids_json(out)
        out.extend(ids)
        out.json = join_json(head, ids_json(ids))
        return out

    def full_ids(self, turn_id: str) -> array[int]:
        """The turn's prompt + completion ids, a new int32 array (put together by memory copies: a long session's
        100k ids cost no Python int each)."""
        return self._chain_into(array("i"), turn_id)

    def _chain_into(self, out: _A, turn_id: str) -> _A:
        parts = []
        at: str | None = turn_id
        while at is not None:
            at, own, _ = self.segments[at]
            parts.append(own)
        parts.reverse()
        out.frombytes(b"".join(parts))  # one copy: ~40 us for 100k ids, where extending by each turn's was ~100 us
        return out

    def completion(self, turn_id: str) -> list[int]:
        _, own, n = self.segments[turn_id]
        return own[len(own) - n:].tolist() if n else []

    def add_ids(self, turn_id: str, seq: int, parent_id: str | None, prompt_delta: list[int],
                completion_ids: list[int]) -> None:
        """A turn's ids; `prompt_delta` follows the parent's full ids (the whole prompt when `parent_id` is None)."""
        own = int32_array(prompt_delta)
        own.extend(int32_array(completion_ids))
        self.segments[turn_id] = (parent_id, own, len(completion_ids))
        full = len(own) + (self.lengths[parent_id] if parent_id is not None else 0)
        self.lengths[turn_id] = full
        self.recorded += full
        self.turn_count = max(self.turn_count, seq)

    def add(self, turn_id: str, seq: int, messages: list[dict], reply: dict, tools: list | None,
            parent_id: str | None, prompt_delta: list[int], completion_ids: list[int],
            prompt_text: str | None = None, template_kwargs: dict | None = None,
            messages_digest: bytes | None = None, prompt_cut: RenderCut | None = None,
            full_json: bytes | None = None) -> None:
        """`messages_digest`: the chain digest of `messages` when the caller computed it (`ParentIndex.find`);
        `full_json`: the turn's full ids as JSON without brackets, when the caller has them (`PromptIds`)."""
        cand = Candidate(turn_id, [*messages, reply], tools, seq, template_kwargs, prefix_digest=messages_digest)
        self.candidates.append(cand)
        self.index.add(cand)
        self.add_ids(turn_id, seq, parent_id, prompt_delta, completion_ids)
        if prompt_text is not None:
            self.prompt_texts[turn_id] = prompt_text
            if prompt_cut is not None:
                self.prompt_cuts[turn_id] = prompt_cut
            while len(self.prompt_texts) > PROMPT_TEXTS_KEPT:
                old, _ = self.prompt_texts.popitem(last=False)
                self.prompt_cuts.pop(old, None)
        if full_json is not None:
            self.full_json[turn_id] = full_json
            while len(self.full_json) > PROMPT_TEXTS_KEPT:
                self.full_json.popitem(last=False)


def view_from_rows(rows: list[TurnRow]) -> SessionView:
    view = SessionView(turn_count=0)
    by_id: dict[str, Candidate] = {}
    for r in rows:
        delta: list[int] = unpack(r.prompt_ids, "int32")  # type: ignore[assignment]
        completion: list[int] = unpack(r.completion_ids, "int32")  # type: ignore[assignment]
        parent = r.parent_id or None
        messages = r.request.get("messages")
        if r.reply and messages:  # no reply (aborted early) or raw completion: no parent
            before = by_id.get(parent) if parent is not None else None
            if before is not None:
                share_messages(messages, before.messages)
            view.add(r.id, r.seq, messages, r.reply, r.request.get("tools"), parent, delta, completion,
                     template_kwargs=r.request.get("chat_template_kwargs"))
            by_id[r.id] = view.candidates[-1]
        else:
            view.add_ids(r.id, r.seq, parent, delta, completion)
    return view


class SessionCache:
    def __init__(self, store: Store, capacity: int = 4096) -> None:
        self.store = store
        self.capacity = capacity
        self._views: OrderedDict[str, SessionView] = OrderedDict()

    async def get(self, session_id: str, turn_count: int) -> SessionView:
        view = self._views.get(session_id)
        if view is None or view.turn_count != turn_count:
            view = view_from_rows(await self.store.session_turns(session_id)) if turn_count else SessionView(0)
            self._views[session_id] = view
        self._views.move_to_end(session_id)
        while len(self._views) > self.capacity:
            self._views.popitem(last=False)
        return view

    def record(self, session_id: str, seq: int, turn_id: str, messages: list[dict], reply: dict,
               tools: list | None, parent_id: str | None, prompt_delta: list[int], completion_ids: list[int],
               prompt_text: str | None = None, template_kwargs: dict | None = None,
               messages_digest: bytes | None = None, prompt_cut: RenderCut | None = None,
               full_json: bytes | None = None) -> None:
        """Add a just-stored turn to a cached view that was current before it; else forget the view."""
        view = self._views.get(session_id)
        if view is not None and view.turn_count == seq - 1 and reply:
            view.add(turn_id, seq, messages, reply, tools, parent_id, prompt_delta, completion_ids, prompt_text,
                     template_kwargs, messages_digest, prompt_cut, full_json)
        else:
            self.drop(session_id)

    def drop(self, session_id: str) -> None:
        self._views.pop(session_id, None)
