"""The token view of a session: each chain's tokens with behaviour logprob, loss mask and weight version, the
weight-version boundaries inside replies, and at every new chain the first token where it left the turn it
came closest to extending (the drift report).

The loss mask is `gateway.samples.session_sequences`'s, the one the trainer gets: a chain (a leaf of the
session's turn tree, as there) takes the next sequence whose tokens are its own, and a chain that produced
no sequence trains nothing. Logprobs and versions are the stored ones of every completion token, also where
the mask is 0 (a turn trained in an earlier chain, a disconnected partial): the page shows what the model
did and, separately, what is trained.

Chains are kept in a small LRU keyed by (session, turn count), in compact arrays (~13 bytes a token), so the
pages of a 200-turn session are sliced from memory after the first request.
"""

from __future__ import annotations

import asyncio
import collections
import math
from array import array
from dataclasses import dataclass, field
from typing import Any

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from gateway.wire import unpack

PAGE_TOKENS = 2048
"""Tokens per page of the token view: a bounded payload (~60 KB of JSON) whatever the chain's length."""
MAX_PAGE_TOKENS = 8192
DRIFT_CONTEXT = 8, 16
"""Tokens shown before and from the first divergent one, on each side of the drift report."""


@dataclass(slots=True)
class Span:
    turn_id: str
    seq: int
    start: int
    """First token of the turn's prompt delta in the chain."""
    completion_start: int
    end: int


@dataclass(slots=True)
class Chain:
    leaf_id: str
    spans: list[Span]
    token_ids: array = field(default_factory=lambda: array("i"))
    logprobs: array = field(default_factory=lambda: array("f"))
    """NaN on prompt tokens."""
    versions: array = field(default_factory=lambda: array("i"))
    """-1 on prompt tokens."""
    loss_mask: bytearray = field(default_factory=bytearray)
    boundaries: list[dict[str, Any]] = field(default_factory=list)
    """Weight-version changes inside one reply: {index, from, to, turn_id, seq}."""
    drift: dict[str, Any] | None = None
    """For a chain whose first turn broke off an earlier one: reason, that turn, the first divergent index."""

    def summary(self) -> dict[str, Any]:
        return {"leaf_id": self.leaf_id, "tokens": len(self.token_ids), "trained": sum(self.loss_mask),
                "turns": [{"turn_id": s.turn_id, "seq": s.seq, "start": s.start,
                           "completion_start": s.completion_start, "end": s.end} for s in self.spans],
                "boundaries": self.boundaries, "drift": self.drift}


def _lcp(a: bytes, b: bytes) -> int:
    """Length in int32 tokens of the common prefix of two packed chains (binary search over memcmp)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _path_bytes(leaf: TurnRow, by_id: dict[str, TurnRow]) -> bytes:
    parts: list[bytes] = []
    node: TurnRow | None = leaf
    while node is not None:
        parts += (node.completion_ids, node.prompt_ids)
        node = by_id.get(node.parent_id) if node.parent_id else None
    return b"".join(reversed(parts))


def _ints(data: bytes) -> list[int]:
    return unpack(data, "int32")  # type: ignore[return-value]


def _drift(row: TurnRow, rows: list[TurnRow], by_id: dict[str, TurnRow]) -> dict[str, Any] | None:
    """Where a new chain's prompt leaves the earlier turn whose tokens it shares the longest prefix with.

    Only the leaves of the turns before it are compared: a turn's chain is a prefix of its descendants', so
    a leaf shares at least as long a prefix as any of its ancestors."""
    if row.parent_id is not None or row.seq <= 1 or row.chain_reason in (None, "first_turn"):
        return None
    earlier = [r for r in rows if r.seq < row.seq]
    extended = {r.parent_id for r in earlier if r.parent_id}
    ours = row.prompt_ids  # a chain's first turn stores its whole prompt
    best: tuple[int, int, TurnRow, bytes] | None = None
    for leaf in (r for r in earlier if r.id not in extended):
        theirs = _path_bytes(leaf, by_id)
        k = _lcp(ours, theirs)
        if best is None or (k, leaf.seq) >= best[:2]:
            best = (k, leaf.seq, leaf, theirs)
    if best is None:
        return None
    k, _, other, theirs = best
    lo = max(0, k - DRIFT_CONTEXT[0])
    hi = k + DRIFT_CONTEXT[1]
    return {"turn_id": row.id, "seq": row.seq, "reason": row.chain_reason, "against_turn_id": other.id,
            "against_seq": other.seq, "index": k, "context_start": lo,
            "ours": _ints(ours[lo * 4: hi * 4]), "theirs": _ints(theirs[lo * 4: hi * 4]),
            "ours_len": len(ours) // 4, "theirs_len": len(theirs) // 4}


def build_chains(rows: list[TurnRow], session_reward: float | None, gamma: float) -> list[Chain]:
    """Every chain of a session (leaves of its turn tree, in the order samples.py takes them)."""
    by_id = {r.id: r for r in rows}
    extended = {r.parent_id for r in rows if r.parent_id}
    sequences = session_sequences(rows, session_reward, gamma)
    out: list[Chain] = []
    k = 0
    for leaf in (r for r in rows if r.id not in extended):
        path: list[TurnRow] = []
        node: TurnRow | None = leaf
        while node is not None:
            path.append(node)
            node = by_id.get(node.parent_id) if node.parent_id else None
        path.reverse()
        chain = Chain(leaf.id, [])
        for turn in path:
            n_prompt = len(turn.prompt_ids) // 4
            start = len(chain.token_ids)
            chain.token_ids.frombytes(_native(turn.prompt_ids, "i"))
            chain.logprobs.extend(array("f", [math.nan]) * n_prompt)
            chain.versions.extend(array("i", [-1]) * n_prompt)
            cstart = len(chain.token_ids)
            chain.token_ids.frombytes(_native(turn.completion_ids, "i"))
            chain.logprobs.frombytes(_native(turn.logprobs, "f"))
            versions = array("i", _native(turn.versions, "i"))
            for i in range(1, len(versions)):
                if versions[i] != versions[i - 1]:
                    chain.boundaries.append({"index": cstart + i, "from": versions[i - 1], "to": versions[i],
                                             "turn_id": turn.id, "seq": turn.seq})
            chain.versions.extend(versions)
            chain.spans.append(Span(turn.id, turn.seq, start, cstart, len(chain.token_ids)))
        if k < len(sequences) and array("i", sequences[k].token_ids) == chain.token_ids:
            chain.loss_mask = bytearray(sequences[k].loss_mask)
            k += 1
        else:  # samples.py made no sequence of it: nothing of this chain is trained
            chain.loss_mask = bytearray(len(chain.token_ids))
        chain.drift = _drift(path[0], rows, by_id)
        out.append(chain)
    return out


def _native(data: bytes, code: str) -> bytes:
    """Stored little-endian bytes as this machine's array bytes (the same on every machine we run on)."""
    arr = array(code)
    arr.frombytes(data)
    if arr.itemsize > 1 and array("H", [1]).tobytes()[0] == 0:  # big-endian host
        arr.byteswap()
    return arr.tobytes()


Entry = tuple[list[Chain], list[str]]
"""A session's chains and its turn ids in order."""


class ChainCache:
    """The chains of the last few sessions looked at, keyed by (session id, turn count): a new turn is a
    new key, so a live session is never shown stale."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._items: collections.OrderedDict[tuple[str, int], Entry] = collections.OrderedDict()
        self.pending: dict[tuple[str, int], asyncio.Task[Entry]] = {}
        """Builds in flight, so that concurrent requests for one session wait for one build."""

    def get(self, key: tuple[str, int]) -> Entry | None:
        chains = self._items.get(key)
        if chains is not None:
            self._items.move_to_end(key)
        return chains

    def put(self, key: tuple[str, int], chains: Entry) -> None:
        self._items[key] = chains
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


class TokenText:
    """Each token id's text, decoded alone, cached per id (the vocabulary bounds the cache)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        missing = [i for i in set(ids) if i not in self._text]
        if missing:
            if self.tokenizer is None:
                self._text.update((i, f"<{i}>") for i in missing)
            else:
                for i in missing:
                    self._text[i] = self.tokenizer.decode([i], skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False)
        return [self._text[i] for i in ids]


def page(chain: Chain, text: TokenText, offset: int, limit: int) -> dict[str, Any]:
    """Tokens [offset, offset + limit) of a chain as parallel arrays (compact JSON)."""
    end = min(len(chain.token_ids), offset + limit)
    ids = chain.token_ids[offset:end].tolist()
    lps = [None if math.isnan(x) else round(x, 4) for x in chain.logprobs[offset:end]]
    return {"leaf_id": chain.leaf_id, "total": len(chain.token_ids), "offset": offset, "limit": limit,
            "ids": ids, "text": text(ids), "logprobs": lps, "mask": list(chain.loss_mask[offset:end]),
            "versions": chain.versions[offset:end].tolist(),
            "turns": [{"turn_id": s.turn_id, "seq": s.seq, "start": s.start, "completion_start": s.completion_start,
                       "end": s.end} for s in chain.spans if s.end > offset and s.start < end],
            "boundaries": [b for b in chain.boundaries if offset <= b["index"] < end],
            "drift": chain.drift,
            "drift_text": {"ours": text(chain.drift["ours"]), "theirs": text(chain.drift["theirs"])} if chain.drift else None}
