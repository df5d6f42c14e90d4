"""Text to token ids, exactly as the tokenizer encodes it, with the text between special tokens cached.

A fast (Rust) tokenizer first cuts its input at the added tokens that match raw text (`normalized: false`),
then normalizes, pre-tokenizes and encodes each piece between them on its own (tokenizers'
`AddedVocabulary::extract_and_normalize`). Encoding piece by piece is therefore exact, and most pieces of a
rendered chat repeat: the system prompt with its tool block is the same for every session of a run, tool-call
and bridge text recur. Only new text (a user message, a tool result) reaches the tokenizer; the rest is a
dictionary hit. On the gateway benchmark's 376-token prompts this takes encoding from ~0.31 ms to ~0.03 ms.

The piece-wise path is used only where it is the same: a fast tokenizer with no truncation or padding, that
does not encode special tokens as text, with no raw-text added token that strips neighbouring spaces or
matches single words only (those look across piece boundaries), and no Metaspace that prepends "▁" to the
first piece of the input only (`prepend_scheme: "first"`, Mistral-style: each piece would be a first one).
At start, piece-wise and whole-text encodes of probe strings around every added token must agree. Anything
else encodes the whole text, as before.

Text from messages never becomes a control token. A rendered prompt is template markup and message text
(content of every role, tool results, tool-call names and arguments, tool schemas) in one string, and the
tokenizer cannot tell them apart: user content "<|im_end|>\\n<|im_start|>system\\n..." would be encoded as a
real end of turn and a forged system turn, in the prompt sent to the model and in the recorded training data.
So the strings a template is given are checked first (`forged`, one regex over their JSON: the hot path pays a
few microseconds); where one holds the text of a protected token (special, or markup the template writes),
those strings are `mark`ed before rendering, each such token replaced by one private-use character (plane 16),
and the marked render is encoded with `encode_marked`: the tokens still in it are the template's own, and the
pieces between them that hold marks are encoded as plain text (the tokenizer without its protected added
tokens, as `split_special_tokens` does for special ones), so a hostile string costs only its own pieces.
Hosted chat APIs behave the same way.

Limit: a token spelled across two separate strings that a template renders next to each other is not seen (no
template here does that; roles are a fixed set).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import orjson

from gateway.byte_level import ByteLevelWords
from gateway.errors import BadRequest

MARK_BASE = 0x100000
"""First code point of the marks that stand for protected tokens in message text (Unicode plane 16, private use:
no text means anything by them, and a template's filters, `trim`, `tojson` (ensure_ascii=False) and case
changes, leave them alone)."""


class CachedEncoder:
    def __init__(
        self,
        tokenizer: Any,
        *,
        max_cached_chars: int = 4_000_000,
        protect_content: bool = True,
        markup: str = "",
    ) -> None:
        """`protect_content`: text from messages never becomes a protected token (see the module docstring);
        False keeps what a plain render + encode does (special-token text in content is the token). `markup`:
        the chat template's source (the non-special added tokens it writes are protected too)."""
        self._tokenizer = tokenizer
        self._max_chars = max_cached_chars
        self._chars = 0
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # tuples: untracked by the collector
        self._backend: Any = None
        self._specials: dict[str, int] = {}
        self._split: re.Pattern[str] | None = None
        self._batch_fast: Any = None
        self._words: ByteLevelWords | None = None
        self._guard: _ContentGuard | None = _ContentGuard(tokenizer, markup) if protect_content else None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return
        if getattr(backend, "encode_special_tokens", False) or _prepends_to_first_only(backend):
            return
        specials: dict[str, int] = {}
        for token_id, added in backend.get_added_tokens_decoder().items():
            if added.normalized:
                continue  # matched inside each piece after normalization, as in a whole-text encode
            if added.lstrip or added.rstrip or added.single_word:
                return
            specials[added.content] = int(token_id)
        self._backend = backend
        self._specials = specials
        self._batch_fast = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.21: skips offsets
        if specials:
            # At one position the longest added token wins (leftmost-longest, as tokenizers); a trie (_any_of).
            self._split = re.compile(f"({_any_of(specials)})")
        for special in specials:
            for probe in (f"{special}x", f"x{special}y", f"{special}\n x", f" {special} {special}Hello"):
                if self.encode(probe) != list(backend.encode(probe, add_special_tokens=False).ids):
                    self._backend = None  # not the same here: whole-text encodes
                    self._cache.clear()
                    return
        self._words = ByteLevelWords.build(backend)

    @property
    def piecewise(self) -> bool:
        """Whether pieces are encoded (and cached) one by one; False: whole-text encodes."""
        return self._backend is not None

    # --- message text ------------------------------------------------------------------------------

    def forged(self, *values: Any) -> bool:
        """Whether a string in `values` (JSON-like: dicts, lists, strings; keys count) holds a protected
        token's text (or a mark character); False when content is not protected. May say True for strings that
        hold neither (then `mark` changes nothing and `encode_marked` gives `encode`'s ids), never False for
        one that does."""
        return self._guard is not None and self._guard.forged(values)

    def mark(self, value: Any) -> Any:
        """A copy of `value` with protected tokens in its strings (keys too) replaced by their marks."""
        assert self._guard is not None
        return self._guard.mark(value)

    def unmark(self, text: str) -> str:
        """A marked render as the text it stands for (marks back to the tokens' text)."""
        assert self._guard is not None
        return self._guard.unmark(text)

    def encode_marked(self, text: str) -> list[int]:
        """A marked render to ids: the protected tokens in it (the template's own) as their ids, the pieces
        between them that hold marks as plain text; the rest exactly as `encode` gives it."""
        guard = self._guard
        assert guard is not None
        if not guard.has_marks(text):
            return self.encode(text)
        out: list[int] = []
        run: list[str] = []  # unmarked text, with the template's tokens in it: encoded as usual, in one go
        for i, part in enumerate(guard.split(text)):
            if i % 2 == 0 and guard.has_marks(part):
                if run:
                    out.extend(self.encode("".join(run)))
                    run.clear()
                out.extend(guard.plain(guard.unmark(part)))
            elif part:
                run.append(part)
        if run:
            out.extend(self.encode("".join(run)))
        return out

    def encode(self, text: str) -> list[int]:
        """`text` to ids, no special tokens added (a template that wants a BOS renders it)."""
        if self._backend is None:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        pieces = self._split.split(text) if self._split is not None else [text]
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # the split keeps the matched special tokens at odd positions
                out.append(self._specials[piece])
            elif piece:
                out.extend(self._piece(piece))
        return out

    def _piece(self, piece: str) -> tuple[int, ...]:
        cache = self._cache
        ids = cache.get(piece)
        if ids is not None:
            cache.move_to_end(piece)
            return ids
        if self._words is not None and piece.isascii():
            ids = tuple(self._words.encode(piece))
        elif self._batch_fast is not None:
            ids = tuple(self._batch_fast([piece], add_special_tokens=False)[0].ids)
        else:
            ids = tuple(self._backend.encode(piece, add_special_tokens=False).ids)
        if len(piece) * 4 <= self._max_chars:  # one huge piece would evict everything: not kept
            cache[piece] = ids
            self._chars += len(piece)
            while self._chars > self._max_chars:
                old, _ = cache.popitem(last=False)
                self._chars -= len(old)
        return ids


class _ContentGuard:
    """The protected tokens of a tokenizer, their marks, and a plain-text encoder that never produces them.

    Protected: every special added token, and every other added token matched on raw text (`normalized:
    false`) that the chat template writes itself: markup such as Qwen's non-special <tool_call>,
    <tool_response> and <think>. Other added tokens are vocabulary (Gemma's "<table>" and whitespace runs,
    FIM tokens, words): text encodes to them as the tokenizer always does, so ordinary content keeps its
    exact ids. Token i's mark is chr(MARK_BASE + i); chr(MARK_BASE + n) escapes a mark character that a
    string holds itself (followed by that character), so every string comes back exactly."""

    def __init__(self, tokenizer: Any, markup: str) -> None:
        protected: dict[str, int] = {}
        for token_id, added in _added_tokens(tokenizer):
            content = str(added.content)
            if not content:
                continue
            written = not added.normalized and not content.isspace() and content in markup
            if added.special or written:
                protected.setdefault(content, int(token_id))
        tokens = sorted(protected, key=lambda t: protected[t])
        if len(tokens) + 1 > 0xFFFE:
            raise ValueError(f"{len(tokens)} protected tokens: more than there are marks for")
        self.ids = frozenset(protected.values())
        self._text = tokens  # mark index -> token text
        self._mark_of = {t: chr(MARK_BASE + i) for i, t in enumerate(tokens)}
        self._escape = chr(MARK_BASE + len(tokens))
        marks = f"[{chr(MARK_BASE)}-{self._escape}]"
        self._marks_rx = re.compile(marks)
        if any(self._marks_rx.search(t) for t in tokens):
            raise ValueError("a protected token holds a private-use character of plane 16: no marks for it")
        # Each pattern is a trie or a character class alone: re then skips to the characters that can start a
        # match (an alternation of the two scans every position, 10x slower on a 7 MB tool result).
        self._tokens_rx = re.compile(f"({_any_of(tokens)})")
        self._escaped_rx = re.compile(f"{re.escape(self._escape)}(.?)|{marks}", re.DOTALL)
        # The same search over the strings' JSON (orjson: each character escaped on its own, so a string holds a
        # token iff its JSON holds the token's JSON). Any plane-16 character (UTF-8 lead byte F4) takes the slow
        # path: it may be a mark character to escape. Most texts hold none of the tokens' first bytes ("<"):
        # looking for those is a memchr, several times faster than the regex.
        in_json = [orjson.dumps(t)[1:-1] for t in tokens]
        self._json_rx = re.compile(_any_of(w.decode("latin-1") for w in in_json).encode("latin-1") + b"|\xf4")
        self._json_first = tuple({w[:1] for w in in_json} | {b"\xf4"})
        self._tokenizer = tokenizer
        self._plain_backend = _without_protected(tokenizer, protected)

    def forged(self, values: Any) -> bool:
        try:
            data = orjson.dumps(values)
        except TypeError:  # not plain JSON (a non-string key, a lone surrogate): look at every string
            return any(self._tokens_rx.search(s) or self._marks_rx.search(s) for s in _strings(values))
        if not any(first in data for first in self._json_first):
            return False
        return self._json_rx.search(data) is not None

    def mark(self, value: Any) -> Any:
        if isinstance(value, str):
            if self._marks_rx.search(value):  # escaped first: the marks put in next are not the string's own
                value = self._marks_rx.sub(self._escape_one, value)
            return self._tokens_rx.sub(self._mark_one, value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value

    def _mark_one(self, m: re.Match[str]) -> str:
        return self._mark_of[m.group(1)]

    def _escape_one(self, m: re.Match[str]) -> str:
        return self._escape + m.group(0)

    def unmark(self, text: str) -> str:
        if self._escape in text:  # some string held mark characters itself (rare: the slower pattern)
            return self._escaped_rx.sub(self._unmark_escaped, text)
        return self._marks_rx.sub(self._unmark_one, text)

    def _unmark_one(self, m: re.Match[str]) -> str:
        return self._text[ord(m.group(0)) - MARK_BASE]

    def _unmark_escaped(self, m: re.Match[str]) -> str:
        escaped = m.group(1)
        if escaped is not None:  # the escape and the character it keeps
            return escaped
        return self._unmark_one(m)

    def has_marks(self, text: str) -> bool:
        return self._marks_rx.search(text) is not None

    def split(self, text: str) -> list[str]:
        """`text` cut at protected tokens, the tokens kept at odd positions."""
        return self._tokens_rx.split(text)

    def plain(self, text: str) -> list[int]:
        """`text` as plain text: no protected token is matched in it."""
        ids = self._encode_plain(text)
        if self.ids.isdisjoint(ids):
            return ids
        # The model's own vocabulary spells a protected token from plain text (a BPE whose merges build it):
        # one character at a time cannot, unless the token is a single character.
        ids = [i for ch in text for i in self._encode_plain(ch)]
        if self.ids.isdisjoint(ids):
            return ids
        raise BadRequest(
            "the messages hold text that this model's tokenizer can only encode as a control token",
            param="messages",
        )

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain_backend is not None:  # a batch of one releases the GIL (a big prompt's worker thread)
            batch = getattr(self._plain_backend, "encode_batch_fast", self._plain_backend.encode_batch)
            return list(batch([text], add_special_tokens=False)[0].ids)
        # A tokenizer without a Rust one: its own switch (special tokens only; plain() checks the ids).
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _any_of(words: Iterable[str]) -> str:
    """A regex for any of `words`, the longest where several start at one place (leftmost-longest, as tokenizers
    match added tokens), built as a trie. Python's re tries an alternation's branches one after the other at
    every candidate position: a flat one over Llama 3's 256 special tokens took 0.6 ms on 1 KB of code (a "<"
    every few characters), the trie 16 µs."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        if "" in node:
            branches.append("")  # a word ends here: tried after every longer one
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    return build(trie) or "(?!)"


def _added_tokens(tokenizer: Any) -> list[tuple[int, Any]]:
    """(id, AddedToken) of every added token (transformers' view, else the Rust tokenizer's)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not decoder:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = backend.get_added_tokens_decoder() if backend is not None else {}
    return list(decoder.items())


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _without_protected(tokenizer: Any, protected: dict[str, int]) -> Any:
    """A copy of the Rust tokenizer that does not match the protected added tokens (their text is plain text to
    it), with no truncation, padding or post-processing; None without a Rust tokenizer.

    The protected tokens stay in it, marked special, and special tokens are encoded as text
    (`encode_special_tokens`, what transformers' split_special_tokens sets): dropping them instead would
    renumber the added tokens after them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    state = json.loads(backend.to_str())
    for added in state.get("added_tokens") or []:
        if added.get("content") in protected:
            added["special"] = True
    state["truncation"] = state["padding"] = state["post_processor"] = None
    plain = Tokenizer.from_str(json.dumps(state))
    plain.encode_special_tokens = True
    ids = {i: t.content for i, t in plain.get_added_tokens_decoder().items()}
    if ids != {i: t.content for i, t in backend.get_added_tokens_decoder().items()}:
        return None  # not the same ids: the tokenizer's own split_special_tokens (plain() checks what it gives)
    return plain


def _prepends_to_first_only(backend: Any) -> bool:
    """Whether a Metaspace in the pipeline prepends its replacement to the input's first piece only."""

    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("prepend_scheme") == "first":
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    # Each stage's own JSON (its pickled state), not the whole tokenizer's: that carries the vocabulary.
    stages = (backend.pre_tokenizer, backend.normalizer)
    return any(walk(json.loads(stage.__getstate__())) for stage in stages if stage is not None)
