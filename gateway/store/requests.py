"""A turn's `request` as stored: whole, or as a delta on its parent's (issue 31: a store linear in the conversation).

A turn that extends its parent replays the parent's messages and reply, so storing its request whole keeps every
message once per later turn (O(turns²) a session). When the leading messages of a turn's request are, byte for
byte, its parent's messages followed by its parent's reply, the turn stores

    {"$base": <parent turn id>, "$from": k, "$same": ["tools"], "messages": <messages[k:]>,
     "tools": null, "asked": ..., "sampling": ..., ...}

`$from` leading messages come from the parent (its reconstructed messages, then its reply); a key named in `$same`
has the parent's value (its own is a placeholder, kept so the keys stay in their order); every other key is the
request's own. A request without `$base` is whole (every row written before this format, and every turn without a
parent). The gateway's request keys never start with `$`, so the marker cannot be a request's own.

`expand` is the one place that turns stored requests back into whole ones: every read of turns with their
requests goes through it (`Store.session_turns`, `Store.turns_of_sessions`), so the session record, the viewer,
SFT export and leases see exactly what a whole request held. The viewer's light read (`views.light_turns`) reads
only what is new in each turn and handles both forms in SQL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import orjson

BASE, FROM, SAME = "$base", "$from", "$same"
SHARED_KEYS = ("tools", "chat_template_kwargs")
"""Request keys stored as `$same` when equal to the parent's (tools can be tens of kilobytes a turn)."""


class MissingBase(RuntimeError):
    """A stored delta whose base turn is not among the rows read (a store edited by hand)."""


class HasRequest(Protocol):
    id: str
    parent_id: str | None
    request: dict[str, Any]
    reply: dict[str, Any]


def is_delta(request: Any) -> bool:
    return isinstance(request, dict) and BASE in request


def same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values serialise byte for byte alike (key order, 1 against 1.0 and True included)."""
    if a is b:
        return True
    try:
        return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)
    except (TypeError, orjson.JSONEncodeError):
        return False


def delta(request: dict[str, Any], parent_id: str, base: Sequence[Any], parent_request: dict[str, Any],
          shared: int | None = None) -> dict[str, Any]:
    """`request` as a delta on its parent's, or `request` itself when nothing of it is the parent's.

    `base`: the parent's messages followed by its reply, exactly as stored (reconstructed); `parent_request`: the
    parent's whole request (only its `SHARED_KEYS` are read). `shared`: how many leading messages are known to be
    `base`'s (the gateway knows by identity, `share_messages`); counted here when not given."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return request
    if shared is None:
        shared = 0
        for a, b in zip(messages, base, strict=False):
            if not same_json(a, b):
                break
            shared += 1
    same = [k for k in SHARED_KEYS if k in request and k in parent_request
            and same_json(request[k], parent_request[k])]
    if shared == 0 and not same:
        return request
    out: dict[str, Any] = {BASE: parent_id, FROM: shared}
    if same:
        out[SAME] = same
    for key, value in request.items():
        out[key] = messages[shared:] if key == "messages" else (None if key in same else value)
    return out


def shared_prefix(messages: Sequence[Any], base: Sequence[Any]) -> int:
    """How many leading messages are `base`'s own objects (what `share_messages` left shared)."""
    n = 0
    for a, b in zip(messages, base, strict=False):
        if a is not b:
            break
        n += 1
    return n


def whole(request: dict[str, Any], parent: tuple[dict[str, Any], dict[str, Any]] | None) -> dict[str, Any]:
    """A stored request made whole; `parent`: its base's (whole request, reply)."""
    if not is_delta(request):
        return request
    if parent is None:
        raise MissingBase(f"a stored turn's request is a delta on turn {request[BASE]}, which is not stored")
    base_request, base_reply = parent
    k = int(request[FROM])
    base_messages = base_request.get("messages") or []
    head = base_messages[:k] if k <= len(base_messages) else [*base_messages, base_reply]
    same = request.get(SAME) or ()
    out: dict[str, Any] = {}
    for key, value in request.items():
        if key.startswith("$"):
            continue
        out[key] = [*head, *value] if key == "messages" else (base_request.get(key) if key in same else value)
    return out


def expand(rows: Iterable[HasRequest]) -> None:
    """Make every row's request whole, in place. `rows`: whole sessions (a base is always an earlier turn of its
    session), in seq order; a session's messages are then shared between its turns, each parsed once."""
    done: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for r in rows:
        request = r.request
        if is_delta(request):
            request = r.request = whole(request, done.get(request[BASE]))
        done[r.id] = (request, r.reply)
