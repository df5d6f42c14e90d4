"""The /generate wire format: request parsing and response building, as in docs/sglang-contract.md.

`parse_generate` turns a request body into one `GenerateSpec` per generation (a batch of prompts or
`n > 1` gives several); `Result` accumulates the scheduler's deltas for one generation and renders the
final response or a streaming chunk (cumulative or incremental).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.grammar import grammar_key
from engine.sampling import InvalidRequest, SamplingParams
from engine.scheduler import Delta, LogprobEntry, TopEntry


@dataclass(frozen=True)
class GenerateSpec:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    return_text_in_logprobs: bool
    stream: bool = False
    grammar: Any = None
    """The compiled grammar of `params` (set by the server once compiled: engine/grammar.py)."""


@dataclass(frozen=True)
class GenerateCall:
    specs: list[GenerateSpec]
    batched: bool  # the response is a list
    stream: bool


def parse_generate(
    body: Any, tokenizer: PreTrainedTokenizerBase, context_length: int, vocab_size: int
) -> GenerateCall:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    prompts = _prompts(body, tokenizer)
    ids = body.get("input_ids")
    batched = _is_batch(ids) if ids is not None else isinstance(body.get("text"), list)
    params = SamplingParams.from_request(body.get("sampling_params"))
    grammar_key(params)  # more than one grammar: refused before anything else, as SGLang does
    rid = body.get("rid")
    rids: list[Any] = (
        rid if batched and isinstance(rid, list) else [None] * len(prompts) if batched else [rid]
    )
    if len(rids) != len(prompts):
        raise InvalidRequest("rid must have one entry per prompt")
    start = _int(body, "logprob_start_len", -1)
    top_n = _int(body, "top_logprobs_num", 0)
    stream = bool(body.get("stream") or False)
    specs = []
    for ids, rid in zip(prompts, rids, strict=True):
        _check_prompt(ids, params, context_length, vocab_size)
        base = str(rid) if rid is not None else uuid.uuid4().hex
        for i in range(params.n):
            rid_i = base if params.n == 1 else f"{base}_{i}"
            spec = GenerateSpec(
                rid=rid_i,
                input_ids=ids,
                params=params,
                return_logprob=bool(body.get("return_logprob") or False),
                top_logprobs_num=top_n,
                logprob_start_len=start,
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
                stream=stream,
            )
            specs.append(spec)
    if stream and len(specs) > 1:
        raise InvalidRequest("streaming is supported for one generation per request")
    return GenerateCall(specs=specs, batched=batched or params.n > 1, stream=stream)


def _int(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{key} must be an integer")
    return value


def _is_batch(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)


def _prompts(body: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if text is None:
            raise InvalidRequest("either input_ids or text is required")
        texts = text if isinstance(text, list) else [text]
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    if not isinstance(ids, list) or not ids:
        raise InvalidRequest("input_ids must be a non-empty list")
    batch = ids if _is_batch(ids) else [ids]
    for prompt in batch:
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("input_ids must be non-empty lists of integers")
    return batch


def _check_prompt(ids: list[int], params: SamplingParams, context_length: int, vocab_size: int) -> None:
    if any(t < 0 or t >= vocab_size for t in ids):
        raise InvalidRequest(f"input_ids must be in [0, {vocab_size})")
    if len(ids) >= context_length:
        raise InvalidRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if len(ids) + params.max_new_tokens > context_length:
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the "
            f"input messages and {params.max_new_tokens} tokens for the completion."
        )


@dataclass
class Result:
    """Everything one generation has produced so far."""

    spec: GenerateSpec
    tokenizer: PreTrainedTokenizerBase
    started: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopEntry] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top: list[TopEntry] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    weight_version: str = "default"
    error: str | None = None
    sent_tokens: int = 0  # incremental streaming: what earlier chunks carried
    sent_text: str = ""

    def add(self, delta: Delta) -> None:
        self.output_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.top += delta.top
        self.input_logprobs += delta.input_logprobs or []
        self.input_top += delta.input_top or []
        self.weight_version = delta.weight_version
        self.finish = delta.finish or self.finish
        self.error = delta.error or self.error

    @property
    def done(self) -> bool:
        return self.finish is not None

    def text(self) -> str:
        params = self.spec.params
        ids = self.output_ids
        matched = self.finish.get("matched") if self.finish and self.finish["type"] == "stop" else None
        if isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        assert isinstance(text, str)
        if isinstance(matched, str) and not params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text

    def response(self) -> dict[str, Any]:
        """The final (or cumulative streaming) form: whole text, ids and logprobs so far."""
        return self._render(0, self.text())

    def incremental_chunk(self) -> dict[str, Any]:
        """Only what the previous chunk did not carry; text is held back while it ends mid-character."""
        text = self.text()
        if not self.done and text.endswith("\ufffd"):
            text = self.sent_text
        new_text = text[len(self.sent_text) :] if text.startswith(self.sent_text) else text
        chunk = self._render(self.sent_tokens, new_text)
        self.sent_tokens, self.sent_text = len(self.output_ids), text
        return chunk

    def _render(self, since: int, text: str) -> dict[str, Any]:
        spec = self.spec
        meta: dict[str, Any] = {
            "id": spec.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(spec.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": round(time.monotonic() - self.started, 6),
        }
        if spec.return_logprob:
            meta["input_token_logprobs"] = (
                [self._triple(lp, t) for lp, t in self.input_logprobs] if since == 0 else []
            )
            meta["output_token_logprobs"] = [
                self._triple(lp, t)
                for lp, t in zip(self.logprobs[since:], self.output_ids[since:], strict=True)
            ]
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            if spec.top_logprobs_num:
                meta["input_top_logprobs"] = [self._tops(e) for e in self.input_top] if since == 0 else []
                meta["output_top_logprobs"] = [self._tops(e) for e in self.top[since:]]
        return {"text": text, "output_ids": self.output_ids[since:], "meta_info": meta}

    def _triple(self, logprob: float | None, token: int) -> list[Any]:
        text = self.tokenizer.decode([token]) if self.spec.return_text_in_logprobs else None
        return [logprob, token, text]

    def _tops(self, entry: TopEntry) -> list[list[Any]] | None:
        return None if entry is None else [self._triple(lp, t) for lp, t in entry]
