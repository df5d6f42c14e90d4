"""Constrained decoding for the engine: SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag`.

Compiled with llguidance (SGLang offers it as `--grammar-backend llguidance`; its default is xgrammar, which
needs triton on Linux) against the model's tokenizer. A request's grammar is compiled before it is queued (a
bad one is a 400 with SGLang's message, `Failed to compile <kind> grammar: ...`); compiled grammars are
cached by (kind, text), as GRPO siblings send the same one. Each running row with a grammar has its own
matcher (a copy of the cached one); `GrammarRows.mask` writes the allowed tokens of every such row into the
step's logits (-inf elsewhere), rows without one untouched. What the mask does to logprobs is the caller's
(engine/sampling.py): they are taken from the masked logits, as SGLang's are (docs/sglang-contract.md
"Constrained decoding").

How each key is compiled: `json_schema` by llguidance's JSON schema compiler, `regex` as a regex, `ebnf`
(GBNF, as xgrammar reads it) through llguidance's GBNF-to-Lark converter, `structural_tag` (both forms, the
subset of formats gateway/tool_grammar.py sends) translated here into a Lark grammar with inline `%json`.

As SGLang's default backend (xgrammar's strict mode) has it, not as llguidance alone: an object schema
with `properties` allows no other properties unless it sets `additionalProperties`; text a grammar forces
may be written in any tokens that spell it (llguidance's `no_forcing`). Differences from SGLang, on purpose:
JSON (alone or inside a structural tag) allows at most MAX_WHITESPACE whitespace characters in a row; the
grammar's stop tokens are the request's stop ids and the model's eos ids (SGLang: the model's eos ids).
docs/sglang-contract.md "Constrained decoding" lists the rest.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from engine.sampling import InvalidRequest, SamplingParams
from rollway_common.json_schema_check import unsupported_reason

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 256
"""Compiled grammars kept (by kind and text); a tool set's grammar is one entry."""
MAX_WHITESPACE = 1
"""Whitespace characters in a row that JSON may hold (SGLang: any number): a weak model would otherwise
spend its budget on blank space, and a reply cut off there parses as nothing."""
ANY_JSON = "$$ANY$$"
"""SGLang's json_schema value for "any JSON" (what its OpenAI server sends for json_object)."""
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{1,{MAX_WHITESPACE}}}",
    # Keywords llguidance does not implement are ignored, as xgrammar ignores them, not a 400.
    "lenient": True,
}
"""llguidance's JSON compile options (its `x-guidance`) for every JSON schema the engine compiles."""
OPTIONS = '%llguidance {"no_forcing": true}'
"""llguidance's grammar options, first in every grammar the engine compiles."""


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of a request's grammar; more than one of json_schema, regex, ebnf and structural_tag is refused,
    as SGLang 0.5.23's `SamplingParams.verify` (`srt/sampling/sampling_params.py`) refuses it."""
    given = [(k, v) for k, v in (("json", params.json_schema), ("regex", params.regex), ("ebnf", params.ebnf),
                                 ("structural_tag", params.structural_tag)) if v is not None]
    if len(given) > 1:
        raise InvalidRequest(EXCLUSIVE)
    return given[0] if given else None


EXCLUSIVE = "Only one of json_schema, regex, ebnf, or structural_tag can be set."
"""SGLang 0.5.23's words (`SamplingParams.verify`)."""


class GrammarError(InvalidRequest):
    """A grammar that does not compile. SGLang finds out in its scheduler (`Req.set_finish_with_abort`): a
    non-streamed call gets a 400, a streamed one a 200 stream whose one chunk finishes with an abort carrying
    `status_code` 400 (engine/server.py `_grammar_abort`)."""


@dataclass(frozen=True, slots=True)
class Compiled:
    """A compiled grammar: a matcher in its start state, copied for each request."""

    matcher: llguidance.LLMatcher
    eos_ids: tuple[int, ...]
    """The tokenizer's eos ids, which llguidance allows once the grammar may end (the rows' stop ids rule)."""


class GrammarCompiler:
    """llguidance's tokenizer for one tokenizer and vocabulary, with a cache of compiled grammars."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        import llguidance.hf  # only once a request brings a grammar

        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(cast(Any, tokenizer), n_vocab=vocab_size)  # a fast one
        self._eos_ids = tuple(self._tokenizer.eos_tokens)
        # Added tokens marked special (ChatML's, the tiny model's <tool_call>): llguidance matches them only
        # by id, never as text; a structural tag's literal text may also be written with them.
        self._specials = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()
                          if t.special and t.content and i < vocab_size and i not in self._eos_ids}
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, key: tuple[str, str]) -> Compiled:
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
        except Exception as exc:  # ValueError, KeyError, TypeError, the converter's own: all the client's
            raise GrammarError(f"Failed to compile {kind} grammar: {exc}") from exc
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Compiled:
        import llguidance

        if kind == "json":
            # "$$ANY$$": an object or an array, as xgrammar's builtin JSON grammar (SGLang's) has it.
            schema: Any = {"type": ["object", "array"]} if text == ANY_JSON else json.loads(text)
            reason = None if text == ANY_JSON else unsupported_reason(schema)
            if reason is not None:  # SGLang 0.5.23 refuses what xgrammar would not enforce (dispatch_json)
                raise ValueError(reason)
            lark = f"start: %json {json.dumps(_json_schema(schema))}"
        elif kind == "regex":
            lark = f"start: /{llguidance.regex_to_lark(text, 'dws')}/"  # \d \w \s ASCII, as xgrammar's
        elif kind == "ebnf":
            lark = _gbnf_to_lark(text)
        else:
            lark = structural_tag_lark(text, self._specials)
        # no_forcing: text the grammar forces may be written in any tokens that spell it, as with xgrammar
        # (llguidance's default allows only the text's canonical tokenization there).
        grammar = llguidance.LLMatcher.grammar_from_lark(f"{OPTIONS}\n{lark}")
        # Building the matcher builds the grammar's lexer and parser (off the event loop: the caller's thread).
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return Compiled(matcher, self._eos_ids)


def _gbnf_to_lark(text: str) -> str:
    """SGLang's `ebnf` (GBNF, with a `root` rule) as llguidance's Lark."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    # The converter reads a rule with nothing after `::=` as the empty string; xgrammar refuses it.
    empty = re.search(r"^\s*([\w-]+)\s*::=[ \t]*(#[^\n]*)?(\n\s*)*(?=[\w-]+\s*::=|\Z)", text, re.MULTILINE)
    if empty:
        raise ValueError(f"rule {empty.group(1)!r} has no body")
    return gbnf_to_lark(text)


# --- JSON schemas ----------------------------------------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedItems", "contains",
               "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _json_schema(schema: Any) -> dict[str, Any]:
    """`schema` with the engine's JSON options (whitespace) and xgrammar's strict objects."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    strict = _strict(schema)
    strict["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return strict


def _strict(schema: Any) -> Any:
    """A copy of `schema` where an object schema that names properties and says nothing of others allows none."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(sub) for sub in out[key]]
    # As xgrammar's strict mode: an object schema with `properties` (not a bare {"type": "object"}).
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


# --- structural tags -------------------------------------------------------------------------------

_ANY_TEXT = r"/(?s:.*)/"


def structural_tag_lark(text: str, specials: dict[str, int] | None = None) -> str:
    """An SGLang `structural_tag` (JSON text, legacy or current form) as llguidance's Lark grammar;
    ValueError naming what is not supported. `specials`: special tokens by text, which a tag's literal
    text may be written with (as xgrammar, which reads them as their text, allows)."""
    tag = json.loads(text)
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object")
    lark = _Lark(specials or {})
    if tag.get("structures") is not None:  # the legacy form: {"structures": [...], "triggers": [...]}
        start = lark.legacy(tag)
    elif isinstance(tag.get("format"), dict):
        start = lark.format(tag["format"])
    else:
        raise ValueError("structural_tag needs 'format' (or the legacy 'structures' and 'triggers')")
    return "\n".join([f"start: {start}", *lark.rules]) + "\n"


@dataclass
class _Lark:
    """Rules of the Lark grammar a structural tag is translated into."""

    specials: dict[str, int]
    rules: list[str] = field(default_factory=list)

    def rule(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def json(self, schema: Any) -> str:
        return self.rule("%json " + json.dumps(_json_schema(schema)))

    def legacy(self, tag: dict[str, Any]) -> str:
        """Free text; at a trigger, the structure whose begin starts with it; free text again; ..."""
        triggers = tag.get("triggers")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError("structural_tag's 'triggers' must be a list of non-empty strings")
        structures = tag["structures"]
        if not isinstance(structures, list) or not structures:
            raise ValueError("structural_tag's 'structures' must be a non-empty list")
        calls = []
        for s in structures:
            begin, end = _string(s, "begin"), _string(s, "end")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger starts the structure beginning {begin!r}")
            head, rest = self.until(trigger), self.lit(begin[len(trigger):])
            calls.append(self.rule(f"{head} {rest} {self.json(s.get('schema') or {})} {self.lit(end)}"))
        text = self.rule(_ANY_TEXT)
        one = "(" + " | ".join(calls) + ")"
        return f"{one}{'+' if tag.get('at_least_one') else '*'} {text}"

    def format(self, node: Any) -> str:
        """A current-form format as a Lark expression."""
        if not isinstance(node, dict):
            raise ValueError("a structural_tag format must be a JSON object")
        kind = node.get("type")
        if kind == "const_string":
            return self.lit(_string(node, "value"))
        if kind == "json_schema":
            return self.json(node.get("json_schema"))
        if kind == "regex":
            import llguidance

            return f"/{llguidance.regex_to_lark(_string(node, 'pattern'), 'dws')}/"
        if kind == "any_text":
            return _ANY_TEXT
        if kind in ("sequence", "or"):
            elements = node.get("elements")
            if not isinstance(elements, list) or not elements:
                raise ValueError(f"structural_tag format {kind!r} needs a non-empty 'elements' list")
            joiner = " " if kind == "sequence" else " | "
            return "(" + joiner.join(self.format(e) for e in elements) + ")"
        if kind == "tag":
            return self.tag(node)
        if kind == "tags_with_separator":
            tags = node.get("tags")
            if not isinstance(tags, list) or not tags:
                raise ValueError("structural_tag format 'tags_with_separator' needs a non-empty 'tags' list")
            one = "(" + " | ".join(self.tag(t) for t in tags) + ")"
            separator = node.get("separator", "")
            if not isinstance(separator, str):
                raise ValueError("structural_tag format 'tags_with_separator' needs a string 'separator'")
            if node.get("stop_after_first"):
                calls = one
            else:
                calls = f"{one} ({self.lit(separator)} {one})*" if separator else f"{one}+"
            return calls if node.get("at_least_one") else f"({calls})?"
        raise ValueError(f"structural_tag format type {kind!r} is not supported by this engine "
                         "(supported: const_string, json_schema, regex, any_text, sequence, or, tag, "
                         "tags_with_separator)")

    def tag(self, node: Any) -> str:
        if not isinstance(node, dict) or node.get("type", "tag") != "tag":
            raise ValueError("structural_tag expected a format of type 'tag'")
        begin, end, content = _string(node, "begin"), _string(node, "end"), node.get("content")
        if isinstance(content, dict) and content.get("type") == "any_text" and end:
            # Any text up to the first `end` (it holds no `end` before): a lazy lexeme ending with it.
            return f"{self.lit(begin)} {self.until(end)}"
        return f"{self.lit(begin)} {self.format(content)} {self.lit(end)}"

    def until(self, end: str) -> str:
        """Any text up to the first `end` and `end` itself: a lazy lexeme; or, where `end` starts with a
        special token, any text and that token."""
        text = self.rule(f"{_ANY_TEXT} {json.dumps(end)}", "[lazy]")
        special = next((t for t in sorted(self.specials, key=len, reverse=True) if end.startswith(t)), None)
        if special is None:
            return text
        return f"({text} | {_ANY_TEXT} <[{self.specials[special]}]> {self.lit(end[len(special):])})"

    def lit(self, text: str) -> str:
        """`text` as Lark (nothing for the empty string), a special token's text also as the token."""
        if not text:
            return ""
        if not self.specials:
            return json.dumps(text)
        parts, pos = [], 0
        for m in re.finditer("|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True)), text):
            if m.start() > pos:
                parts.append(json.dumps(text[pos:m.start()]))
            parts.append(f"({json.dumps(m.group())} | <[{self.specials[m.group()]}]>)")
            pos = m.end()
        if pos < len(text):
            parts.append(json.dumps(text[pos:]))
        return " ".join(parts)


def _string(node: Any, key: str) -> str:
    value = node.get(key) if isinstance(node, dict) else None
    if not isinstance(value, str):
        raise ValueError(f"structural_tag expected a string {key!r}")
    return value


# --- decoding --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Matcher:
    """One request's grammar state; the grammar ends on any of `ends`."""

    state: llguidance.LLMatcher
    ends: list[int]
    """The request's stop ids (the tokenizer's eos ids when there are none): allowed once the grammar may end."""
    others: list[int]
    """The tokenizer's eos ids not among `ends`: never allowed (llguidance would allow them at the end)."""


class GrammarRows:
    """The grammar matchers of one step's rows (None for a row without one)."""

    def __init__(self, matchers: Sequence[Matcher | None]) -> None:
        self.matchers = list(matchers)
        self.rows = [i for i, m in enumerate(self.matchers) if m is not None]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (B, V) float32 with every token the row's grammar forbids at -inf (in place)."""
        vocab = logits.shape[-1]
        for i in self.rows:
            m = self.matchers[i]
            assert m is not None
            # One byte per token, 0 where forbidden (computed by llguidance without the GIL): faster here than
            # its bitmask and llguidance.torch's apply kernel (torch.compile: the compiler's ~7 s import, then
            # ~1 min of compiling on a CPU's first call).
            forbidden = torch.frombuffer(bytearray(m.state.compute_logit_bias()), dtype=torch.uint8)[:vocab].eq(0)
            # The grammar's end is the row's stop ids, not the tokenizer's eos (which llguidance would allow).
            if m.others:
                forbidden[m.others] = True
            if m.ends:
                forbidden[m.ends] = not m.state.is_accepting()
            logits[i].masked_fill_(forbidden, float("-inf"))
        return logits


def new_matcher(compiled: Compiled, stop_ids: Sequence[int]) -> Matcher:
    """A fresh state of `compiled` for one request; the grammar ends on any of `stop_ids` (the tokenizer's
    eos ids when there are none)."""
    ends = sorted(stop_ids) or list(compiled.eos_ids)
    return Matcher(compiled.matcher.deep_copy(), ends, [t for t in compiled.eos_ids if t not in ends])


def accept(matcher: Matcher, token: int) -> bool | None:
    """Advance a row's grammar by its sampled token: True when the grammar has ended (its stop token came),
    False when it goes on, None when it refused the token (only when the mask left nothing to sample, e.g.
    `min_new_tokens` banning the one stop token a finished grammar allows)."""
    if token in matcher.ends:
        return True if matcher.state.is_accepting() else None
    if token in matcher.others or not matcher.state.consume_token(token):
        return None
    return False
