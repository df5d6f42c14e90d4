"""ASCII pieces encoded word by word (gateway/byte_level.py) give exactly the tokenizer's own ids; tokenizers whose
parts are not all understood, or whose ids disagree on the probes, keep the tokenizer's encode."""

from __future__ import annotations

import copy
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, normalizers

from gateway import byte_level
from gateway.byte_level import ByteLevelBytes, ByteLevelWords
from gateway.encoding import CachedEncoder
from tests.gateway.test_encoding import metaspace_tokenizer, random_texts
from tests.gateway.text_tokenizers import chatml_tokenizer, llama31_tokenizer
from tests.realfiles import BY_NAME, Unavailable
from tests.realfiles import tokenizer as real_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", " The", "  ", "\n", "\n\n", "123", "4", "'s", "'LL", "'ve", "x_y", '{"a": 1}', "\t", " \r\n", "   x",
         "CamelCase", "!!", "?", " -- ", "#", "def f():"]


def ascii_texts(n: int, seed: int) -> list[str]:
    """Words, whitespace runs, contractions and every ASCII character (controls included) glued at random."""
    rng = random.Random(seed)
    return ["".join(chr(rng.randrange(128)) if rng.random() < 0.3 else rng.choice(WORDS)
                    for _ in range(rng.randint(1, 40))) for _ in range(n)]


def source_texts() -> list[str]:
    """ASCII paragraphs of this repository's docs and code: text as agents send it (prose, JSON, Python)."""
    out = []
    for path in sorted([*ROOT.joinpath("docs").glob("*.md"), *ROOT.joinpath("gateway").glob("*.py")]):
        out += [p for p in path.read_text().split("\n\n") if p.isascii()]
    return out


def words_used(enc: CachedEncoder) -> int:
    assert enc._words is not None
    return len(enc._words._words)


@pytest.mark.parametrize("make", [chatml_tokenizer, llama31_tokenizer], ids=["chatml", "llama31"])
def test_ascii_pieces_by_words_equal_the_tokenizers_ids(make: Any) -> None:
    tok = make()
    enc = CachedEncoder(tok)
    assert enc._words is not None
    texts = ascii_texts(3000, seed=0) + source_texts() + random_texts(tok, 300, seed=2)  # the last: added tokens, unicode
    for text in texts:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), repr(text)
    assert words_used(enc) > 100  # the word path was taken


def test_every_pair_of_ascii_characters() -> None:
    """All 16,384 two-character strings, and each between letters and spaces: where the two regex engines could
    disagree on a class (`\\s` and the controls, `\\p{N}`, `'` before a letter), it would show here."""
    tok = chatml_tokenizer()
    words = ByteLevelWords.build(tok.backend_tokenizer)
    assert words is not None
    backend = tok.backend_tokenizer
    for a, b in itertools.product(map(chr, range(128)), repeat=2):
        for text in (a + b, f"x{a}{b} y", f" {a}{b}{b}"):
            assert words.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)


def test_non_ascii_pieces_go_to_the_tokenizer() -> None:
    tok = chatml_tokenizer()
    enc = CachedEncoder(tok)
    for text in ["café déjà", "日本語 text", "e\u0301", "ﬁne 🙂", "a\u00a0b", "x\u2028y"]:  # NFC changes, NBSP, LS
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), repr(text)
    assert words_used(enc) == 0


def test_the_word_cache_starts_afresh_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(byte_level, "MAX_WORDS", 50)
    tok = chatml_tokenizer()
    enc = CachedEncoder(tok, max_cached_chars=0)  # no piece cache: every text reaches the words
    for i, text in enumerate(ascii_texts(400, seed=3)):
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), repr(text)
        assert words_used(enc) <= 50 + len(text), i


def with_normalizer(normalizer: Any) -> Any:
    tok = copy.deepcopy(chatml_tokenizer())
    tok.backend_tokenizer.normalizer = normalizer
    return tok


@pytest.mark.parametrize("tok", [
    pytest.param(with_normalizer(normalizers.Lowercase()), id="lowercase"),
    pytest.param(metaspace_tokenizer("always"), id="metaspace"),
])
def test_tokenizers_of_other_forms_keep_their_own_encode(tok: Any) -> None:
    assert ByteLevelWords.build(tok.backend_tokenizer) is None
    enc = CachedEncoder(tok)
    assert enc._words is None
    for text in ascii_texts(50, seed=4):
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), repr(text)


def test_an_added_token_matched_after_normalization_keeps_the_tokenizers_encode() -> None:
    tok = copy.deepcopy(chatml_tokenizer())
    tok.add_tokens([AddedToken("zebra", normalized=True)])
    enc = CachedEncoder(tok)
    assert enc.piecewise and enc._words is None
    assert enc.encode("a zebra<|im_end|>zebras") == tok.encode("a zebra<|im_end|>zebras", add_special_tokens=False)


def test_a_pattern_that_cuts_otherwise_fails_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes are the guard: a word pattern that differs from the tokenizer's (here ByteLevel's own regex
    without the alternative that leaves a run of spaces' last space to the next word) is caught by them and the
    tokenizer encodes."""
    tok = copy.deepcopy(chatml_tokenizer())
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert ByteLevelWords.build(tok.backend_tokenizer) is not None
    monkeypatch.setattr(byte_level, "_GPT2_PATTERN", byte_level._GPT2_PATTERN.replace(r"\s+(?!\S)|", ""))
    assert ByteLevelWords.build(tok.backend_tokenizer) is None


@pytest.mark.parametrize("family", ["Qwen2.5", "Llama 3.1", "DeepSeek V3.1", "Mistral Nemo", "Granite 3.3"])
def test_real_vocabularies(family: str) -> None:
    """The byte-level vocabularies of llama.cpp's corpus (Qwen2's, Llama 3's, DeepSeek LLM's, GPT-2's,
    StarCoder's; three regexes between them) take the word path and give their tokenizer's ids, and the table of
    their ids' bytes gives their tokenizer's text."""
    try:
        tok = real_tokenizer(BY_NAME[family])
    except Unavailable as e:
        pytest.skip(str(e))
    enc = CachedEncoder(tok)
    assert enc._words is not None
    for text in ascii_texts(1000, seed=5) + source_texts()[::3]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), repr(text)
    table = ByteLevelBytes.build(tok.backend_tokenizer)
    assert table is not None
    for ids in decode_cases(tok, 1000, seed=7):
        assert table.decode(ids) == tok.backend_tokenizer.decode(ids, skip_special_tokens=False), ids


# --- ids to text -----------------------------------------------------------------------------------------------


def random_ids(table_size: int, multibyte: list[int], added: list[int], n: int, seed: int) -> list[list[int]]:
    """Id sequences that cut characters apart (tokens holding part of a UTF-8 sequence), with added tokens."""
    rng = random.Random(seed)
    pools = [multibyte, added or multibyte, range(table_size)]
    return [[rng.choice(rng.choices(pools, weights=[6, 1, 3])[0]) for _ in range(rng.randint(0, 40))] for _ in range(n)]


def decode_cases(tok: Any, n: int, seed: int) -> list[list[int]]:
    backend = tok.backend_tokenizer
    size = backend.get_vocab_size(with_added_tokens=True)
    multibyte = [i for i in range(size) if not all(ord(c) < 0x100 and c.isprintable() for c in backend.id_to_token(i))]
    added = [int(i) for i in backend.get_added_tokens_decoder()]
    return random_ids(size, multibyte, added, n, seed)


@pytest.mark.parametrize("make", [chatml_tokenizer, llama31_tokenizer], ids=["chatml", "llama31"])
def test_decode_by_table_equals_the_tokenizers_decode(make: Any) -> None:
    from gateway.templating import ChatTemplate

    tok = make()
    ct = ChatTemplate(tok)
    assert ct.warm_decoder() is not None
    backend = tok.backend_tokenizer
    for ids in decode_cases(tok, 3000, seed=6):
        want = backend.decode(ids, skip_special_tokens=False).replace("\x00", "\ufffd")
        assert ct.decode(ids) == want, ids


def test_ids_the_table_has_not_go_to_the_tokenizer() -> None:
    """A model's vocabulary may be padded past the tokenizer's (Qwen: 151,936 against 151,665 ids): the tokenizer
    skips such an id, and so does decode; a negative id is the tokenizer's to refuse, as before."""
    from gateway.templating import ChatTemplate

    tok = chatml_tokenizer()
    ct = ChatTemplate(tok)
    size = tok.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    ids = tok.encode("hello there", add_special_tokens=False)
    assert ct.decode([*ids, size + 5, *ids]) == tok.backend_tokenizer.decode([*ids, size + 5, *ids])
    with pytest.raises(OverflowError):
        tok.backend_tokenizer.decode([-1])
    with pytest.raises(OverflowError):
        ct.decode([*ids, -1])


def test_a_tokenizer_with_another_decoder_decodes_itself() -> None:
    from gateway.templating import ChatTemplate

    tok = metaspace_tokenizer("always")
    tok.chat_template = chatml_tokenizer().chat_template
    ct = ChatTemplate(tok, end_of_turn="</s>")
    assert ct.warm_decoder() is None
    ids = tok.encode("Hello there friend", add_special_tokens=False)
    assert ct.decode(ids) == tok.backend_tokenizer.decode(ids, skip_special_tokens=False)
