"""A long session's request decoded from its new bytes only.

An agent replays its whole conversation with every call, and a client that serialises the same messages the
same way (the `openai` SDK, any client re-sending what it sent) sends the previous call's body up to the end of
its `messages` array again, byte for byte, then the new messages and the rest of the body. Decoding the whole
body (orjson, ~0.3 ms for a 100k-token session's 300 KB) and keying each decoded message by its JSON again
(`MessageReuse.swap`, ~0.3 ms) grew the gateway's CPU per call with the session's length.

`BodyPrefixes` keeps, per session, the latest body, where its `messages` array opens and closes, and the
messages validated from it. A new body that starts with the same bytes up to that array's last message is decoded
from what follows them: its messages are the kept models followed by the new ones decoded, and the rest of the
body (with the keys before `messages`, the same bytes) is decoded as it is. The result is what decoding the whole
body gives (the same keys in the same order, the same values; the kept models are what the same JSON validated
to): JSON is read left to right, so after the same bytes a parser is in the same state, and what follows decodes
the same way. Where the tail is checked:

- the new messages: `{"messages":[S` + the bytes up to a candidate closing bracket + `]}` must decode to an
  object whose only key is `messages` and whose list starts with `S`, a string random to this process: a
  bracket inside a new message leaves an object or a string open (not valid), a bracket past the true one
  leaves another key in the object, or a later `messages` key whose list does not start with `S`;
- the rest: the bytes before the array's opening bracket + `S` + the bytes from the closing one on must decode,
  with `[S]` under `messages` (a later `messages` key would replace the array in the whole body's decoding: such
  a body is decoded whole).

Anything else (bytes that differ, a body that is not valid JSON, a check that fails) is decoded whole, as
before: errors are the whole body's own. Both decodes nest as deep as the body does (orjson's depth limit).

The first body of a session with MIN_MESSAGES messages (or one after its history changed) is decoded whole, and
its array's brackets are found the same way, once (the sentinel put before its first message), the body decoded
from them compared with the whole decoding. A client that never sends the same bytes again (one that re-serialises
differently each call) stops being looked at after `MAX_MISSES` misses.
Memory: the kept bodies, at most MAX_BYTES for the process (least recently used out first).
"""

from __future__ import annotations

import re
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

MAX_BYTES = 64 << 20
"""The most body bytes kept (about the latest bodies of two hundred 100k-token sessions)."""
MIN_MESSAGES = 8
"""Bodies with fewer messages are not kept (short calls: nothing to save)."""
MAX_MISSES = 2
"""A session whose kept body did not prefix its next one this many times in a row is no longer looked at."""
MAX_TRIES = 64
"""Closing brackets tried from the end of a body's tail (the rest of the body holds few; a bound all the same)."""
MAX_DECODED = 4
"""The bytes the tries may decode, in multiples of the body's: a tail with many closing brackets after its
messages (crafted or not) is decoded whole after that, so a body never costs more than a few whole decodes."""

_MESSAGES_KEY = re.compile(rb'"messages"[ \t\r\n]*:[ \t\r\n]*\[')
_SENTINEL = orjson.dumps(secrets.token_hex(16))
_SENTINEL_STR = orjson.loads(_SENTINEL)
_OPEN = b'{"messages":[' + _SENTINEL


@dataclass(slots=True)
class _Kept:
    raw: bytes | None
    lead: int
    """Offset in `raw` just past the bracket opening its messages (what comes before: the keys before them)."""
    end: int
    """Offset in `raw` just past its last message (the whitespace before the closing bracket left out: a client that
    indents puts other whitespace there when a message follows)."""
    messages: list[Any]
    rest: int
    """len(raw) - offset of the closing bracket: where to look first for the next body's (the rest of a body rarely
    changes)."""
    misses: int = 0


@dataclass(slots=True)
class Decoded:
    """A body decoded from its tail: `data` as orjson would decode the whole body (its first `reused` messages the
    kept models), and the offset of its messages' closing bracket (for `BodyPrefixes.keep`)."""

    data: dict[str, Any]
    reused: int
    end: int


def _loads(*parts: bytes | memoryview) -> Any:
    try:
        return orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        return None


def _split(lead: bytes | memoryview, tail: bytes, first_guess: int | None,
           check: Callable[[list[Any]], bool]) -> tuple[int, list[Any], dict[str, Any]] | None:
    """(offset in `tail` of the bracket closing the messages array, the new messages after the sentinel, the
    body decoded with `[sentinel]` for its messages), `lead` being a body's bytes up to its messages' opening
    bracket and `tail` what follows an element of that array. `check(messages)`: whether the decoded messages
    (sentinel first) are the expected ones."""
    tried = 0
    at = len(tail)
    budget = MAX_DECODED * (len(lead) + len(tail))
    guesses = [first_guess] if first_guess is not None and 0 <= first_guess < len(tail) else []
    while tried < MAX_TRIES:
        if guesses:
            j = guesses.pop()
            if tail[j:j + 1] != b"]":
                continue
        else:
            j = tail.rfind(b"]", 0, at)
            if j < 0:
                return None
            at = j
            if j == first_guess:
                continue
        tried += 1
        budget -= len(lead) + len(tail) - j
        if budget < 0:
            return None
        data = _loads(lead, _SENTINEL, tail[j:])
        if type(data) is not dict or data.get("messages") != [_SENTINEL_STR]:
            continue  # not valid, or a later `messages` key
        budget -= j
        if budget < 0:
            return None
        head = _loads(_OPEN, tail[:j], b"]}")
        if type(head) is not dict or len(head) != 1:
            continue  # not valid, or keys after the array: the bracket is past the array's own
        new = head["messages"]
        if type(new) is not list or not new or new[0] != _SENTINEL_STR or not check(new):
            continue  # a later `messages` key took the sentinel's place
        return j, new, data
    return None


class BodyPrefixes:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0

    def decode(self, session: str, raw: bytes) -> Decoded | None:
        """`raw` decoded from what follows the session's kept body's messages, or None: decode it whole."""
        kept = self._kept.get(session)
        if kept is None or kept.raw is None:
            return None
        end = kept.end
        head = memoryview(kept.raw)
        if len(raw) <= end or not raw.startswith(head[:end]):
            kept.misses += 1
            return None
        tail = raw[end:]
        found = _split(head[:kept.lead], tail, len(raw) - kept.rest - end, lambda new: True)
        if found is None:
            kept.misses += 1
            return None
        j, new, data = found
        kept.misses = 0
        data["messages"] = [*kept.messages, *new[1:]]
        return Decoded(data, len(kept.messages), end + j)

    def keep(self, session: str, raw: bytes, data: dict[str, Any], validated: list[Any],
             decoded: Decoded | None) -> None:
        """After `raw` was decoded (`data`, whole when `decoded` is None) and validated (its messages `validated`)."""
        messages = data.get("messages")
        if not isinstance(messages, list) or len(messages) < MIN_MESSAGES or len(validated) != len(messages):
            return
        old = self._kept.get(session)
        if decoded is not None:
            assert old is not None and old.raw is not None
            lead, end = old.lead, decoded.end
        else:
            if old is not None and old.misses >= MAX_MISSES:
                if old.raw is not None:  # a client that re-serialises: nothing more kept for it
                    self._bytes -= len(old.raw)
                    old.raw, old.messages = None, []
                return
            found = _find_ends(raw, data, old.rest if old is not None else None)
            if found is None:
                return
            lead, end = found
        if old is not None and old.raw is not None:
            self._bytes -= len(old.raw)
        close = end
        while end > lead and raw[end - 1] in b" \t\r\n":
            end -= 1
        self._kept[session] = _Kept(raw, lead, end, list(validated), len(raw) - close,
                                    old.misses if old is not None else 0)
        self._kept.move_to_end(session)
        self._bytes += len(raw)
        while self._bytes > self.max_bytes and self._kept:
            _, gone = self._kept.popitem(last=False)
            if gone.raw is not None:
                self._bytes -= len(gone.raw)


def _find_ends(raw: bytes, data: dict[str, Any], rest: int | None) -> tuple[int, int] | None:
    """(offset past the bracket opening `raw`'s messages, offset of the one closing them) for a body decoded whole
    (`data`, its messages possibly swapped for models): found by the same checks as a tail's (the sentinel put
    before the first message, with the comma it needs), and the body decoded from them compared with `data`.
    Once per session, or after its history changed."""
    n = len(data["messages"])
    try:
        others = orjson.dumps({k: v for k, v in data.items() if k != "messages"})
    except (TypeError, orjson.JSONEncodeError):
        return None
    for tries, key in enumerate(_MESSAGES_KEY.finditer(raw)):
        if tries >= 4:
            return None
        o = key.end()
        tail = b"," + raw[o:]
        found = _split(memoryview(raw)[:o], tail, len(tail) - rest if rest is not None else None,
                       lambda new: len(new) == n + 1)
        if found is None:
            continue
        j, _, decoded = found
        if list(decoded) != list(data):
            continue
        del decoded["messages"]
        if orjson.dumps(decoded) != others:
            continue
        return o, o - 1 + j
    return None
