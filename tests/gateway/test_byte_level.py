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


# --- what the word path leaves to the tokenizer (found by review: each failed before its guard) ------------------


def split_tokenizer(pattern: str, corpus: list[str]) -> Any:
    """A byte-level BPE whose pre-tokenizer is `Split(pattern, isolated)` then ByteLevel, trained on `corpus`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


MARKDOWN = ["# Title\n## Sub\nSome text here. It's a test, 123;\n- item\n" * 50, "hello world\n# heading\nmore text"] * 20


@pytest.mark.parametrize("pattern", [r"^#+ ", r"^- ", r"^[a-z]+", r"\.$", r";$", r"(?m)\n.", r"\A\w", r"[[a-z]]+",
                                     r"\pL+", r"\x{41}"])
def test_patterns_the_two_engines_read_differently_are_left_to_the_tokenizer(pattern: str) -> None:
    """onig (Ruby syntax) reads ^ and $ at every line, (?m) as dot-all, [[a-z]] as a union, \\pL as a class;
    Python's regex package otherwise. `x\\n# hello world` got other ids from the word path under ^#+ ."""
    from transformers import PreTrainedTokenizerFast

    tok = split_tokenizer(pattern, MARKDOWN)
    assert ByteLevelWords.build(tok) is None
    enc = CachedEncoder(PreTrainedTokenizerFast(tokenizer_object=tok))
    for text in ["x\n# hello world", "x\n- item;\nmore.", "A # b\n## c", "hello.\nworld;"]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("pattern", [r"(\p{L}+)|(\p{N}+)|(\s+)|([^\s\p{L}\p{N}]+)", r"(\w)(\w)"])
def test_patterns_with_groups_cut_by_whole_matches(pattern: str) -> None:
    """`findall` gives a pattern's groups, not its matches: such a pattern is cut match by match."""
    tok = split_tokenizer(pattern, ["hello world 123 foo", "abcd efgh"] * 10)
    words = ByteLevelWords.build(tok)
    assert words is not None
    for text in ["ab", "abcd", "hello world", "x 12 ;; y", "abc"]:
        assert words.encode(text) == tok.encode(text, add_special_tokens=False).ids, text


def test_a_tokenizer_that_fails_a_probe_is_not_taken_and_does_not_stop_the_encoder() -> None:
    """A BPE naming an unknown token that is not in its vocabulary, without the control bytes: its encode of
    a probe raises. The word path is not taken; the encoder is built as before."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, it's a test 123"] * 10, trainers.BpeTrainer(vocab_size=300,
                                                                                        show_progress=False))
    spec = json.loads(tok.to_str())
    spec["model"]["unk_token"] = "<unk>"
    tok = Tokenizer.from_str(json.dumps(spec))
    with pytest.raises(Exception, match="<unk>"):
        tok.encode("a\x00b", add_special_tokens=False)
    assert ByteLevelWords.build(tok) is None
    enc = CachedEncoder(PreTrainedTokenizerFast(tokenizer_object=tok))
    assert enc._words is None
    assert enc.encode("hello world") == tok.encode("hello world", add_special_tokens=False).ids


def test_long_words_are_not_kept_and_the_cache_is_bounded_by_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client can send words of any length: one of 256 characters or more is encoded each time (as tokenizers'
    own BPE cache does), and the words kept stay within MAX_WORD_CHARS characters."""
    monkeypatch.setattr(byte_level, "MAX_WORD_CHARS", 3000)
    tok = chatml_tokenizer()
    words = ByteLevelWords.build(tok.backend_tokenizer)
    assert words is not None
    long_word = "a" * 5000
    assert words.encode(long_word) == tok.backend_tokenizer.encode(long_word, add_special_tokens=False).ids
    assert long_word not in words._words
    for text in ascii_texts(300, seed=8):
        assert words.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
        assert words._chars == sum(map(len, words._words)) <= 3000
