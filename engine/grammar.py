"""Constrained decoding for the engine: SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag`.

Compiled with xgrammar (SGLang's default grammar backend) against the model's tokenizer, so the tokens a
grammar allows are those SGLang's would. A request's grammar is compiled before it is queued (a bad one is
a 400 with SGLang's message, `Failed to compile <kind> grammar: ...`); compiled grammars are cached by
(kind, text), as GRPO siblings send the same one. Each running row with a grammar has its own matcher;
`GrammarRows.mask` writes the allowed tokens of every such row into the step's logits (-inf elsewhere),
rows without one untouched. What the mask does to logprobs is the caller's (engine/sampling.py): they are
taken from the masked logits, as SGLang's are (docs/sglang-contract.md "Constrained decoding").

Differences from SGLang, on purpose: JSON (alone or inside a structural tag) allows at most MAX_WHITESPACE
whitespace characters in a row; the matcher's stop tokens are the request's stop ids and
the model's eos ids (SGLang: the model's eos ids).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.sampling import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

CACHE_SIZE = 256
"""Compiled grammars kept (by kind and text); a tool set's grammar is one entry."""
MAX_WHITESPACE = 1
"""Whitespace characters in a row that JSON may hold (SGLang: any number): a weak model would otherwise
spend its budget on blank space, and a reply cut off there parses as nothing."""
ANY_JSON = "$$ANY$$"
"""SGLang's json_schema value for "any JSON" (what its OpenAI server sends for json_object)."""


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of a request's grammar in SGLang's precedence (json_schema, regex, ebnf, structural_tag);
    more than one of the first three is refused, as SGLang's `SamplingParams.verify` does."""
    given = [(k, v) for k, v in (("json", params.json_schema), ("regex", params.regex), ("ebnf", params.ebnf))
             if v is not None]
    if len(given) > 1:
        raise InvalidRequest("Only one of regex, json_schema, or ebnf can be set.")
    if given:
        return given[0]
    if params.structural_tag is not None:
        return ("structural_tag", params.structural_tag)
    return None


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and vocabulary, with a cache of compiled grammars."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        import xgrammar as xgr  # only once a request brings a grammar: it costs ~0.35 s to import

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        """The compiled grammar of (kind, text); InvalidRequest (400) when it does not compile."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, text = key
        if not isinstance(text, str):
            raise InvalidRequest(f"{'json_schema' if kind == 'json' else kind} must be a string")
        try:
            compiled = self._compile(kind, text)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own errors: all the client's
            raise InvalidRequest(f"Failed to compile {kind} grammar: {exc}") from exc
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if kind == "json":
            if text == ANY_JSON:
                return self._compiler.compile_builtin_json_grammar()
            json.loads(text)  # a clear message for text that is not JSON at all
            return self._compiler.compile_json_schema(text, max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "ebnf":
            return self._compiler.compile_grammar(text)
        tag = json.loads(text)
        if not isinstance(tag, dict):
            raise ValueError("structural_tag must be a JSON object")
        if tag.get("structures") is not None:  # the legacy form: {"structures": [...], "triggers": [...]}
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"])
                     for s in tag["structures"]]
            legacy = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
            triggered: Any = legacy.format  # a TriggeredTagsFormat
            triggered.at_least_one = bool(tag.get("at_least_one", False))
            return self._compiler.compile_structural_tag(legacy)
        if not isinstance(tag.get("format"), dict):
            raise ValueError("structural_tag needs 'format' (or the legacy 'structures' and 'triggers')")
        _bound_whitespace(tag["format"])
        return self._compiler.compile_structural_tag(json.dumps(tag))



def _bound_whitespace(node: Any) -> None:
    """Give every json_schema element of a structural tag's format MAX_WHITESPACE unless it sets its own."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            node.setdefault("max_whitespace_cnt", MAX_WHITESPACE)
        for value in node.values():
            _bound_whitespace(value)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value)


class GrammarRows:
    """The grammar matchers of one step's rows (None for a row without one)."""

    def __init__(self, matchers: Sequence[Any]) -> None:
        self.matchers = list(matchers)
        self.rows = [i for i, m in enumerate(self.matchers) if m is not None]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (B, V) float32 with every token the row's grammar forbids at -inf (in place)."""
        if not self.rows:
            return logits
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(self.matchers), logits.shape[-1])
        for i in self.rows:
            self.matchers[i].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)
        return logits


def new_matcher(compiled: xgr.CompiledGrammar, stop_ids: Sequence[int]) -> xgr.GrammarMatcher:
    """A fresh state of `compiled` for one request; the grammar ends on any of `stop_ids`."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids) or None)


def accept(matcher: Any, token: int) -> bool | None:
    """Advance a row's grammar by its sampled token: True when the grammar has ended (its stop token came),
    False when it goes on, None when it refused the token (only when the mask left nothing to sample, e.g.
    `min_new_tokens` banning the one stop token a finished grammar allows)."""
    if not matcher.accept_token(token):
        return None
    return bool(matcher.is_terminated())
