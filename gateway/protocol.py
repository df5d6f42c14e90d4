"""OpenAI wire models the gateway accepts, in the order of the OpenAI docs.

Requests are validated with pydantic (a wrong type is a 400, never a 422); unknown fields are accepted,
ignored and logged once per field name (`note_unknown_fields`). Replies are built as plain dicts in the
route modules: they are only ever serialised, and dict building is the cheapest path on the hot route.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("rollway.gateway")
_seen_unknown: set[str] = set()


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


def note_unknown_fields(model: BaseModel, where: str) -> None:
    """Log each unknown request field once per process (they are accepted and ignored)."""
    extra = model.model_extra or {}
    for name in extra:
        key = f"{where}.{name}"
        if key not in _seen_unknown:
            _seen_unknown.add(key)
            log.info("ignoring unknown request field %s", key)


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
    name: str
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
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None


# --- completions ------------------------------------------------------------------------------------


class CompletionRequest(_Lenient):
    prompt: str | list[int] | list[str]
    model: str | None = None
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=1)
    n: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None


# --- responses (stateless) --------------------------------------------------------------------------


class ResponsesTool(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Lenient):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    tool_choice: str | dict[str, Any] | None = None
    tools: list[ResponsesTool] | None = None
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None


# --- rollway's own REST -----------------------------------------------------------------------------


class SamplingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = None
    allow_client_override: bool = False
    """When true, the client's temperature/top_p/seed win (eval groups, SFT collection)."""


class CreateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: Any
    n_samples: int = Field(default=1, ge=1, le=1024)
    metadata: dict[str, Any] | None = None
    sampling: SamplingPolicy | None = None
    eval: bool = False
    """Eval groups are never leased for training and sit outside the staleness budget."""


class TurnReward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turn_id: str
    reward: float


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = None
    turn_rewards: list[TurnReward] | None = None
    finish: bool = False
    """Also finish the session, in the same transaction (one request instead of two)."""


class AbandonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = "abandoned_by_client"
