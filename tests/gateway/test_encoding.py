"""The piece-wise cached encoder gives exactly the ids of a whole-text encode (fast path vs reference)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from tokenizers import AddedToken

from gateway.encoding import CachedEncoder
from tests.gateway.text_tokenizers import chatml_tokenizer, llama31_tokenizer

WORDS = ["Paris", " weather", "\n", "\n\n", "  ", " ", "é", "日本", "1234", "{\"city\": \"Lisbon\"}", "'s", "\t",
         "<", ">", "|", "<|im", "end|>", "tool_call", "<think", "\r\n", "🙂", "ﬁ", "é"]  # NFC-changing forms


def random_texts(tokenizer: Any, n: int, seed: int) -> list[str]:
    """Texts that mix words, whitespace, unicode (some that NFC changes) and the tokenizer's added tokens,
    with added tokens glued to their neighbours and to each other."""
    rng = random.Random(seed)
    specials = [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]
    out = []
    for _ in range(n):
        parts = [rng.choice(specials) if rng.random() < 0.3 else rng.choice(WORDS) for _ in range(rng.randint(1, 30))]
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("make", [chatml_tokenizer, llama31_tokenizer], ids=["chatml", "llama31"])
def test_piecewise_encode_equals_whole_text_encode(make: Any) -> None:
    tok = make()
    enc = CachedEncoder(tok)
    assert enc.piecewise
    texts = random_texts(tok, 400, seed=1)
    for text in texts + texts:  # the second pass is served from the cache
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text


def test_rendered_chat_pieces_repeat_and_stay_exact() -> None:
    tok = chatml_tokenizer()
    enc = CachedEncoder(tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for i in range(20):
        text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": f"question {i}: {'x' * i}?"}],
                                       tools=tools, tokenize=False, add_generation_prompt=True)
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)


def test_a_space_stripping_added_token_falls_back_to_whole_text() -> None:
    tok = copy.deepcopy(chatml_tokenizer())
    tok.add_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    enc = CachedEncoder(tok)
    assert not enc.piecewise
    text = "a  <mask> b<|im_end|>\n  <mask>"
    assert enc.encode(text) == tok.encode(text, add_special_tokens=False)


def test_normalized_added_tokens_are_matched_inside_pieces() -> None:
    tok = copy.deepcopy(chatml_tokenizer())
    tok.add_tokens([AddedToken("zebra", normalized=True)])  # a plain added token (normalized by default)
    enc = CachedEncoder(tok)
    assert enc.piecewise
    for text in ["a zebra<|im_end|>zebra\nzebras", "<|im_start|>zebra<|im_end|>", "zeb<|im_end|>ra"]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text


def test_cache_stays_within_its_character_budget() -> None:
    tok = chatml_tokenizer()
    enc = CachedEncoder(tok, max_cached_chars=1000)
    texts = [f"message number {i} " * 5 for i in range(200)]
    for text in texts:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)
    assert enc._chars <= 1000
    assert enc.encode("y" * 5000) == tok.encode("y" * 5000, add_special_tokens=False)  # too big to keep
    assert "y" * 5000 not in enc._cache


def test_the_longest_added_token_wins_where_two_start_at_one_place() -> None:
    tok = copy.deepcopy(chatml_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|x|>", "<|x|><|y|>"]})
    enc = CachedEncoder(tok)
    assert enc.piecewise
    for text in ["a<|x|><|y|>b", "<|x|>", "<|x|><|x|><|y|><|y|>"]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text


def metaspace_tokenizer(prepend_scheme: str) -> Any:
    """A small Metaspace BPE (SentencePiece-style, as Mistral's and Llama 2's tokenizer.json) with specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"])
    tok.train_from_iterator(["Hello world", "hello there friend", "[INST] the quick brown fox"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_metaspace_tokenizers_encode_exactly(scheme: str) -> None:
    """"▁" prepended to the input's first piece only cannot be encoded piece by piece ("<s>Hello" would get
    "▁Hello"): such a tokenizer encodes whole texts; one that prepends to every piece stays piece-wise."""
    tok = metaspace_tokenizer(scheme)
    enc = CachedEncoder(tok)
    assert enc.piecewise is (scheme == "always")
    for text in ["<s>Hello", "<s>[INST] Hello there[/INST] world</s>", "Hello<s>", "[INST]the fox[/INST]"]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text


def test_many_added_tokens_split_exactly() -> None:
    """Llama 3 has 256 special tokens, most of them `<|reserved_special_token_N|>`: the split pattern is a trie
    over them (a flat alternation tried every branch at each "<"), still leftmost-longest."""
    tok = copy.deepcopy(llama31_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": [f"<|reserved_special_token_{i}|>" for i in range(250)]})
    enc = CachedEncoder(tok)
    assert enc.piecewise
    texts = [*random_texts(tok, 300, seed=3), "<|reserved_special_token_1|>0|>", "<|reserved_special_token_10|>",
             "<|reserved_special_token_2<|eot_id|>", "a<b<|<|eom_id|>|>"]
    for text in texts:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text
