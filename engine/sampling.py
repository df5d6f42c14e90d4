"""Per-request sampling for the engine: parameter parsing, penalties, and one batched sampling step.

Logprobs follow SGLang: log_softmax(logits / T) of the chosen token, taken after penalties and before
top-p/top-k/min-p filtering, with T = 1 for greedy requests (temperature 0).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_GREEDY_EPS = 1e-6


class InvalidRequest(ValueError):
    """Bad input from the client: answered with 400 {"error": {"message": ...}}."""


class UnknownSamplingKey(InvalidRequest):
    """An unknown key inside `sampling_params`: answered with 400 {"error": "<text>"} as SGLang 0.5.23 does."""


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's `sampling_params`; a `null` value in the request means the default."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None

    @classmethod
    def from_request(cls, raw: Mapping[str, Any] | None) -> SamplingParams:
        raw = raw or {}
        if not isinstance(raw, Mapping):
            raise InvalidRequest("sampling_params must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise UnknownSamplingKey(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        values = {k: v for k, v in raw.items() if v is not None}
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        for key in ("stop", "stop_token_ids"):
            if key in values:
                values[key] = tuple(values[key])
        try:
            params = cls(**values)
        except TypeError as exc:
            raise InvalidRequest(str(exc)) from exc
        params.verify()
        return params

    def verify(self) -> None:
        checks = [
            (
                isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
                "max_new_tokens must be >= 0",
            ),
            (_number(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (
                isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
                "top_k must be -1 or >= 1",
            ),
            (_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                _number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "frequency_penalty in [-2, 2]",
            ),
            (
                _number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "presence_penalty in [-2, 2]",
            ),
            (
                _number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
                "repetition_penalty in (0, 2]",
            ),
            (
                isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
                "min_new_tokens must be >= 0",
            ),
            (isinstance(self.n, int) and self.n >= 1, "n must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be integers"),
            (
                self.sampling_seed is None or isinstance(self.sampling_seed, int),
                "sampling_seed must be an int",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"{name} must be a string")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported by rollway engine")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    @property
    def filters(self) -> bool:
        return self.top_p < 1.0 or self.top_k != -1 or self.min_p > 0.0

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def make_generator(self) -> torch.Generator:
        seed = self.sampling_seed if self.sampling_seed is not None else secrets.randbits(63)
        return torch.Generator().manual_seed(seed)


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StepOutput:
    """One sampled token per row, with its logprob and (when asked) the top logprobs of the row."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    banned: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalties (frequency, presence, repetition over output tokens) and banned ids (min_new_tokens). (B, V)"""
    if not any(p.penalized for p in params) and not any(banned):
        return logits
    logits = logits.clone()
    for row, (p, out, ban) in enumerate(zip(params, outputs, banned, strict=True)):
        if p.penalized and out:
            ids, counts = torch.tensor(out).unique(return_counts=True)
            vals = logits[row, ids]
            if p.repetition_penalty != 1:
                vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            vals = vals - p.frequency_penalty * counts.to(vals.dtype) - p.presence_penalty
            logits[row, ids] = vals
        if ban:
            logits[row, list(ban)] = -math.inf
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    top_logprobs_num: Sequence[int],
    masked: bool = False,
) -> StepOutput:
    """Choose one token per row of `logits` (B, V), fp32, each row with its own parameters and generator.

    `masked`: some rows' logits carry a grammar's mask (-inf). Their logprobs are then those of the masked
    distribution, the one the token was drawn from, as SGLang reports them (it masks before its sampler)."""
    logits = logits.float()
    temps = torch.tensor([p.logprob_temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logprobs = torch.log_softmax(logits / temps, dim=-1)  # (B, V)
    tokens = logits.argmax(dim=-1)  # greedy rows keep this
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        probs = logprobs[sampled].exp()
        if any(params[i].filters for i in sampled):
            order, probs = _filter(probs, [params[i] for i in sampled])
        else:
            order = None
        # Inverse-CDF sampling with one uniform per row from the row's own generator: seeded rows repeat
        # whatever else is in the batch, and it is one vectorised search instead of B multinomial calls.
        uniform = torch.cat(
            [torch.rand(1, generator=generators[row], dtype=torch.float64) for row in sampled]
        )
        cdf = probs.double().cumsum(dim=-1)  # (S, V)
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).clamp_(
            max=cdf.shape[-1] - 1
        )
        if order is not None:
            picks = order.gather(1, picks)
        tokens[sampled] = picks.squeeze(1)
    if masked:  # tokens a grammar forbids are -inf; clamped as SGLang does, so answers stay finite JSON
        logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top: list[list[tuple[float, int]] | None] = [None] * len(params)
    if any(top_logprobs_num):
        k = min(max(top_logprobs_num), logprobs.shape[-1])
        values, ids = logprobs.topk(k, dim=-1)
        for row, num in enumerate(top_logprobs_num):
            if num:
                top[row] = list(zip(values[row, :num].tolist(), ids[row, :num].tolist(), strict=True))
    return StepOutput(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)


def _filter(probs: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k, top-p and min-p per row over probabilities sorted high to low; returns (order, kept probs)."""
    vocab = probs.shape[-1]
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    drop = (cumulative - sorted_probs) > top_p
    drop |= torch.arange(vocab).unsqueeze(0) >= top_k
    drop |= sorted_probs < min_p * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return order, sorted_probs.masked_fill(drop, 0.0)
