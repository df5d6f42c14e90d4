"""How many characters of prompt text one token can stand for, where that is provable: a prompt with more
characters than the context could hold is refused before it is tokenized (`TurnService`)."""

from __future__ import annotations

import json
from typing import Any

NFC_MAX_EXPANSION = 4
"""No character's canonical decomposition is longer than 4 code points (U+1F82 and friends; checked against
Python's Unicode database in tests/gateway/test_limits.py). As NFD(s) == NFD(NFC(s)) and NFD never
shortens a text, NFC leaves at least a quarter of a text's characters."""


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of input text one token can stand for, where that is provable; else None.

    Provable for byte-level BPE (GPT-2, Llama 3, Qwen): the ByteLevel pre-tokenizer turns each byte of the
    normalized text into one symbol; with all 256 symbols in the vocabulary none is unknown or dropped, so
    the tokens together cover every byte, and one token covers at most as many bytes (so characters) as its
    vocabulary string has symbols. An added token covers its own text. Normalization may shorten the text:
    none is allowed, or NFC (at most NFC_MAX_EXPANSION characters become one). The pre-tokenizers allowed
    only split (none removes text). Anything else (SentencePiece, WordPiece, other normalizers, a slow
    tokenizer): None, and every prompt is tokenized before it is measured."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    model = backend.model
    if getattr(model, "continuing_subword_prefix", None) or getattr(model, "end_of_word_suffix", None):
        return None  # symbols after the first are looked up with an affix: they could be unknown
    factor = 1
    if backend.normalizer is not None:
        if json.loads(backend.normalizer.__getstate__()).get("type") != "NFC":
            return None
        factor = NFC_MAX_EXPANSION
    if backend.pre_tokenizer is None or not _only_splits_to_bytes(json.loads(backend.pre_tokenizer.__getstate__())):
        return None
    from tokenizers import pre_tokenizers

    vocab = tokenizer.get_vocab()  # with the added tokens
    if not all(symbol in vocab for symbol in pre_tokenizers.ByteLevel.alphabet()):
        return None
    return factor * max(map(len, vocab))


def _only_splits_to_bytes(node: dict[str, Any]) -> bool:
    """A pre-tokenizer made of splits that keep every character, with a ByteLevel in it."""
    found = False

    def ok(n: dict[str, Any]) -> bool:
        nonlocal found
        kind = n.get("type")
        if kind == "Sequence":
            return all(ok(child) for child in n.get("pretokenizers", []))
        if kind == "ByteLevel":
            found = True
            return True
        if kind in ("Split", "Punctuation"):
            return n.get("behavior") != "Removed"
        return kind == "Digits"

    return ok(node) and found
