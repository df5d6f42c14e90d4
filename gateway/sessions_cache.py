"""Per-session view of earlier turns for continuity, cached and checked against the store.

A session's `turn_count` (read with its auth row on every call) tells whether the cached view is
current; another gateway process that stored a turn makes it stale, and it is reloaded from the store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.continuity import Candidate
from gateway.store.store import Store, TurnRow
from rollway_common.wire import unpack


@dataclass(slots=True)
class SessionView:
    turn_count: int
    candidates: list[Candidate] = field(default_factory=list)
    # Token arrays are kept as tuples of ints: the collector stops tracking those, so its full collections
    # need not walk millions of ids of cached sessions (measured: ~80 ms per full collection otherwise).
    chains: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """turn id -> full ids (prompt + completion) of that turn."""
    completions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    prompt_texts: dict[str, str] = field(default_factory=dict)
    """turn id -> its rendered prompt, for turns this process rendered (not kept in the store)."""

    def add(self, turn_id: str, seq: int, messages: list[dict], reply: dict, tools: list | None,
            prompt_ids: list[int], completion_ids: list[int], prompt_text: str | None = None,
            template_kwargs: dict | None = None) -> None:
        self.candidates.append(Candidate(turn_id, [*messages, reply], tools, seq, template_kwargs))
        self.chains[turn_id] = (*prompt_ids, *completion_ids)
        self.completions[turn_id] = tuple(completion_ids)
        if prompt_text is not None:
            self.prompt_texts[turn_id] = prompt_text
        self.turn_count = max(self.turn_count, seq)


def view_from_rows(rows: list[TurnRow]) -> SessionView:
    view = SessionView(turn_count=0)
    for r in rows:
        delta: list[int] = unpack(r.prompt_ids, "int32")  # type: ignore[assignment]
        completion: list[int] = unpack(r.completion_ids, "int32")  # type: ignore[assignment]
        prompt = [*view.chains[r.parent_id], *delta] if r.parent_id else delta
        if r.reply and r.request.get("messages"):  # no reply (aborted early) or raw completion: no parent
            view.add(r.id, r.seq, r.request.get("messages", []), r.reply, r.request.get("tools"), prompt, completion,
                     template_kwargs=r.request.get("chat_template_kwargs"))
        else:
            view.chains[r.id] = (*prompt, *completion)
            view.turn_count = max(view.turn_count, r.seq)
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
               tools: list | None, prompt_ids: list[int], completion_ids: list[int],
               prompt_text: str | None = None, template_kwargs: dict | None = None) -> None:
        """Add a just-stored turn to a cached view that was current before it; else forget the view."""
        view = self._views.get(session_id)
        if view is not None and view.turn_count == seq - 1 and reply:
            view.add(turn_id, seq, messages, reply, tools, prompt_ids, completion_ids, prompt_text, template_kwargs)
        else:
            self.drop(session_id)

    def drop(self, session_id: str) -> None:
        self._views.pop(session_id, None)
