"""The turn pipeline shared by chat completions, responses and completions.

prepare: continuity (parent turn, exact ids) -> prompt ids -> sampling from the group's policy ->
context check. Then `generation.generate` runs it. finish: decode, parse tool calls and reasoning,
store the turn (durable before the reply is returned), update the session view.

Big prompts are the one place a single request can hold the event loop for seconds (tokenizing runs at a
few MB of text per second: a 7 MB message stalled every other request and /health for 2 s before its 400).
So a prompt whose body is big is prepared on a worker thread (tokenizers' batch encode, which the encoder
calls, releases the GIL), and a
prompt with more characters than the context could hold is refused before it is tokenized at all
(`max_chars_per_token`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

from gateway.continuity import Candidate
from gateway.errors import BadRequest, Conflict, ContextLengthExceeded
from gateway.generation import Generation
from gateway.loop_batch import LoopBatch
from gateway.metrics import Metrics
from gateway.prompt_limits import max_chars_per_token
from gateway.sessions_cache import PromptIds, SessionCache, SessionView, ids_json, join_json, share_messages
from gateway.store.models import TurnRecord
from gateway.store.requests import delta, shared_prefix
from gateway.store.store import SessionAuth, Store, unique_id
from gateway.template_segments import RenderCut
from gateway.templating import ChatTemplate
from gateway.tool_grammar import structural_tag
from gateway.tool_parsers import ParsedReply, ReplyParser
from gateway.turn_types import (
    FinishedTurn,
    PreparedTurn,
    TurnRequest,
    caller_param,
    check_json_schema,
    session_full,
)
from rollway_common.wire import pack

T = TypeVar("T")

BIG_BODY_BYTES = 64 * 1024
"""A request body this big has its prompt prepared on a worker thread. Below it a prompt tokenizes in a few
ms at most, less than a stall anyone notices, and the hot path pays nothing: one comparison."""
SETTLE_POLL_S = 0.02
"""How often `TurnService.settled` looks whether a session's turns in flight are stored."""
PROMPT_WORKERS = 2
"""Threads for big prompts: one huge prompt does not hold up every other big one, and hostile ones take at
most two cores' worth of tokenizing beside the event loop."""


def _thread_template(template: ChatTemplate) -> ChatTemplate:
    """`template` for one worker thread. Rendering only reads shared state; encoding also fills the encoder's
    piece cache, which is not safe to share with the event loop's thread: the copy gets its own (the
    encoder's configuration, and so its ids, stay the same). TurnService makes one at start, so a change to
    these attributes fails there rather than sharing the cache unnoticed."""
    encoder = copy.copy(template._encoder)
    if not isinstance(getattr(encoder, "_cache", None), OrderedDict) or not hasattr(encoder, "_chars"):
        raise TypeError("ChatTemplate._encoder is not the CachedEncoder this copy knows how to give a cache")
    encoder._cache = OrderedDict()
    encoder._chars = 0
    clone = copy.copy(template)
    clone._encoder = encoder
    return clone


class TurnService:
    def __init__(
        self,
        *,
        store: Store,
        template: ChatTemplate,
        cache: SessionCache,
        metrics: Metrics,
        context_length: int,
        reasoning: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        id_prefix: str = "chatcmpl-",
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`reasoning`: split reasoning off replies (Settings.reasoning); `chat_template_kwargs`: the defaults
        every render gets (Settings.chat_template_kwargs), under a request's own; `loop`: the app's (None: each
        call's running loop)."""
        self.store = store
        self.template = template
        self.tokenizer = template.tokenizer
        self.cache = cache
        self.metrics = metrics
        self.context_length = context_length
        self.reasoning = reasoning
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.stop_ids = set(template.stop_token_ids)
        self.token_texts: dict[int, tuple[str, list[int]]] = {}
        """token id -> `token_text`'s answer, for those asked once."""
        self._renders: OrderedDict[bytes, tuple[tuple[int, ...], str, RenderCut | None]] = OrderedDict()
        per_token = max_chars_per_token(self.tokenizer)
        self.chars_per_token = per_token
        """No token stands for more characters than this (None: not provable for this tokenizer)."""
        self._max_prompt_chars = (context_length - 1) * per_token if per_token else None
        """A text with more characters is at least context_length tokens: refused without tokenizing."""
        self._executor: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._running: weakref.WeakSet[PreparedTurn] = weakref.WeakSet()
        """Turns prepared and not yet stored: `finish` takes each out, and one whose call failed before it was
        stored (nothing to store) leaves with its last reference."""
        self._prompts = LoopBatch(loop)
        """A chat turn's prompt (`_continue`), run back to back with the others of the same turn of the loop."""
        _thread_template(template)  # fails here, at start, if the template no longer copies as it expects

    # --- before generation -----------------------------------------------------------------------

    async def prepare(self, auth: SessionAuth, req: TurnRequest, *, max_session_tokens: int | None = None) -> PreparedTurn:
        """`max_session_tokens`: refuse the turn when the tokens the session recorded so far plus its prompt
        exceed it (Settings.max_session_tokens). A refusal's `param` names the caller's field (`caller_param`)."""
        try:
            prepared = await self._prepare(auth, req, max_session_tokens)
        except BadRequest as e:
            e.param = caller_param(req.endpoint, e.param)
            raise
        self._running.add(prepared)
        return prepared

    def dropped(self, p: PreparedTurn) -> None:
        """`p` ends without a turn to store (its generation failed): no longer in flight, without waiting for the
        last reference to it to go (a traceback may hold one a while)."""
        self._running.discard(p)

    async def settled(self, session_ids: Sequence[str], timeout: float) -> bool:
        """Waits until no turn of these sessions is in flight on this gateway (prepared, not yet stored), at most
        `timeout` seconds; whether they settled. A session finished while one of its calls still generates would
        otherwise have that turn stored after its group was leased: never trained."""
        ids = set(session_ids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(p.auth.id in ids for p in list(self._running)):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(SETTLE_POLL_S)
        return True

    async def _prepare(self, auth: SessionAuth, req: TurnRequest, max_session_tokens: int | None) -> PreparedTurn:
        if auth.state != "active":
            raise Conflict(f"session {auth.id} is {auth.state}; it takes no more turns", code="session_ended")
        if req.json_schema is not None:
            check_json_schema(req)
        if req.tools and self.template.tool_parser is None:
            raise BadRequest(
                "this model's chat template writes tool calls in a format the gateway does not know, so it cannot "
                "read them back; start the gateway with --tool-parser naming the format (see docs/models.md), or "
                "send the request without tools", param="tools", code="unknown_tool_format")
        started = time.time()
        parent_id: str | None = None
        reason: str | None
        text: str | None = None
        digest: bytes | None = None
        cut: RenderCut | None = None
        prompt: Sequence[int]
        big = req.body_bytes >= BIG_BODY_BYTES
        view = await self.cache.get(auth.id, auth.turn_count)
        recorded = view.recorded if max_session_tokens is not None else 0
        if max_session_tokens is not None and recorded >= max_session_tokens:  # before any rendering
            raise session_full(auth.id, recorded, None, max_session_tokens, req)
        if req.raw_prompt_ids is not None or req.raw_prompt is not None:
            prompt = await self._raw_prompt(req, big)
            delta, reason = prompt, "completions_endpoint"
        elif big:
            parent_id, reason, prompt, delta, text, digest, cut = await self.off_loop(self._continue, view, req, True)
        else:  # with the other calls' prompts of this turn of the loop (gateway/loop_batch.py)
            parent_id, reason, prompt, delta, text, digest, cut = await self._prompts.run(self._continue, view, req)
        if max_session_tokens is not None and recorded + len(prompt) > max_session_tokens:
            raise session_full(auth.id, recorded, len(prompt), max_session_tokens, req)
        max_new = self._budget(len(prompt), req.max_tokens, req.fit_to_context)
        sampling, temperature = self._sampling(auth.sampling, req)
        if req.forced is not None:
            sampling["structural_tag"] = self._tool_grammar(req, text)
        prefix = "resp_" if req.endpoint == "responses" else ("cmpl-" if req.endpoint == "completions" else "chatcmpl-")
        return PreparedTurn(
            auth=auth, req=req, turn_id=unique_id(prefix), prompt_ids=prompt, prompt_delta=delta,
            parent_id=parent_id, chain_reason=reason, prompt_text=text, sampling=sampling, temperature=temperature,
            max_new_tokens=max_new, started=started, view=view, template_kwargs=self.kwargs_of(req),
            constrained=req.forced is not None or req.json_schema is not None, messages_digest=digest,
            prompt_cut=cut,
        )

    def _tool_grammar(self, req: TurnRequest, prompt_text: str | None) -> str:
        """The structural tag of a forced tool_choice (gateway/tool_grammar.py). When the generation prompt
        opened the reasoning block, the reply first closes it, freely. With a JSON schema too (response_format,
        text.format, output_config.format) the forced call wins, as on OpenAI's and Anthropic's APIs: the schema
        is for text output, and a forced reply holds none (`_sampling` leaves it out)."""
        assert req.forced is not None
        rp = self.template.reasoning_parser
        close = rp.close if rp is not None and self.reasoning and self.template.opens_reasoning(prompt_text) else None
        return structural_tag(self.template.formats.tool_parser, req.tools or [], req.forced, reasoning_close=close)

    def kwargs_of(self, req: TurnRequest) -> dict[str, Any]:
        """The chat_template_kwargs a request's prompt is rendered with."""
        return {**self.template_kwargs, **req.template_kwargs} if req.template_kwargs else self.template_kwargs

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a prompt worker thread (created on first use)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="rollway-prompt")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _worker_template(self) -> ChatTemplate:
        """The calling thread's own template (see `_thread_template`); the event loop's thread uses the shared one."""
        template: ChatTemplate | None = getattr(self._local, "template", None)
        if template is None:
            template = self._local.template = _thread_template(self.template)
        return template

    def _check_chars(self, text: str, param: str) -> None:
        """Refuse a text too long for the context by its length alone (before it is tokenized)."""
        limit = self._max_prompt_chars
        if limit is not None and len(text) > limit:
            assert self.chars_per_token is not None
            at_least = -(-len(text) // self.chars_per_token)
            raise ContextLengthExceeded(
                f"the prompt is at least {at_least} tokens ({len(text)} characters, and no token of this "
                f"tokenizer stands for more than {self.chars_per_token}); this model's context length is "
                f"{self.context_length}", param=param,
            )

    async def _raw_prompt(self, req: TurnRequest, big: bool) -> list[int]:
        """A /v1/completions prompt as ids: as sent, or its text tokenized as it is."""
        if req.raw_prompt is None:
            ids = req.raw_prompt_ids or []
        elif big:
            ids = await self.off_loop(self._encode_raw, req.raw_prompt, True)
        else:
            ids = self._encode_raw(req.raw_prompt, False)
        if not ids:
            raise BadRequest("prompt is empty", param="prompt")
        return ids

    def _encode_raw(self, text: str, worker: bool) -> list[int]:
        """A /v1/completions text prompt to ids; `worker`: on a prompt worker thread (its own template)."""
        self._check_chars(text, "prompt")
        return (self._worker_template() if worker else self.template).encode(text)

    def _continue(
        self, view: SessionView, req: TurnRequest, big: bool = False
    ) -> tuple[str | None, str | None, Sequence[int], list[int], str, bytes, RenderCut | None]:
        """(parent id, new-chain reason, prompt ids, prompt delta, prompt text, chain digest of the messages, where
        the prompt text may be cut) of a chat turn.

        `big`: on a worker thread, with the thread's own template, without the render cache (its keys would
        be as big as the requests), and measuring the new text before it is tokenized."""
        template = self._worker_template() if big else self.template
        kwargs = self.kwargs_of(req)
        choice, parent, digest = view.index.find(view.candidates, req.messages, req.tools, kwargs)
        if req.new_chain_reason is not None and parent is not None:  # it would have extended that turn
            reason: str | None = req.new_chain_reason
        elif parent is not None:
            n_prev = len(parent.messages)
            share_messages(req.messages, parent.messages)  # the view then keeps each message once
            view.index.shared(req.messages)
            check = None
            if big and self.chars_per_token is not None:
                check = functools.partial(self._check_extension, view.lengths[parent.turn_id], self.chars_per_token)
            ext = template.extension_cut(
                parent.messages, view.completion(parent.turn_id), req.messages[n_prev:], req.tools,
                parent_prompt=view.prompt_texts.get(parent.turn_id), parent_cut=view.prompt_cuts.get(parent.turn_id),
                kwargs=kwargs, check_new_chars=check,
            )
            if ext is not None:
                ids, text, cut = ext
                # An int32 array with its JSON: no Python int per id of the history, and no serialising it.
                full = view.extended_prompt(parent.turn_id, ids)
                return parent.turn_id, None, full, ids, text, digest, cut
            reason = "template_not_prefix_stable"
        else:
            reason = choice.reason
        if not big:
            ids, text, cut = self._render_cached(req.messages, req.tools, kwargs)
        else:
            if self._max_prompt_chars is not None:  # measured before the costly part of render_prompt: encoding
                self._check_chars(template.render_text(req.messages, req.tools, kwargs=kwargs), "messages")
            ids, text, cut = template.render_prompt_cut(req.messages, req.tools, kwargs)
        return None, reason, ids, ids, text, digest, cut

    def _check_extension(self, chain: int, per_token: int, new: int) -> None:
        """Refuse an extension too long for the context before it is tokenized: its text holds at least the `new`
        characters the full rendering adds after the parent's conversation (`ChatTemplate.extension`), on top
        of the `chain` ids of the turn it extends."""
        at_least = chain - (-new // per_token)
        if at_least >= self.context_length:
            raise ContextLengthExceeded(
                f"the prompt is at least {at_least} tokens ({chain} of the turn it extends, and {new} new "
                f"characters where no token of this tokenizer stands for more than {per_token}); this model's "
                f"context length is {self.context_length}", param="messages",
            )

    def _render_cached(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> tuple[list[int], str, RenderCut | None]:
        """Siblings of a GRPO group send the same first prompt: render and tokenize it once."""
        key = orjson.dumps([messages, tools, kwargs], option=orjson.OPT_SORT_KEYS)
        hit = self._renders.get(key)
        if hit is None:
            ids, text, cut = self.template.render_prompt_cut(messages, tools, kwargs)
            hit = self._renders[key] = (tuple(ids), text, cut)
            if len(self._renders) > 1024:
                self._renders.popitem(last=False)
        else:
            self._renders.move_to_end(key)
        return list(hit[0]), hit[1], hit[2]

    def _budget(self, prompt_len: int, max_tokens: int | None, fit: bool = False) -> int:
        ctx = self.context_length
        if prompt_len >= ctx:
            raise ContextLengthExceeded(
                f"the prompt is {prompt_len} tokens; this model's context length is {ctx}", param="messages"
            )
        if max_tokens is None:
            return ctx - prompt_len
        if prompt_len + max_tokens > ctx:
            if fit:
                return ctx - prompt_len
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
        if req.stop and req.forced is None:  # a stop string would cut a forced call: its grammar ends it (recorded)
            params["stop"] = req.stop
        if req.json_schema is not None and req.forced is None:  # a forced tool call's grammar wins (_tool_grammar)
            params["json_schema"] = req.json_schema
        # Behaviour logprobs of greedy decoding are reported at T = 1 (docs/sglang-contract.md "Logprobs").
        return params, temperature if temperature > 0 else 1.0

    # --- after generation ------------------------------------------------------------------------

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """One token's text and UTF-8 bytes for OpenAI logprobs (cached: decoding is the costly part)."""
        hit = self.token_texts.get(token_id)
        if hit is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            hit = self.token_texts[token_id] = (text, list(text.encode()))
        return hit

    def reply_parser(self, p: PreparedTurn) -> ReplyParser:
        """A parser for the reply to a prepared turn: no tool parsing when no tools were offered (a JSON answer
        is then just text); inside the reasoning from the start when the generation prompt opened it."""
        return self.template.reply_parser(p.req.tools, p.prompt_text, reasoning=self.reasoning)

    @staticmethod
    def _stored_request(p: PreparedTurn, request: dict[str, Any]) -> dict[str, Any]:
        """The request as the store keeps it: a delta on the parent's (gateway/store/requests.py) when the turn
        extends a parent in the session's view. Its leading messages that are the parent's (messages, then
        reply) are the parent's own objects (`share_messages` compared them byte for byte in `_continue`), so
        the shared prefix is counted by identity: nothing here grows with the conversation."""
        parent = _parent_candidate(p)
        if parent is None:
            return request
        return delta(request, parent.turn_id, parent.messages, {"tools": parent.tools},
                     shared=shared_prefix(p.req.messages, parent.messages))

    async def finish(self, p: PreparedTurn, gen: Generation, *, client_disconnected: bool = False) -> FinishedTurn:
        try:  # until the store has the turn: a failure before it leaves the in-flight set at once (`settled`)
            text = self.template.completion_text(gen.ids)
            matched = (gen.finish or {}).get("matched")
            if isinstance(matched, str) and matched in text:
                text = text[: text.index(matched)]
            raw_only = p.req.endpoint == "completions"
            if raw_only:
                parsed = ParsedReply(text, None, [])
            else:
                parser = self.reply_parser(p)
                parser.feed(text)
                parsed = parser.finish()
            ftype = "abort" if client_disconnected else gen.finish_type
            finish = {"stop": "tool_calls" if parsed.tool_calls else "stop", "length": "length"}.get(ftype, "abort")
            reply = {} if raw_only or (client_disconnected and not gen.ids) else self.template.assistant_message(parsed)
            if raw_only:
                reply = {"role": "assistant", "content": text}
            record = TurnRecord(
                id=p.turn_id,
                parent_id=p.parent_id,
                endpoint=p.req.endpoint,
                request=self._stored_request(p, {
                    "messages": p.req.messages, "tools": p.req.tools, "asked": p.req.asked, "sampling": p.sampling,
                    # Only when there are some: a turn's record stays as it was for the many without.
                    **({"chat_template_kwargs": p.template_kwargs} if p.template_kwargs and not raw_only else {})}),
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
                constrained=p.constrained,
                timings={
                    "started": p.started, "finished": time.time(), "resubmits": gen.resubmits,
                    "prompt_tokens": len(p.prompt_ids), "cached_tokens": gen.cached_tokens, "backend": gen.backend_id,
                    # [[first token index, backend id], ...]: more than one when a backend died mid-reply.
                    "backends": gen.backends,
                },
            )
            # Shielded: a client that goes away while we commit must not cancel the commit.
            stored = self.store.insert_turn_started(p.auth.id, record)
            stored.add_done_callback(lambda _: self._running.discard(p))  # in flight until durable (`settled`)
        except BaseException:
            self._running.discard(p)
            raise
        seq = await asyncio.shield(stored)
        if raw_only and p.view is not None and p.view.turn_count == seq - 1:
            # A raw completion is no parent (no messages), but its ids count toward the session's tokens.
            # The view stays current, as a reload from the store would build it; handing the cache a turn
            # without a reply would drop the view and reload every turn of the session on the next call.
            p.view.add_ids(p.turn_id, seq, None, list(p.prompt_ids), gen.ids)
        else:
            self.cache.record(
                p.auth.id, seq, p.turn_id, p.req.messages, {} if raw_only else reply, p.req.tools, p.parent_id,
                p.prompt_delta, gen.ids, p.prompt_text, p.template_kwargs or None, p.messages_digest, p.prompt_cut,
                join_json(p.prompt_ids.json, ids_json(gen.ids)) if isinstance(p.prompt_ids, PromptIds) else None,
            )
        self.metrics.turn_stored(
            continuity="extends" if p.parent_id else "new-chain", prompt_tokens=len(p.prompt_ids), completion_tokens=len(gen.ids),
            disconnected=client_disconnected, chain_reason=p.chain_reason, resubmits=gen.resubmits,
        )
        return FinishedTurn(p.turn_id, text, parsed, finish)


def _parent_candidate(p: PreparedTurn) -> Candidate | None:
    """The parent's candidate in the view the turn was prepared against (usually its last)."""
    if p.parent_id is None or p.view is None:
        return None
    for cand in reversed(p.view.candidates):
        if cand.turn_id == p.parent_id:
            return cand
    return None
