"""The turn pipeline shared by chat completions, responses and completions.

prepare: continuity (parent turn, exact ids) -> prompt ids -> sampling from the group's policy ->
context check. Then `generation.generate` runs it. finish: decode, parse tool calls and reasoning,
store the turn (durable before the reply is returned), update the session view.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.continuity import choose_parent
from gateway.errors import BadRequest, Conflict, ContextLengthExceeded
from gateway.generation import Generation
from gateway.metrics import Metrics
from gateway.sessions_cache import SessionCache, SessionView
from gateway.store.store import SessionAuth, Store, unique_id
from gateway.templating import ChatTemplate
from gateway.tool_parsers import ParsedReply, ToolParser, get_tool_parser, parse_reply
from gateway.wire import pack


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
    raw_prompt_ids: list[int] | None = None
    """/v1/completions: the prompt as ids, no template and no continuity."""


@dataclass(slots=True)
class PreparedTurn:
    auth: SessionAuth
    req: TurnRequest
    turn_id: str
    prompt_ids: list[int]
    prompt_delta: list[int]
    parent_id: str | None
    chain_reason: str | None
    prompt_text: str | None
    """The rendered prompt (chat turns): a later turn that extends this one renders one template less."""
    sampling: dict[str, Any]
    temperature: float
    max_new_tokens: int
    started: float


@dataclass(slots=True)
class FinishedTurn:
    turn_id: str
    text: str
    parsed: ParsedReply
    finish_reason: str
    """OpenAI's: stop | length | tool_calls | abort"""


class TurnService:
    def __init__(
        self,
        *,
        store: Store,
        template: ChatTemplate,
        cache: SessionCache,
        metrics: Metrics,
        context_length: int,
        tool_parser: str,
        reasoning: bool,
        id_prefix: str = "chatcmpl-",
    ) -> None:
        self.store = store
        self.template = template
        self.tokenizer = template.tokenizer
        self.cache = cache
        self.metrics = metrics
        self.context_length = context_length
        self.parser = get_tool_parser(tool_parser)
        self.reasoning = reasoning
        self.stop_ids = set(template.stop_token_ids)
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        self._renders: OrderedDict[bytes, tuple[tuple[int, ...], str]] = OrderedDict()

    # --- before generation -----------------------------------------------------------------------

    async def prepare(self, auth: SessionAuth, req: TurnRequest) -> PreparedTurn:
        if auth.state != "active":
            raise Conflict(f"session {auth.id} is {auth.state}; it takes no more turns", code="session_ended")
        started = time.time()
        parent_id: str | None = None
        reason: str | None
        text: str | None = None
        if req.raw_prompt_ids is not None:
            prompt, delta, reason = req.raw_prompt_ids, req.raw_prompt_ids, "completions_endpoint"
        else:
            view = await self.cache.get(auth.id, auth.turn_count)
            parent_id, reason, prompt, delta, text = self._continue(view, req)
        max_new = self._budget(len(prompt), req.max_tokens)
        sampling, temperature = self._sampling(auth.sampling, req)
        prefix = "resp_" if req.endpoint == "responses" else ("cmpl-" if req.endpoint == "completions" else "chatcmpl-")
        return PreparedTurn(
            auth=auth, req=req, turn_id=unique_id(prefix), prompt_ids=prompt, prompt_delta=delta,
            parent_id=parent_id, chain_reason=reason, prompt_text=text, sampling=sampling, temperature=temperature,
            max_new_tokens=max_new, started=started,
        )

    def _continue(
        self, view: SessionView, req: TurnRequest
    ) -> tuple[str | None, str | None, list[int], list[int], str]:
        """(parent id, new-chain reason, prompt ids, prompt delta, prompt text) of a chat turn."""
        choice = choose_parent(view.candidates, req.messages, req.tools)
        if choice.parent_turn_id is not None:
            parent = next(c for c in view.candidates if c.turn_id == choice.parent_turn_id)
            n_prev = len(parent.messages)
            ext = self.template.extension(
                parent.messages, view.completions[parent.turn_id], req.messages[n_prev:], req.tools,
                parent_prompt=view.prompt_texts.get(parent.turn_id),
            )
            if ext is not None:
                ids, text = ext
                return parent.turn_id, None, [*view.chains[parent.turn_id], *ids], ids, text
            reason: str | None = "template_not_prefix_stable"
        else:
            reason = choice.reason
        ids, text = self._render_cached(req.messages, req.tools)
        return None, reason, ids, ids, text

    def _render_cached(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[int], str]:
        """Siblings of a GRPO group send the same first prompt: render and tokenize it once."""
        key = orjson.dumps([messages, tools], option=orjson.OPT_SORT_KEYS)
        hit = self._renders.get(key)
        if hit is None:
            ids, text = self.template.render_prompt(messages, tools)
            hit = self._renders[key] = (tuple(ids), text)
            if len(self._renders) > 1024:
                self._renders.popitem(last=False)
        else:
            self._renders.move_to_end(key)
        return list(hit[0]), hit[1]

    def _budget(self, prompt_len: int, max_tokens: int | None) -> int:
        ctx = self.context_length
        if prompt_len >= ctx:
            raise ContextLengthExceeded(
                f"the prompt is {prompt_len} tokens; this model's context length is {ctx}", param="messages"
            )
        if max_tokens is None:
            return ctx - prompt_len
        if prompt_len + max_tokens > ctx:
            raise ContextLengthExceeded(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's context "
                f"length of {ctx} tokens",
                param="max_tokens",
            )
        return max_tokens

    def _sampling(self, policy: dict[str, Any], req: TurnRequest) -> tuple[dict[str, Any], float]:
        """The group's policy decides; the client's values win only when the policy allows it."""
        override = bool(policy.get("allow_client_override"))

        def pick(name: str, asked: Any, default: Any) -> Any:
            return asked if override and asked is not None else policy.get(name, default)

        temperature = float(pick("temperature", req.temperature, 1.0))
        params: dict[str, Any] = {
            "temperature": temperature,
            "top_p": float(pick("top_p", req.top_p, 1.0)),
            "top_k": int(policy.get("top_k", -1)),
            "stop_token_ids": sorted(self.stop_ids),
            "skip_special_tokens": False,
        }
        seed = pick("seed", req.seed, None)
        if seed is not None:
            params["sampling_seed"] = int(seed)
        if req.stop:
            params["stop"] = req.stop
        if req.json_schema is not None:
            params["json_schema"] = req.json_schema
        # Behaviour logprobs of greedy decoding are reported at T = 1 (docs/sglang-contract.md "Logprobs").
        return params, temperature if temperature > 0 else 1.0

    # --- after generation ------------------------------------------------------------------------

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """One token's text and UTF-8 bytes for OpenAI logprobs (cached: decoding is the costly part)."""
        hit = self._token_text.get(token_id)
        if hit is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            hit = self._token_text[token_id] = (text, list(text.encode()))
        return hit

    def parser_for(self, req: TurnRequest) -> ToolParser | None:
        """No tool parsing when no tools were offered (a JSON answer is then just text)."""
        return self.parser if req.tools else None

    async def finish(self, p: PreparedTurn, gen: Generation, *, client_disconnected: bool = False) -> FinishedTurn:
        text = self.template.completion_text(gen.ids)
        matched = (gen.finish or {}).get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        raw_only = p.req.endpoint == "completions"
        parsed = ParsedReply(text, None, []) if raw_only else parse_reply(text, self.parser_for(p.req), reasoning=self.reasoning)
        ftype = "abort" if client_disconnected else gen.finish_type
        finish = {"stop": "tool_calls" if parsed.tool_calls else "stop", "length": "length"}.get(ftype, "abort")
        reply = {} if raw_only or (client_disconnected and not gen.ids) else self.template.assistant_message(parsed)
        if raw_only:
            reply = {"role": "assistant", "content": text}
        values = dict(
            id=p.turn_id,
            parent_id=p.parent_id,
            endpoint=p.req.endpoint,
            request={"messages": p.req.messages, "tools": p.req.tools, "asked": p.req.asked, "sampling": p.sampling},
            reply=reply,
            prompt_ids=pack(p.prompt_delta, "int32"),
            prompt_len=len(p.prompt_ids),
            completion_ids=pack(gen.ids, "int32"),
            logprobs=pack(gen.logprobs, "float32"),
            versions=pack(gen.versions, "int32"),
            temperature=p.temperature,
            finish_reason=finish,
            continuity="extends" if p.parent_id else "new-chain",
            chain_reason=p.chain_reason,
            client_disconnected=client_disconnected,
            timings={
                "started": p.started, "finished": time.time(), "resubmits": gen.resubmits,
                "prompt_tokens": len(p.prompt_ids), "cached_tokens": gen.cached_tokens, "backend": gen.backend_id,
                # [[first token index, backend id], ...]: more than one when a backend died mid-reply.
                "backends": gen.backends,
            },
        )
        # Shielded: a client that goes away while we commit must not cancel the commit.
        seq = await asyncio.shield(self.store.insert_turn(p.auth.id, values))
        self.cache.record(
            p.auth.id, seq, p.turn_id, p.req.messages, {} if raw_only else reply, p.req.tools, p.prompt_ids, gen.ids,
            p.prompt_text,
        )
        self.metrics.turn_stored(
            continuity="extends" if p.parent_id else "new-chain", prompt_tokens=len(p.prompt_ids), completion_tokens=len(gen.ids),
            disconnected=client_disconnected, chain_reason=p.chain_reason,
        )
        return FinishedTurn(p.turn_id, text, parsed, finish)


def require_tools_supported(tool_choice: Any, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """tool_choice is honoured or refused, never ignored (docs/architecture.md "Sampling")."""
    if tool_choice is None or tool_choice == "auto":
        return tools
    if tool_choice == "none":
        return None
    if not tools:
        raise BadRequest("tool_choice was given but no tools were offered", param="tool_choice")
    raise BadRequest(
        "tool_choice 'required' or a named function is not supported by this gateway's backends; use 'auto'",
        param="tool_choice",
    )
