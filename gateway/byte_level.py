"""ASCII text to ids for byte-level BPE tokenizers, word by word, with each word's ids cached; ids to text by a
table of each token's bytes.

A byte-level BPE tokenizer (GPT-2's family: Qwen, Llama 3, DeepSeek, Mistral's Tekken, gpt-oss) encodes a piece
of text in three steps: normalize it (NFC or nothing), cut it into words with its pre-tokenizer's regex, then map
each word's UTF-8 bytes to printable characters and run BPE on that word alone. The words of agent traffic repeat
("Lisbon", " the", "\\n\\n", a JSON key), so once a word's ids are known, BPE is a dictionary hit. What is left is
the regex, and there tokenizers' Rust pre-tokenizer costs ~0.2 µs a character where the same pattern in the
`regex` package takes about a third of that. A 77-character user message whose words were seen before takes
~6 µs against ~21 µs by `encode_batch_fast`; one of words never seen costs about what tokenizers does (BPE on each
new word); a 2,400-character tool result 2-3x less.

Exactness: used only for pure-ASCII pieces, where the Unicode classes of the pattern (`\\p{L}`, `\\p{N}`, `\\s`)
cannot differ between the two regex engines' Unicode tables and NFC/NFKC change nothing; any other piece goes to
the tokenizer. Only a tokenizer whose parts are all read and understood qualifies (`ByteLevelWords.build`: the
normalizer, each pre-tokenizer, the BPE model's options, no added token matched after normalization), and then
only if its pattern holds no syntax that tokenizers' engine (onig, Ruby syntax) reads otherwise than the `regex`
package (`_DIVERGENT`: `^`/`$` are line anchors in one and text anchors in the other, nested classes, `(?m)`...)
and its ids agree with the tokenizer's own on every ASCII character in a set of contexts (`_PROBES`); any
difference and the tokenizer encodes everything, as before. Words of 256 characters or more are not kept, and
the words kept hold at most MAX_WORD_CHARS characters.

Decoding (`ByteLevelBytes`): tokenizers' ByteLevel decoder maps each token's characters back to bytes (a token
with a character outside the map, such as an added token's "｜", gives its UTF-8 as it is), joins them and
decodes the whole lossily (U+FFFD for each maximal invalid subsequence, which Python's "replace" handler does
too). A table of every id's bytes does the same in one join (~0.8 µs for a 30-token reply against ~2.4 µs measured
alone; the reply's decode was 1.7% of the gateway's profile); it is
taken only for a tokenizer whose decoder is that one alone and whose every id decodes alike both ways, and whose
decodes of id sequences that cut characters apart agree too.
"""

from __future__ import annotations

import json
import random
from typing import Any

import regex

_NORMALIZERS_IDENTICAL_ON_ASCII = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""ByteLevel's own regex when `use_regex` is true (tokenizers' `pre_tokenizers/byte_level.rs`)."""
MAX_WORD_CHARS = 2_000_000
"""Characters of the words whose ids are kept (a few tens of MB at most); the cache starts afresh when full."""
MAX_CACHED_WORD = 256
"""Longer words are encoded each time, not kept (tokenizers' BPE cache keeps none of 256 characters or more)."""

_DIVERGENT = regex.compile(r"""
    \\[AZzGhHKRXoOQE]        # anchors, \h (a horizontal space in Ruby's syntax, a hex digit in onig's), keep-out...
  | \\x\{ | \\[pP](?!\{)     # \x{41}, \pL: read otherwise, or not at all, by one of the two
  | \(\?[a-z-]*[msx]          # inline flags whose letters mean other things in onig (?m: dot-all)
  | &&                       # class intersection (onig) is a literal in Python's
  | (?<!\\)\$                  # end of line in onig, of the text in Python's
  | (?<![\\\[])\^               # the same for a start ([^...] negates a class, in both)
""", regex.VERBOSE)
"""Pattern syntax that onig (tokenizers' regex engine, Ruby syntax) and the `regex` package read differently, seen
by trying each; a pattern holding any of it is left to the tokenizer. Nested classes are checked apart."""


def _same_in_both(pattern: str) -> bool:
    """Whether a pre-tokenizer pattern holds none of the syntax the two engines read differently."""
    if _DIVERGENT.search(pattern):
        return False
    depth = 0
    escaped = False
    for c in pattern:  # a class inside a class: a union in onig, a literal "[" in Python's (without V1)
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "[":
            depth += 1
            if depth > 1:
                return False
        elif c == "]" and depth:
            depth -= 1
    return True


def _byte_map() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: each byte's printable stand-in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_CHAR_BYTES = {c: b for b, c in _byte_map().items()}


_ASCII_BYTES = {b: c for b, c in _byte_map().items() if b < 128}
"""`str.translate`'s table for an ASCII word: printable ASCII stays, control characters and space move to 256 up."""


def _state(part: Any) -> dict[str, Any] | None:
    if part is None:
        return None
    return dict(json.loads(part.__getstate__()))


class ByteLevelWords:
    def __init__(self, model: Any, patterns: list[regex.Pattern[str]]) -> None:
        self._tokenize = model.tokenize
        self._patterns = patterns
        self._words: dict[str, tuple[int, ...]] = {}
        self._chars = 0

    @classmethod
    def build(cls, backend: Any) -> ByteLevelWords | None:
        """For a tokenizers `Tokenizer` of the byte-level BPE form, checked against its own encodes; None otherwise."""
        try:
            words = cls._build(backend)
            if words is None:
                return None
            added = [str(t.content) for t in backend.get_added_tokens_decoder().values()]
            for probe in _PROBES:
                if any(t in probe for t in added):
                    continue  # never in a piece: the text is cut at added tokens first
                if words.encode(probe) != list(backend.encode(probe, add_special_tokens=False).ids):
                    return None
        except Exception:  # a part that cannot be read, or a model that cannot encode a probe: the tokenizer's
            return None
        words._words.clear()  # the probes' words are not the traffic's
        words._chars = 0
        return words

    @classmethod
    def _build(cls, backend: Any) -> ByteLevelWords | None:
        normalizer = _state(backend.normalizer)
        if normalizer is not None and normalizer.get("type") not in _NORMALIZERS_IDENTICAL_ON_ASCII:
            return None
        pre = _state(backend.pre_tokenizer)
        if pre is None:
            return None
        steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
        patterns: list[regex.Pattern[str]] = []
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            kind = step.get("type")
            if kind == "Split" and not last:
                pattern = step.get("pattern") or {}
                if step.get("behavior") != "Isolated" or step.get("invert"):
                    return None
                if "Regex" in pattern:
                    if not _same_in_both(pattern["Regex"]):
                        return None
                    patterns.append(regex.compile(pattern["Regex"]))
                elif pattern.get("String"):
                    patterns.append(regex.compile(regex.escape(pattern["String"])))
                else:
                    return None
            elif kind == "ByteLevel" and last:
                if step.get("add_prefix_space"):
                    return None
                if step.get("use_regex", True):
                    patterns.append(regex.compile(_GPT2_PATTERN))
            else:
                return None
        model = backend.model
        if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix \
                or model.end_of_word_suffix:
            return None
        if any(added.normalized for added in backend.get_added_tokens_decoder().values()):
            return None  # matched inside a piece after normalization: the tokenizer's own work
        return cls(model, patterns)

    def encode(self, piece: str) -> list[int]:
        """An ASCII piece (no added token's text in it) to ids, as the tokenizer encodes it."""
        words = [piece]
        for pattern in self._patterns:
            words = [w for word in words for w in _isolated(pattern, word)]
        cache = self._words
        out: list[int] = []
        for word in words:
            ids = cache.get(word)
            if ids is None:
                ids = tuple(t.id for t in self._tokenize(word.translate(_ASCII_BYTES)))
                if len(word) < MAX_CACHED_WORD:
                    if self._chars + len(word) > MAX_WORD_CHARS:
                        cache.clear()
                        self._chars = 0
                    cache[word] = ids
                    self._chars += len(word)
            out.extend(ids)
        return out


def _isolated(pattern: regex.Pattern[str], text: str) -> list[str]:
    """`text` cut as tokenizers' Split with `Isolated` behaviour cuts it: each match its own word, and the text
    between matches too; empty words dropped."""
    if not pattern.groups:  # findall gives the whole matches only where the pattern captures no group
        found: list[str] = pattern.findall(text)
        if sum(map(len, found)) == len(text):  # the matches cover the text (the usual case): no gaps to add
            return [w for w in found if w]
    out: list[str] = []
    pos = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start > pos:
            out.append(text[pos:start])
        if end > start:
            out.append(text[start:end])
        pos = end
    if pos < len(text):
        out.append(text[pos:])
    return out


def _probes() -> list[str]:
    chars = [chr(c) for c in range(128)]
    out = ["".join(chars), "".join(reversed(chars))]
    for c in chars:
        out += [c, c * 3, f"a{c}b", f" {c} ", f"1{c}2", f"\n{c}\n", f"{c}  x", f"x{c}{c}  ", f"A{c}'s", f"'{c}ll"]
    out += [
        "it's I'LL we'Re they'VE I'm he'd 'S 's", "12345 678 9", "a  \n\n  b\t\t c   ", "  x", "x   ", " \n \r\n\r \t",
        "{\"city\": \"Lisbon\", \"temp_c\": 15}", "def f(x):\n    return x  # done\n\n", "   \n\n\n   end", "...!!! ??",
        "snake_case CamelCase UPPER lower 3D 1st", "<tool call>\n</tool call>", "a\x00b\x01c\x7f", "\t\t\n \x0b\x0c\x1c\x1f",
    ]
    return out


_PROBES = _probes()


class ByteLevelBytes:
    """Ids to text as a tokenizers ByteLevel decoder gives it (special tokens kept)."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table

    @classmethod
    def build(cls, backend: Any, probes: int = 300) -> ByteLevelBytes | None:
        """For a tokenizers `Tokenizer` whose decoder is ByteLevel alone, checked id by id and on `probes` random
        sequences against its own decode; None otherwise."""
        try:
            decoder = _state(backend.decoder)
            if decoder is None or decoder.get("type") != "ByteLevel":
                return None
            size = int(backend.get_vocab_size(with_added_tokens=True))
            extra = [int(i) for i in backend.get_added_tokens_decoder()]
            size = max([size, *(i + 1 for i in extra)])  # an added token may sit past the vocabulary's size
            table = [_token_bytes(backend.id_to_token(i)) for i in range(size)]
            out = cls(table)
            ids = range(len(table))
            for i in ids:
                if out.decode([i]) != backend.decode([i], skip_special_tokens=False):
                    return None
            rng = random.Random(0)
            multibyte = [i for i, raw in enumerate(table) if raw and not raw.isascii()] or list(ids)
            seqs = [[rng.choice(multibyte), i, rng.choice(multibyte)] for i in extra]  # added tokens amid cut characters
            for _ in range(probes):
                seqs.append([rng.choice(multibyte) if rng.random() < 0.7 else rng.randrange(len(table))
                             for _ in range(rng.randint(1, 24))])
            for seq in seqs:
                if out.decode(seq) != backend.decode(seq, skip_special_tokens=False):
                    return None
        except Exception:  # a part that cannot be read, or a decode that raises: the tokenizer decodes
            return None
        return out

    def decode(self, ids: list[int]) -> str:
        """Ids to text; an id outside the table raises IndexError (the tokenizer's own decode is then asked)."""
        table = self._table
        return b"".join([table[i] for i in ids]).decode("utf-8", "replace")


def _token_bytes(token: str | None) -> bytes:
    if token is None:
        return b""
    try:
        return bytes([_CHAR_BYTES[c] for c in token])
    except KeyError:
        return token.encode()
