"""Which earlier turn a new chat request extends (docs/architecture.md "Continuity and chains").

Agents replay the conversation with every call, but rarely byte for byte: clients drop `null` fields,
reorder keys, re-serialise tool-call arguments, send text as content parts, and drop `reasoning_content`
(AReaL#1455/#1458). Messages are therefore compared in a canonical form that keeps only what the model
saw: role, content text, tool-call names with parsed arguments, and tool_call_id.

Deliberately ignored: `reasoning_content` (many clients strip it; the parent's own reply carries the
reasoning the model produced, so nothing is lost), the ids of the assistant's tool calls (a client that
renames them still links results through `tool_call_id`), and `name`.

Reasons a request starts a new chain (`ParentChoice.reason`), taken from the candidate that shares the
longest prefix with the request (the latest on ties):

    first_turn        the session has no earlier turn to extend
    different_tools   a turn would be a prefix, but it was called with other tools
    different_template_kwargs  a turn would be a prefix, but it was rendered with other chat_template_kwargs
                      (Qwen3's enable_thinking renders another generation prompt and history)
    edited_message    the request diverges from that turn at a message it changed
    removed_message   the request left out messages that turn had (it skips ahead to a later one)
    retried           the request is (a prefix of) that turn's messages with nothing new: a retry
    no_prefix         no turn shares even the first message with the request

Finding the parent costs one digest per message of the request (`ParentIndex`): each candidate is indexed by
the chain digest of its canonical messages (with its tools and chat_template_kwargs), and the request's chain
digests are looked up from the longest prefix down. Only when no candidate is a prefix are the candidates
compared message by message (`choose_parent`), for the reason of the best near miss.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

Reason = str


class CanonicalMessage(NamedTuple):
    role: str
    content: str | tuple[str, ...]
    """The text; content parts that are not text make it a tuple of canonical part JSON."""
    tool_calls: tuple[tuple[str, str], ...]
    """(name, arguments as canonical JSON) per call, in order."""
    tool_call_id: str | None


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _get(obj: Any, key: str) -> Any:
    """Dict access that also serves pydantic models (the route may pass either)."""
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def _content(content: Any) -> str | tuple[str, ...]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p if isinstance(p, dict) else p.model_dump(exclude_none=True) for p in content]
    if all(p.get("type") == "text" for p in parts):
        return "".join(p.get("text") or "" for p in parts)
    return tuple(_canonical_json(drop_none(p)) for p in parts)


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # ValueError: not JSON, or an integer past int_max_str_digits
            return "raw:" + arguments  # not JSON: only the identical string is equal
    return _canonical_json(arguments)


def drop_none(value: Any) -> Any:
    """`value` without null-valued keys, recursively (clients differ in sending or omitting nulls)."""
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value


def canonical_message(msg: Any) -> CanonicalMessage:
    """The comparable, hashable form of one OpenAI-form message (dict or pydantic model)."""
    calls = []
    for call in _get(msg, "tool_calls") or ():
        fn = _get(call, "function") or call
        calls.append((str(_get(fn, "name")), _arguments(_get(fn, "arguments"))))
    return CanonicalMessage(
        role=str(_get(msg, "role")),
        content=_content(_get(msg, "content")),
        tool_calls=tuple(calls),
        tool_call_id=_get(msg, "tool_call_id"),
    )


def messages_equal(a: Any, b: Any) -> bool:
    return canonical_message(a) == canonical_message(b)


def canonical_tools(tools: Sequence[Any] | None) -> str:
    """Tools compare by JSON with sorted keys and nulls dropped; `None` equals `[]`. Order matters:
    the template renders the tools in the order given."""
    dumped = [t if isinstance(t, dict) else t.model_dump() for t in tools or ()]
    return _canonical_json(drop_none(dumped))


@dataclass(eq=False)
class Candidate:
    """An earlier turn: its request messages followed by its reply as an assistant message."""

    turn_id: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    created_order: int
    template_kwargs: dict[str, Any] | None = None
    """The chat_template_kwargs the turn was rendered with (defaults included)."""
    _canon: tuple[CanonicalMessage, ...] | None = field(default=None, init=False, repr=False)
    _tools: str | None = field(default=None, init=False, repr=False)
    prefix_digest: bytes | None = field(default=None, repr=False)
    """The chain digest of `messages[:-1]` when the caller has it (the request's, computed to find its parent):
    the candidate's own digest then costs one step."""
    _digest: bytes | None = field(default=None, init=False, repr=False)

    def canonical(self) -> tuple[CanonicalMessage, ...]:
        """Computed once per candidate; the session cache keeps candidates across calls."""
        if self._canon is None:
            self._canon = tuple(canonical_message(m) for m in self.messages)
        return self._canon

    def canonical_tools(self) -> str:
        if self._tools is None:
            self._tools = tools_key(self.tools, self.template_kwargs)[0]
        return self._tools

    def key(self) -> bytes:
        """What `ParentIndex` finds the candidate by: its tools and kwargs, and the chain digest of its messages."""
        if self._digest is None:
            if self.prefix_digest is not None and self.messages:
                self._digest = chain_step(self.prefix_digest, message_digest(self.messages[-1]))
            else:
                self._digest = chain_digests(message_digest(m) for m in self.messages)[-1]
        return tools_key(self.tools, self.template_kwargs)[1] + self._digest


DIGEST_SIZE = 16
EMPTY_CHAIN = b"\0" * DIGEST_SIZE
"""The chain digest of no messages."""


MESSAGE_DIGESTS_BYTES = 16 << 20
"""The most JSON `message_digest` keeps, across sessions (then it starts over)."""
_message_digests: dict[bytes, bytes] = {}
_message_digests_bytes = 0


def message_digest(msg: Any) -> bytes:
    """BLAKE2b of a message's canonical form as JSON (content text and content-part tuples serialise
    differently, so they never collide). Kept by the message's exact JSON across sessions: the sessions of a run
    send the same system prompt, tool results and replies again and again (each session's first call put every
    one of its messages in canonical form)."""
    global _message_digests_bytes
    key: bytes | None = None
    if isinstance(msg, dict):
        try:
            key = orjson.dumps(msg)
        except (TypeError, orjson.JSONEncodeError):
            key = None
        if key is not None and (hit := _message_digests.get(key)) is not None:
            return hit
    digest = hashlib.blake2b(orjson.dumps(tuple(canonical_message(msg))), digest_size=DIGEST_SIZE).digest()
    if key is not None:
        if _message_digests_bytes + len(key) > MESSAGE_DIGESTS_BYTES:
            _message_digests.clear()
            _message_digests_bytes = 0
        _message_digests[key] = digest
        _message_digests_bytes += len(key)
    return digest


def chain_step(previous: bytes, message: bytes) -> bytes:
    """The chain digest of `previous`'s conversation followed by the message of digest `message`."""
    return hashlib.blake2b(previous + message, digest_size=DIGEST_SIZE).digest()


def chain_digests(message_digests: Any) -> list[bytes]:
    """[digest of no messages, of the first, of the first two, ...] over message digests."""
    out = [EMPTY_CHAIN]
    for m in message_digests:
        out.append(chain_step(out[-1], m))
    return out


def tools_digest(canonical_tools_and_kwargs: str) -> bytes:
    return hashlib.blake2b(canonical_tools_and_kwargs.encode(), digest_size=DIGEST_SIZE).digest()


TOOLS_CACHE_BYTES = 8 << 20
"""The most JSON `tools_key` keeps (then it starts over)."""
_tools_keys: dict[bytes, tuple[str, bytes]] = {}
_tools_keys_bytes = 0


def tools_key(tools: Sequence[Any] | None, template_kwargs: dict[str, Any] | None) -> tuple[str, bytes]:
    """(canonical tools + NUL + canonical chat_template_kwargs, its `tools_digest`): what a turn's tools and kwargs
    are compared and indexed by. Cached by the exact JSON of both: an agent sends the same tools with every call,
    and every session of a run sends the same ones (their canonical form was ~20 us of every call, twice: to find
    the parent and to index the new turn). Tools that are not plain JSON (pydantic models) are not cached."""
    global _tools_keys_bytes
    try:
        raw: bytes | None = orjson.dumps((tools, template_kwargs))
    except (TypeError, orjson.JSONEncodeError):
        raw = None
    hit = _tools_keys.get(raw) if raw is not None else None
    if hit is None:
        text = canonical_tools(tools) + "\0" + _canonical_json(template_kwargs or {})
        hit = (text, tools_digest(text))
        if raw is not None:
            if _tools_keys_bytes + len(raw) > TOOLS_CACHE_BYTES:
                _tools_keys.clear()
                _tools_keys_bytes = 0
            _tools_keys[raw] = hit
            _tools_keys_bytes += len(raw) + len(text)
    return hit


RAW_CACHE_BYTES = 64 << 20
"""The most JSON `ParentIndex` keeps to know messages it has seen (then it starts over)."""


class ParentIndex:
    """A session's candidates by `Candidate.key`, the latest kept for each key (so the latest wins ties, as in
    `choose_parent`), and the digests of the messages its requests sent, by their exact JSON: a message sent
    again as it was is not put in canonical form again. Memory: one entry per turn, and the JSON of each
    distinct message once (at most RAW_CACHE_BYTES)."""

    __slots__ = ("_by_id", "_by_key", "_last", "_raw", "_raw_bytes")

    def __init__(self) -> None:
        self._by_key: dict[bytes, Candidate] = {}
        self._raw: dict[bytes, tuple[bytes, dict[str, Any]]] = {}
        """A message's exact JSON -> its digest, and the message object kept for it."""
        self._raw_bytes = 0
        self._by_id: dict[int, bytes] = {}
        """id of a kept message object -> its digest (the object is alive while kept: the id is its own). A
        request whose messages are the kept objects themselves (the gateway converts a message it saw before
        into the same dict: gateway/routes/message_reuse.py) is digested without serialising them."""
        self._last: tuple[Any, list[Any], list[Any], list[bytes]] = (None, [], [], [EMPTY_CHAIN])
        """The list `digests` was given last, its messages then (the objects, kept alive: their ids stay theirs),
        what it left in their place, and their chain digests: the next request's leading messages that are those objects get the
        same (a long session's replayed history is the same objects call after call: no JSON and no BLAKE2b for
        them)."""

    def digests(self, messages: Sequence[Any]) -> list[bytes]:
        """The chain digests of `messages` (`chain_digests`), each message's digest from the cache when its
        exact JSON was seen before. A list's message seen before is replaced, in place, by the object kept for
        its JSON (the same JSON, so the same message): a session's history is then the same objects turn after
        turn, and `gateway.sessions_cache.share_messages` finds them shared by identity."""
        raw = self._raw
        swap = isinstance(messages, list)
        by_id = self._by_id
        _, last_in, last_out, last_chain = self._last
        given = list(messages)
        same = 0
        for a, b in zip(given, last_in, strict=False):
            if a is not b:
                break
            same += 1
        if swap:
            for i in range(same):
                if given[i] is not last_out[i]:
                    messages[i] = last_out[i]  # type: ignore[index]
        out = last_chain[:same + 1]
        for i in range(same, len(messages)):
            m = messages[i]
            known = by_id.get(id(m))
            if known is not None:
                out.append(chain_step(out[-1], known))
                continue
            key = None
            if isinstance(m, dict):
                try:
                    key = orjson.dumps(m)
                except (TypeError, orjson.JSONEncodeError):
                    key = None
            hit = raw.get(key) if key is not None else None
            if hit is None:
                digest = message_digest(m)
                if key is not None:
                    self._keep(key, digest, m)
            else:
                digest = hit[0]
                if swap and hit[1] is not m:
                    messages[i] = hit[1]  # type: ignore[index]
            out.append(chain_step(out[-1], digest))
        self._last = (messages, given, list(messages), out)
        return out

    def shared(self, messages: list[Any]) -> None:
        """`messages`, the list `digests` was given last, now holds the objects of its parent's messages
        (`gateway.sessions_cache.share_messages`): the next request's same leading objects get these, so that
        sharing them again compares nothing (a long session's replies were compared as JSON every call)."""
        source, given, _, chain = self._last
        if source is messages:
            self._last = (source, given, list(messages), chain)

    def _keep(self, key: bytes, digest: bytes, message: dict[str, Any]) -> None:
        if self._raw_bytes + len(key) > RAW_CACHE_BYTES:
            self._raw.clear()
            self._by_id.clear()
            self._raw_bytes = 0
        self._raw[key] = (digest, message)
        self._by_id[id(message)] = digest
        self._raw_bytes += len(key)

    def add(self, cand: Candidate) -> None:
        key = cand.key()
        old = self._by_key.get(key)
        if old is None or cand.created_order >= old.created_order:
            self._by_key[key] = cand
        reply = cand.messages[-1] if cand.messages else None
        if isinstance(reply, dict):  # a client that sends the reply back as it got it sends this object's JSON
            try:
                key = orjson.dumps(reply)
            except (TypeError, orjson.JSONEncodeError):
                return
            if key not in self._raw:
                self._keep(key, message_digest(reply), reply)

    def find(
        self, candidates: Sequence[Candidate], new_messages: Sequence[Any], tools: Sequence[Any] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[ParentChoice, Candidate | None, bytes]:
        """`choose_parent`'s answer, the parent candidate, and the chain digest of all of `new_messages`.

        One canonical form and one digest per request message, one dict lookup per prefix length; when no
        candidate is a prefix, `choose_parent` (comparing message by message) tells the reason."""
        chain = self.digests(new_messages)
        if not candidates:
            return ParentChoice(None, "first_turn"), None, chain[-1]
        prefix = tools_key(tools, template_kwargs)[1]
        by_key = self._by_key
        for k in range(len(chain) - 2, 0, -1):  # strict prefixes, longest first
            cand = by_key.get(prefix + chain[k])
            if cand is not None:
                return ParentChoice(cand.turn_id, None), cand, chain[-1]
        choice = choose_parent(candidates, new_messages, tools, template_kwargs)
        found = None  # a candidate the index missed would be a bug; its answer is still choose_parent's
        if choice.parent_turn_id is not None:
            found = next(c for c in candidates if c.turn_id == choice.parent_turn_id)
        return choice, found, chain[-1]


@dataclass(frozen=True, slots=True)
class ParentChoice:
    parent_turn_id: str | None
    reason: Reason | None
    """None when extending the parent; else why a new chain starts (see the module docstring)."""


def _shared_prefix(a: Sequence[CanonicalMessage], b: Sequence[CanonicalMessage]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _near_miss_reason(
    cand: Sequence[CanonicalMessage], new: Sequence[CanonicalMessage], k: int, tools_differ: bool
) -> Reason:
    """Why `cand`, sharing `k` leading messages with `new`, is not a parent of it."""
    if k == len(cand) and len(new) > k:  # a strict prefix: only the tools or the kwargs can have kept it out
        return "different_tools" if tools_differ else "different_template_kwargs"
    if k == len(new):
        return "retried"
    if k == 0:
        return "no_prefix"
    if new[k] in cand[k + 1 :]:
        return "removed_message"
    return "edited_message"


def choose_parent(
    candidates: Sequence[Candidate], new_messages: Sequence[Any], tools: Sequence[Any] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> ParentChoice:
    """The candidate whose messages are the longest strict prefix of `new_messages` (latest on ties)
    among those called with the same tools and chat_template_kwargs; else no parent and the reason of the
    best near miss.

    Linear in the number of messages over all candidates (each message is compared at most once;
    canonical forms of candidates are cached on them).
    """
    if not candidates:
        return ParentChoice(None, "first_turn")
    new = tuple(canonical_message(m) for m in new_messages)
    only_tools = canonical_tools(tools)
    tools_key = only_tools + "\0" + _canonical_json(template_kwargs or {})
    best: tuple[int, int, Candidate] | None = None  # (prefix length, created_order, candidate)
    miss: tuple[int, int, Reason] | None = None
    for cand in candidates:
        msgs = cand.canonical()
        k = _shared_prefix(msgs, new)
        same_tools = cand.canonical_tools() == tools_key
        if k == len(msgs) and len(new) > k and same_tools:
            if best is None or (k, cand.created_order) > best[:2]:
                best = (k, cand.created_order, cand)
        elif best is None:
            key = (k, cand.created_order)
            if miss is None or key > miss[:2]:
                tools_differ = not cand.canonical_tools().startswith(only_tools + "\0")
                miss = (*key, _near_miss_reason(msgs, new, k, tools_differ))
    if best is not None:
        return ParentChoice(best[2].turn_id, None)
    assert miss is not None
    return ParentChoice(None, miss[2])
