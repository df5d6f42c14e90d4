"""Anthropic Messages API wire models the gateway accepts (`POST /v1/messages`, `/v1/messages/count_tokens`).

Strict types and finite numbers as on the OpenAI routes (`gateway.protocol`); unknown top-level fields are
accepted, ignored and logged once (`note_unknown_fields`), except the ones naming server-side features the
gateway does not have, which `gateway.anthropic.translate` refuses. Content blocks arrive as plain objects and are
checked one by one against the block models below by `gateway.anthropic.translate`, so an unsupported block type gets
a message naming it (docs/conformance-anthropic.md) instead of a validator's union error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.protocol import INT32_MAX, _Lenient

# --- content blocks (checked by gateway.anthropic.translate, block by block) ----------------------------------------


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    """Ignored: SGLang caches prefixes by itself."""
    citations: list[Any] | None = None
    """Ignored on input (the model never saw them)."""


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: Any
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str


# --- tools, tool choice, thinking --------------------------------------------------------------------------


class AnthropicTool(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    """Absent or "custom": a client tool. Server tools ("bash_20250124", "web_search_20250305", ...) run on
    Anthropic's side: refused."""
    cache_control: dict[str, Any] | None = None
    defer_loading: bool | None = None
    """True: not shown to the model until a `tool_addition` block of a system message adds it (Anthropic's tool
    search loads such tools on demand; here they stay out of the rendered tools unless added)."""


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    display: str | None = Field(default=None, max_length=64)
    """"omitted": thinking blocks carry no text; any other mode ("summarized", "updates", ones added later) returns
    the reasoning whole: there is no summarizer, and the whole text is what every mode summarizes."""
    block_binding: dict[str, Any] | None = None
    """`{"prefix_mismatch_behavior": "drop_block"}`: a thinking block whose signature fails is left out rather
    than refused."""


class JsonOutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    effort: str | None = None
    format: JsonOutputFormat | None = None
    task_budget: dict[str, Any] | None = None


class MessageOutputConfig(_Lenient):
    """A system message's per-turn `output_config` (Anthropic's `format` stays top-level only)."""

    effort: str | None = None


class MessageParam(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]
    clear_at: Literal["next_user_message", "never"] | None = None
    """System messages only: "next_user_message" shows the message for the user turn it follows only."""
    output_config: MessageOutputConfig | None = None
    """System messages only: recorded (effort has no effect on a self-hosted model)."""


class ContextManagement(_Lenient):
    edits: list[dict[str, Any]] = Field(default_factory=list, max_length=16)
    """Each edit is checked by `gateway.anthropic.context_edits`, which applies it."""


# --- requests ------------------------------------------------------------------------------------------------


class CountTokensRequest(_Lenient):
    messages: list[MessageParam] = Field(min_length=1)
    model: str | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)


REFUSED_FIELDS = {
    "mcp_servers": "MCP servers are run by Anthropic's API; connect them in the agent and offer their tools as tools",
    "container": "code-execution containers are run by Anthropic's API; this gateway has none",
}
"""Top-level fields that ask for something the gateway cannot do: a 400 naming the field, never ignored."""
