"""What the turn pipeline (`gateway.turns`) takes and gives: a turn's request as the endpoints translate it, the
turn prepared for generation and the finished one; and the checks and names that depend on the request alone
(a forced tool_choice, a JSON schema SGLang would refuse, the caller's name of a field, the session token limit)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest
from gateway.sessions_cache import SessionView
from gateway.store.store import SessionAuth
from gateway.template_segments import RenderCut
from gateway.tool_grammar import ForcedTools, resolve_tool_choice
from gateway.tool_parsers import ParsedReply
from rollway_common.json_schema_check import unsupported_reason


@dataclass(slots=True)
class TurnRequest:
    endpoint: str
    """chat | responses | completions"""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    asked: dict[str, Any]
    """The client's sampling and output options, recorded as sent."""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_logprobs: int = 0
    json_schema: str | None = None
    forced: ForcedTools | None = None
    """A forced tool_choice (`tools_for_choice`): decoded under a grammar in the model's tool-call format."""
    raw_prompt_ids: list[int] | None = None
    """/v1/completions: the prompt as ids, no template and no continuity."""
    raw_prompt: str | None = None
    """/v1/completions: the prompt as text, tokenized as it is (no template, no continuity)."""
    body_bytes: int = 0
    """Size of the request body: a big one is prepared off the event loop (BIG_BODY_BYTES)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The request's chat_template_kwargs (the settings' defaults are added in `prepare`)."""
    new_chain_reason: str | None = None
    """Set: the prompt is rendered whole as a new chain with this reason, whatever turn it would extend (an
    Anthropic context edit changed what the model sees of the history)."""
    fit_to_context: bool = False
    """A max_tokens over what the context leaves is cut to it rather than refused (Anthropic's Messages API,
    whose reply then stops with `model_context_window_exceeded`)."""


@dataclass(slots=True, weakref_slot=True, eq=False)  # weakref, by identity: TurnService.settled's set of turns in flight
class PreparedTurn:
    auth: SessionAuth
    req: TurnRequest
    turn_id: str
    prompt_ids: Sequence[int]
    """The whole prompt: a list, or an int32 array when the turn extends its parent (`generation.input_ids`)."""
    prompt_delta: list[int]
    parent_id: str | None
    chain_reason: str | None
    prompt_text: str | None
    """The rendered prompt (chat turns): a later turn that extends this one renders one template less."""
    sampling: dict[str, Any]
    temperature: float
    max_new_tokens: int
    started: float
    view: SessionView | None = None
    """The session's cached view the turn was prepared against (kept current by `finish`)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The chat_template_kwargs the prompt was rendered with: the settings' defaults, then the request's."""
    constrained: bool = False
    """Decoded under a grammar (a forced tool_choice, a response_format): recorded on the turn."""
    messages_digest: bytes | None = None
    """The chain digest of the request's messages (gateway.continuity), for the session view's index."""
    prompt_cut: RenderCut | None = None
    """Where `prompt_text` may be cut by a turn extending this one (`ChatTemplate.extension_cut`)."""


@dataclass(slots=True)
class FinishedTurn:
    turn_id: str
    text: str
    parsed: ParsedReply
    finish_reason: str
    """OpenAI's: stop | length | tool_calls | abort"""


def session_full(session_id: str, recorded: int, prompt: int | None, limit: int, req: TurnRequest) -> BadRequest:
    this = "" if prompt is None else f", and this turn's prompt is {prompt} more"
    return BadRequest(
        f"session {session_id} has recorded {recorded} tokens (prompt + completion of each turn){this}; a "
        f"session may record at most {limit} (max_session_tokens; raise it with ROLLWAY_MAX_SESSION_TOKENS, "
        f"or start a new session)",
        param={"completions": "prompt", "responses": "input"}.get(req.endpoint, "messages"),
        code="session_token_limit",
    )


def tools_for_choice(
    tool_choice: Any, tools: list[dict[str, Any]] | None, parallel_tool_calls: bool | None = None
) -> tuple[list[dict[str, Any]] | None, ForcedTools | None]:
    """(the tools to render, the forced choice to put on `TurnRequest.forced`) for OpenAI's tool_choice
    ("auto", "none", "required", {"type": "function", "function": {"name"}}) and parallel_tool_calls. A forced
    choice is honoured with a grammar (gateway/tool_grammar.py); one the model's family cannot be held to is a
    400 in `TurnService.prepare`."""
    return resolve_tool_choice(tool_choice, tools, parallel_tool_calls)


SCHEMA_PARAM = {"responses": "text.format", "messages": "output_config.format"}
"""The field that carries a turn's json_schema, by endpoint (chat and completions: response_format)."""
_CALLER_FIELDS = {
    "responses": {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"},
    "messages": {"response_format": "output_config.format"},
    "completions": {"messages": "prompt"},
}
"""Chat Completions' field names, as the turn service raises them, by what each endpoint calls them."""


def caller_param(endpoint: str, param: str | None) -> str | None:
    """`param` as the endpoint's caller names it: the turn service speaks Chat Completions' fields (`messages`,
    `max_tokens`), which a Responses caller sends as `input` and `max_output_tokens`. A message index of the
    translated conversation is not the caller's item index: it becomes the whole field."""
    names = _CALLER_FIELDS.get(endpoint)
    if param is None or names is None:
        return param
    if param.startswith("messages."):
        return names.get("messages", param)
    return names.get(param, param)


def check_json_schema(req: TurnRequest) -> None:
    """Refuse up front what SGLang 0.5.23 refuses in a `json_schema` grammar (rollway_common/json_schema_check.py), so
    the answer does not depend on the backend; forced tool calls' schemas (in a structural_tag) are not checked,
    as SGLang does not check them."""
    try:
        schema = json.loads(req.json_schema or "")
    except json.JSONDecodeError:
        return  # the gateway wrote it from a parsed body: always JSON
    reason = unsupported_reason(schema)
    if reason is not None:
        raise BadRequest(f"the JSON schema uses what the inference backend cannot enforce: {reason}",
                         param=SCHEMA_PARAM.get(req.endpoint, "response_format"), code="unsupported_schema")
