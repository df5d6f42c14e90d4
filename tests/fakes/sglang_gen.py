"""The request-level half of the fake SGLang server (`tests.fakes.sglang`): validation as SGLang does
it, the token-by-token generation step, and the answer/chunk bodies. Pure functions over `Generation`;
the server half owns scheduling (pause, abort, delays) and HTTP."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos "
    "skip_special_tokens spaces_between_special_tokens no_stop_trim custom_params stream_interval "
    "logit_bias sampling_seed".split()
)
_CHECKS = [
    ("temperature", lambda v: v >= 0, "temperature must be non-negative"),
    ("top_p", lambda v: 0 < v <= 1, "top_p must be in (0, 1]"),
    ("top_k", lambda v: v == -1 or v >= 1, "top_k must be -1 (disable), or at least 1"),
    ("min_p", lambda v: 0 <= v <= 1, "min_p must be in [0, 1]"),
    ("max_new_tokens", lambda v: v >= 0, "max_new_tokens must be at least 0"),
    ("min_new_tokens", lambda v: v >= 0, "min_new_tokens must be at least 0"),
    ("n", lambda v: v >= 1, "n must be at least 1"),
]


@dataclass(eq=False)
class Generation:
    rid: str
    input_ids: list[int]
    sp: dict[str, Any]
    rng: random.Random
    script: list[int] | None
    cached: int
    top_n: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[list[Any]]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    abort_message: str | None = None
    version_at_abort: str | None = None
    """A real server answers an abort at once, before any weight update that follows it."""
    started: bool = False
    t0: float = field(default_factory=time.monotonic)


def bad(message: str) -> Response:
    return JSONResponse({"error": {"message": message}}, 400)


def abort_finish(message: str, *, running: bool) -> dict[str, Any]:
    """SGLang's abort reason; a request aborted while running also carries (null) status_code/err_type."""
    if running:
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    return {"type": "abort", "message": message}


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def validate(payload: dict[str, Any], context_length: int, max_input: int, legacy: bool) -> Response | None:
    """SGLang's 400s: empty input, unknown or bad sampling params, prompt over the context."""
    ids = payload.get("input_ids")
    if not isinstance(ids, list) or not ids or any(isinstance(p, list) and not p for p in ids):
        return bad("The input_ids must be a non-empty list of token ids (the fake has no tokenizer).")
    sp = payload.get("sampling_params") or {}
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        text = f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'"
        if legacy:
            return JSONResponse({"object": "error", "message": text, "code": 400}, 400)
        return JSONResponse({"error": text}, 400)
    for key, ok, message in _CHECKS:
        value = sp.get(key)
        if value is not None and (not isinstance(value, int | float) or not ok(value)):
            return bad(f"{message}, got {value!r}.")
    longest = max(len(p) for p in ids) if isinstance(ids[0], list) else len(ids)
    if longest > max_input:
        return bad(
            f"The input ({longest} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    max_new = sp.get("max_new_tokens")
    if max_new is not None and longest + max_new > context_length:
        return bad(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {longest + max_new} tokens: {longest} tokens from the input messages "
            f"and {max_new} tokens for the completion."
        )
    return None


def cached_prefix(history: Iterable[list[int]], ids: list[int]) -> int:
    """Prefix-cache hit: the longest shared prefix with a recent sequence (at least one token computes)."""
    best = 0
    for seq in history:
        n = min(len(seq), len(ids) - 1)
        i = 0
        while i < n and seq[i] == ids[i]:
            i += 1
        best = max(best, i)
    return best


def step(gen: Generation, vocab: range, eos_ids: frozenset[int]) -> None:
    """Produce one token (or finish at max_new_tokens = 0), and set the finish reason when done."""
    sp, pos = gen.sp, len(gen.output)
    max_new = 128 if sp.get("max_new_tokens") is None else sp["max_new_tokens"]
    if pos >= max_new:
        gen.finish = {"type": "length", "length": max_new}
        return
    token = gen.rng.choice(vocab)  # always drawn, so a script does not shift later draws
    logprob = -gen.rng.uniform(0.001, 4.999)
    if gen.script is not None and pos < len(gen.script):
        token = gen.script[pos]
    gen.output.append(token)
    gen.logprobs.append(logprob)
    if gen.top_n:  # alternatives that draw nothing from the RNG, so outputs do not depend on top_n
        others = [
            [logprob - 0.25 * j, vocab[(token + 7 * j) % len(vocab)], None] for j in range(1, gen.top_n)
        ]
        gen.top.append([[logprob, token, None], *others])
    stops = set() if sp.get("ignore_eos") else set(sp.get("stop_token_ids") or ()) | eos_ids
    if token in stops and pos + 1 >= (sp.get("min_new_tokens") or 0):
        gen.finish = {"type": "stop", "matched": token}
    elif pos + 1 >= max_new:
        gen.finish = {"type": "length", "length": max_new}


def render(
    gen: Generation, payload: dict[str, Any], *, since: int, lp_from: int, weight_version: str, text: bool
) -> dict[str, Any]:
    """An answer or stream chunk: output ids from `since`, logprobs from `lp_from` (0 = cumulative)."""
    meta: dict[str, Any] = {
        "id": gen.rid,
        "finish_reason": gen.finish,
        "prompt_tokens": len(gen.input_ids),
        "completion_tokens": len(gen.output),
        "cached_tokens": gen.cached,
        "weight_version": weight_version,
        "e2e_latency": time.monotonic() - gen.t0,
    }
    if payload.get("return_logprob"):
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(gen.logprobs[lp_from:], gen.output[lp_from:], strict=True)
        ]
        if gen.top_n:
            meta["output_top_logprobs"] = gen.top[lp_from:]
    ids = gen.output[since:]
    body: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    if text:  # stand-in detokenization; a matched stop token is not part of the text
        matched = (gen.finish or {}).get("matched")
        shown = ids[:-1] if matched is not None and ids and ids[-1] == matched else ids
        body["text"] = "".join(f"<{t}>" for t in shown)
    return body
