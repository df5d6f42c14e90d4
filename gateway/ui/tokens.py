"""The token view of a session: each chain's tokens with behaviour logprob, loss mask and weight version, the
weight-version boundaries inside replies, and at every new chain the first token where it left the turn it
came closest to extending (the drift report).

The loss mask is `gateway.samples.session_sequences`'s, the one the trainer gets: a chain (a leaf of the
session's turn tree, as there) takes the next sequence whose tokens are its own, and a chain that produced
no sequence trains nothing. Logprobs and versions are the stored ones of every completion token, also where
the mask is 0 (a turn trained in an earlier chain, a disconnected partial): the page shows what the model
did and, separately, what is trained.

A chain is built as its spans (which turn's prompt delta and reply sit where) and the few figures of its
summary; a page of it is sliced from the turns' stored little-endian arrays when asked for, with numpy, so the
first look at a 200-turn session of 800k tokens costs a walk over its turns, not over its tokens. What
`session_sequences` decides per turn (is this reply trained in this chain) is read off a run of it over the
same turn tree with one token a turn (`_learned`), so that the rules stay in one place and the trainer's path
stays as it is. Chains are kept in a small LRU keyed by (session, turn count): the stored arrays, ~6 bytes a
token.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from rollway_common.wire import pack, unpack

PAGE_TOKENS = 2048
"""Tokens per page of the token view: a bounded payload (~60 KB of JSON) whatever the chain's length."""
MAX_PAGE_TOKENS = 8192
DRIFT_CONTEXT = 8, 16
"""Tokens shown before and from the first divergent one, on each side of the drift report."""
I32, F32 = np.dtype("<i4"), np.dtype("<f4")


@dataclass(slots=True)
class Span:
    turn_id: str
    seq: int
    start: int
    """First token of the turn's prompt delta in the chain."""
    completion_start: int
    end: int
    row: TurnRow = field(repr=False)
    learn: bool = False
    """samples.py's loss mask on this turn's reply in this chain (the prompt's is 0)."""


@dataclass(slots=True)
class Chain:
    leaf_id: str
    spans: list[Span]
    total: int = 0
    trained: int = 0
    boundaries: list[dict[str, Any]] = field(default_factory=list)
    """Weight-version changes inside one reply: {index, from, to, turn_id, seq}."""
    drift: dict[str, Any] | None = None
    """For a chain whose first turn broke off an earlier one: reason, that turn, the first divergent index."""

    eval: bool = False

    def summary(self) -> dict[str, Any]:
        return {"leaf_id": self.leaf_id, "tokens": self.total, "trained": self.trained, "eval": self.eval,
                "turns": [_span_json(s) for s in self.spans], "boundaries": self.boundaries, "drift": self.drift}

    def window(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tokens [lo, hi): ids, logprobs (NaN on prompt tokens), versions (-1 there), loss mask."""
        ids, lps, vers, mask = [], [], [], []
        i = max(0, bisect.bisect_right([s.start for s in self.spans], lo) - 1)
        for sp in self.spans[i:]:
            if sp.start >= hi:
                break
            a, b = max(lo, sp.start), min(hi, sp.completion_start)
            if a < b:  # the prompt delta
                ids.append(np.frombuffer(sp.row.prompt_ids, I32)[a - sp.start: b - sp.start])
                lps.append(np.full(b - a, np.nan, np.float32))
                vers.append(np.full(b - a, -1, np.int32))
                mask.append(np.zeros(b - a, np.uint8))
            a, b = max(lo, sp.completion_start), min(hi, sp.end)
            if a < b:  # the reply
                x, y = a - sp.completion_start, b - sp.completion_start
                ids.append(np.frombuffer(sp.row.completion_ids, I32)[x:y])
                lps.append(_fit(np.frombuffer(sp.row.logprobs, F32), sp.end - sp.completion_start, np.nan)[x:y])
                vers.append(_fit(np.frombuffer(sp.row.versions, I32), sp.end - sp.completion_start, -1)[x:y])
                mask.append(np.full(b - a, 1 if sp.learn else 0, np.uint8))
        if not ids:
            return (np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, np.uint8))
        return np.concatenate(ids), np.concatenate(lps), np.concatenate(vers), np.concatenate(mask)


def _span_json(s: Span) -> dict[str, Any]:
    return {"turn_id": s.turn_id, "seq": s.seq, "start": s.start, "completion_start": s.completion_start,
            "end": s.end}


def _fit(arr: np.ndarray, n: int, fill: float) -> np.ndarray:
    """A reply's stored per-token array at the reply's length (they are recorded together; never trusted blind)."""
    if len(arr) == n:
        return arr
    out = np.full(n, fill, arr.dtype)
    out[: min(n, len(arr))] = arr[:n]
    return out


def _lcp(a: bytes, b: bytes) -> int:
    """Length in int32 tokens of the common prefix of two packed chains."""
    n = min(len(a), len(b)) // 4
    x, y = np.frombuffer(a, I32, n), np.frombuffer(b, I32, n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


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


_PROBE_PROMPT, _PROBE_LOGPROBS = pack([-1], "int32"), pack([0.0], "float32")


def _learned(rows: list[TurnRow]) -> dict[tuple[str, str], bool]:
    """{(leaf id, turn id): whether samples.py trains that turn's reply in that leaf's sequence}.

    `session_sequences` run over the same turns with a prompt delta of one token and a reply of one token, the
    turn's index: its mask is per turn (0 on a prompt delta, one value on the whole of a reply), so each
    sequence reads back as its turns' decisions, and the last reply's index names its leaf. A leaf that made no
    sequence trains nothing (absent here: False)."""
    probe = [dataclasses.replace(r, prompt_ids=_PROBE_PROMPT, completion_ids=pack([i], "int32"),
                                 logprobs=_PROBE_LOGPROBS, versions=pack([0], "int32"))
             for i, r in enumerate(rows)]
    out: dict[tuple[str, str], bool] = {}
    for seq in session_sequences(probe):
        turns = seq.token_ids[1::2]
        leaf = rows[turns[-1]].id
        for index, m in zip(turns, seq.loss_mask[1::2], strict=True):
            out[(leaf, rows[index].id)] = bool(m)
    return out


def build_chains(rows: list[TurnRow], is_eval: bool = False) -> list[Chain]:
    """Every chain of a session (leaves of its turn tree, in the order samples.py takes them). An eval
    session's chains train nothing (a lease never hands out eval groups): their masks are 0."""
    by_id = {r.id: r for r in rows}
    extended = {r.parent_id for r in rows if r.parent_id}
    learned = {} if is_eval else _learned(rows)
    marks: dict[str, list[tuple[int, int, int]]] = {}  # per turn: (index in its reply, from, to)
    out: list[Chain] = []
    for leaf in (r for r in rows if r.id not in extended):
        path: list[TurnRow] = []
        node: TurnRow | None = leaf
        while node is not None:
            path.append(node)
            node = by_id.get(node.parent_id) if node.parent_id else None
        path.reverse()
        chain = Chain(leaf.id, [], eval=is_eval)
        at = 0
        for turn in path:
            start, cstart = at, at + len(turn.prompt_ids) // 4
            at = cstart + len(turn.completion_ids) // 4
            learn = learned.get((leaf.id, turn.id), False)
            chain.spans.append(Span(turn.id, turn.seq, start, cstart, at, turn, learn))
            if learn:
                chain.trained += at - cstart
            if turn.id not in marks:
                v = _fit(np.frombuffer(turn.versions, I32), at - cstart, -1)
                marks[turn.id] = [(int(i), int(v[i - 1]), int(v[i])) for i in np.flatnonzero(v[1:] != v[:-1]) + 1]
            chain.boundaries += [{"index": cstart + i, "from": a, "to": b, "turn_id": turn.id, "seq": turn.seq}
                                 for i, a, b in marks[turn.id]]
        chain.total = at
        chain.drift = _drift(path[0], rows, by_id)
        out.append(chain)
    return out


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
    end = min(chain.total, offset + limit)
    ids_a, lps_a, vers_a, mask_a = chain.window(offset, end)
    ids = ids_a.tolist()
    lps = [None if math.isnan(x) else round(x, 4) for x in lps_a.tolist()]
    return {"leaf_id": chain.leaf_id, "total": chain.total, "offset": offset, "limit": limit,
            "ids": ids, "text": text(ids), "logprobs": lps, "mask": mask_a.tolist(),
            "versions": vers_a.tolist(),
            "turns": [_span_json(s) for s in chain.spans if s.end > offset and s.start < end],
            "boundaries": [b for b in chain.boundaries if offset <= b["index"] < end],
            "drift": chain.drift,
            "drift_text": {"ours": text(chain.drift["ours"]), "theirs": text(chain.drift["theirs"])} if chain.drift else None}
