"""The token view's chains without a server: the loss mask of every chain is exactly the one
`gateway.samples.session_sequences` gives the trainer (branches, new chains, disconnected partials, constrained
turns, per-turn rewards, and chains whose tokens coincide), pages are slices of the whole chain, and version
changes inside a reply are found at their index."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gateway.samples import session_sequences
from gateway.store.store import TurnRow
from gateway.ui.tokens import TokenText, build_chains, page
from rollway_common.wire import pack


def _tree(rng: random.Random, vocab: int, max_len: int) -> list[TurnRow]:
    rows: list[TurnRow] = []
    for i in range(rng.randrange(1, 9)):
        parent = rng.choice([None] + [r.id for r in rows]) if rows and rng.random() < 0.8 else None
        n_prompt, n_reply = rng.randrange(0, max_len), rng.randrange(0, max_len)
        versions = sorted(rng.randrange(3) for _ in range(n_reply))
        rows.append(TurnRow(
            id=f"t{i}", seq=i + 1, parent_id=parent, request={}, reply={},
            prompt_ids=pack([rng.randrange(vocab) for _ in range(n_prompt)], "int32"),
            completion_ids=pack([rng.randrange(vocab) for _ in range(n_reply)], "int32"),
            logprobs=pack([-rng.random() for _ in range(n_reply)], "float32"), versions=pack(versions, "int32"),
            temperature=1.0, finish_reason="stop", continuity="extends" if parent else "new-chain",
            chain_reason=None if parent else "edited_message", client_disconnected=rng.random() < 0.3,
            reward=rng.choice([None, None, 1.0]), prompt_len=0, timings={}, constrained=rng.random() < 0.2))
    return rows


@pytest.mark.parametrize("vocab", [3, 10**6])  # 3: chains that coincide token for token
def test_mask_is_session_sequences(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(300):
        rows = _tree(rng, vocab, 6)
        chains = build_chains(rows)
        trained = []
        for c in chains:
            ids, lps, versions, mask = c.window(0, c.total)
            assert len(ids) == c.total and c.trained == int(mask.sum())
            if mask.any():
                trained.append((ids.tolist(), mask.tolist()))
            for sp in c.spans:  # logprobs and versions are the stored ones on every reply token
                reply = slice(sp.completion_start, sp.end)
                assert np.array_equal(versions[reply], np.frombuffer(sp.row.versions, "<i4"))
                assert np.isnan(lps[sp.start:sp.completion_start]).all()
        assert trained == [(s.token_ids, s.loss_mask) for s in session_sequences(rows)]


def test_pages_slice_the_chain_and_mark_versions() -> None:
    rows = _tree(random.Random(7), 10**6, 40)
    text = TokenText(None)
    for c in build_chains(rows):
        ids, lps, versions, mask = c.window(0, c.total)
        for offset, limit in ((0, 5), (3, 17), (c.total // 2, 8192), (c.total, 4)):
            p = page(c, text, offset, limit)
            end = min(c.total, offset + limit)
            assert p["ids"] == ids[offset:end].tolist() and p["mask"] == mask[offset:end].tolist()
            assert p["versions"] == versions[offset:end].tolist() and p["total"] == c.total
            assert [x is None for x in p["logprobs"]] == np.isnan(lps[offset:end]).tolist()
        for b in c.boundaries:
            assert versions[b["index"] - 1] == b["from"] and versions[b["index"]] == b["to"]
        changes = [i for i in range(1, c.total) if versions[i] != versions[i - 1] and versions[i - 1] >= 0
                   and versions[i] >= 0 and not any(sp.completion_start == i for sp in c.spans)]
        assert [b["index"] for b in c.boundaries] == changes
