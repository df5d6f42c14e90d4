"""OpenAI wire models the gateway accepts, in the order of the OpenAI docs.

Requests are validated with pydantic (a wrong type is a 400, never a 422) in strict mode, as OpenAI's API
does: `"max_tokens": true` or `"stream": "yes"` is a 400, not 1 and True; numbers must be finite (`"NaN"`,
`"Infinity"` and overflowing literals are refused: a NaN reward once left a group open forever, an infinite
one fed infinite returns to the trainer). Unknown fields are accepted, ignored and logged once per field
name, for at most `MAX_LOGGED_UNKNOWN` names per process (`note_unknown_fields`). Replies are built as plain
dicts in the route modules: they are only ever serialised, and dict building is the cheapest path on the hot
route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.errors import BadRequest
from rollway_common.wire import INT32_MAX

log = logging.getLogger("rollway.gateway")
_seen_unknown: set[str] = set()
MAX_LOGGED_UNKNOWN = 100
"""Distinct unknown field names logged per process: a client inventing names can't grow the log (or this set)
without bound."""
INT64_MAX = 2**63 - 1
MAX_ABS_REWARD = 1e6
"""Rewards (session, turn, group) are refused outside [-1e6, 1e6]: the trainer computes returns and advantages
in float32 (max ~3.4e38), where a reward of 1e308 (finite in JSON) became `inf` in a lease, and sums and
variances of rewards past ~1e154 overflow float64 in the viewer's statistics. No reward scheme needs more."""
Reward = Annotated[float, Field(ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Strict(BaseModel):
    """rollway's own REST bodies: strict types, finite numbers, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def note_unknown_fields(model: BaseModel, where: str) -> None:
    """Log each unknown request field once per process (they are accepted and ignored)."""
    extra = model.model_extra or {}
    for name in extra:
        key = f"{where}.{name[:64]}"
        if key not in _seen_unknown and len(_seen_unknown) < MAX_LOGGED_UNKNOWN:
            _seen_unknown.add(key)
            log.info("ignoring unknown request field %s", key)
            if len(_seen_unknown) == MAX_LOGGED_UNKNOWN:
                log.info("%d unknown field names logged; not logging more", MAX_LOGGED_UNKNOWN)


Rule = tuple[Callable[[Any], bool], str]
"""(does this value ask for something?, why the gateway refuses it)."""


def refuse_unsupported(model: BaseModel, rules: Mapping[str, Rule]) -> None:
    """400 for a field, declared or unknown, whose value asks for what the gateway does not do, where ignoring
    it would answer something other than what the client asked (docs/conformance-openai.md)."""
    extra = model.model_extra
    declared = type(model).model_fields
    for name, (asks, why) in rules.items():
        if name in declared:
            value = getattr(model, name)
        elif extra:
            value = extra.get(name)
        else:
            continue
        if value is not None and asks(value):
            raise BadRequest(f"{name} is not supported: {why}", param=name)


def _nonzero(v: Any) -> bool:
    return not (isinstance(v, int | float) and not isinstance(v, bool) and v == 0)


_PENALTY = "the group's sampling policy decides how tokens are sampled (a penalty would change the behaviour " \
           "policy that the recorded logprobs and the trainer assume); send 0 or leave it out"
_BIAS = "biasing logits would change the behaviour policy that the recorded logprobs and the trainer assume"
CHAT_REFUSED: dict[str, Rule] = {
    "frequency_penalty": (_nonzero, _PENALTY),
    "presence_penalty": (_nonzero, _PENALTY),
    "logit_bias": (bool, _BIAS),
    "functions": (bool, "the deprecated functions list is not read; send tools"),
    "function_call": (lambda v: True, "the deprecated function_call is not read; send tool_choice"),
    "modalities": (lambda v: v != ["text"], "only text output is supported"),
    "audio": (lambda v: True, "only text output is supported"),
    "web_search_options": (lambda v: True, "there is no web search behind this gateway"),
}
COMPLETIONS_REFUSED: dict[str, Rule] = {
    "echo": (bool, "the prompt is not echoed; it is the turn's prompt_ids in the session record"),
    "suffix": (bool, "insertion (a suffix after the completion) is not supported"),
    "best_of": (lambda v: v != 1, "each sample is its own session (POST /v1/groups)"),
    "frequency_penalty": (_nonzero, _PENALTY),
    "presence_penalty": (_nonzero, _PENALTY),
    "logit_bias": (bool, _BIAS),
}
RESPONSES_REFUSED: dict[str, Rule] = {
    "background": (bool, "background responses need stored responses; this endpoint is stateless"),
    "conversation": (lambda v: True, "this endpoint is stateless: send the whole conversation as input"),
    "prompt": (lambda v: True, "stored prompt templates are not supported; send instructions and input"),
    "top_logprobs": (_nonzero, "logprobs are not returned by the Responses route (use chat completions)"),
    "include": (lambda v: isinstance(v, list) and "message.output_text.logprobs" in v,
                "logprobs are not returned by the Responses route (use chat completions)"),
}


# --- chat completions -------------------------------------------------------------------------------


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # non-spec, sent back by clients of reasoning models (vLLM, SGLang, DeepSeek)
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)  # an empty name can't be called: a forced call's grammar would write one no parser reads
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class ChatCompletionRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    seed: int | None = Field(default=None, ge=-INT64_MAX, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None
    # non-spec: variables for the chat template (vLLM's and SGLang's name; clients send it with extra_body),
    # e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None


# --- completions ------------------------------------------------------------------------------------


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class CompletionRequest(_Lenient):
    prompt: str | list[TokenId] | list[str]
    model: str | None = None
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    n: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=-INT64_MAX, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One message for a wrong prompt, not pydantic's first branch of the union ("prompt.str: Input should
        be a valid string" for a bad token id)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return value
        if isinstance(value, list) and all(type(x) is int for x in value):
            bad = next((x for x in value if not 0 <= x <= INT32_MAX), None)
            if bad is not None:
                raise ValueError(f"token ids are 0 ... {INT32_MAX}, got {bad}")
            return value
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")


# --- responses (stateless) --------------------------------------------------------------------------


class ResponsesTool(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesTextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Lenient):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Lenient):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    text: ResponsesText | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[ResponsesTool] | None = None
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None


# --- rollway's own REST -----------------------------------------------------------------------------


class SamplingPolicy(Strict):
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    allow_client_override: bool = False
    """When true, the client's temperature/top_p/seed win (eval groups, SFT collection)."""


class CreateGroupRequest(Strict):
    task: Any
    n_samples: int = Field(default=1, ge=1, le=1024)
    metadata: dict[str, Any] | None = None
    sampling: SamplingPolicy | None = None
    eval: bool = False
    """Eval groups are never leased for training and sit outside the staleness budget."""
    wait_seconds: float = Field(default=0.0, ge=0, le=600)
    """While the staleness budget is full, wait up to this long for room (a publish, a group dropped) before
    answering 429; 0 = answer 429 at once."""


class TurnReward(Strict):
    turn_id: str
    reward: Reward


class RewardRequest(Strict):
    reward: Reward | None = None
    turn_rewards: list[TurnReward] | None = None
    finish: bool = False
    """Also finish the session, in the same transaction (one request instead of two)."""

    @model_validator(mode="after")
    def _distinct(self) -> RewardRequest:
        """A turn named twice is refused, as a session named twice in a group's rewards is: which one was meant?"""
        seen: set[str] = set()
        for r in self.turn_rewards or ():
            if r.turn_id in seen:
                raise ValueError(f"turn {r.turn_id} is named twice")
            seen.add(r.turn_id)
        return self


class SessionReward(Strict):
    session_id: str = Field(min_length=1, max_length=64)
    reward: Reward


class GroupRewardsRequest(Strict):
    rewards: list[SessionReward] = Field(min_length=1, max_length=1024)
    """A reward per session, each session of the group at most once (a subset of the group is fine)."""
    finish: bool = False
    """Also finish each of these sessions, in the same transaction."""

    @model_validator(mode="after")
    def _distinct(self) -> GroupRewardsRequest:
        seen: set[str] = set()
        for r in self.rewards:
            if r.session_id in seen:
                raise ValueError(f"session {r.session_id} is named twice")
            seen.add(r.session_id)
        return self


class AbandonRequest(Strict):
    reason: str = Field(default="abandoned_by_client", max_length=128)
    """Stored in a varchar(128) (PostgreSQL refuses longer; SQLite would keep it): the same 400 on both."""
