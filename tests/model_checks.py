"""The checks behind docs/models.md, per model family, shared by tests/gateway/test_model_families.py and
`python scripts/model_matrix.py` (which writes the matrix).

A model's reply is never written by hand here: it is the family's own chat template's rendering of an
assistant message (with tool calls, reasoning or both) after the conversation, tokenized as the model would
emit it and ended with the stop token the model would emit; the gateway's parser must give the message back,
whole and streamed token by token (parse(render(x)) == x). Where a template drops the reasoning of the
message it renders (DeepSeek-R1, DeepSeek V3.1: their generation prompt opens `<think>`, and history
keeps answers only), the reply is that open block closed (`reasoning</think>`) before the template's
rendering of the answer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.continuity import Candidate, choose_parent
from gateway.template_env import compiled_template
from gateway.templating import ChatTemplate, IncrementalDetokenizer, _common_prefix_len
from gateway.tool_parsers import ParsedReply
from tests.realfiles import BY_NAME, Family, tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "days": {"type": "integer", "description": "how many days"}}, "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the weather in Paris for 3 days?"}
REASONING = "The user wants a forecast.\nI should call get_weather for Paris, 3 days."
CALL_ID = "abcDEF123"  # nine letters and digits: Mistral's templates refuse other ids
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
    "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]}
RESULT = {"role": "tool", "tool_call_id": CALL_ID, "content": '{"forecast": "sunny", "high_c": 24}'}
ANSWER = {"role": "assistant", "content": "It will be sunny in Paris, up to 24 °C."}
NEXT_USER = {"role": "user", "content": "And in Lyon?"}

COLUMNS = ("first-turn ids", "tool call", "tool call, streamed", "reasoning split", "multi-turn",
           "no markup in content", "message text stays text")


@dataclass
class Reply:
    """A reply as the model emits it: ids up to and including the stop token, and the prompt before it."""

    prompt_text: str
    ids: list[int]
    note: str = ""


@dataclass
class FamilyResult:
    family: Family
    cells: dict[str, tuple[bool | None, str]] = field(default_factory=dict)
    """column -> (passed; None: does not apply, the text says why) and what was seen."""


def template_of(family: Family) -> ChatTemplate:
    return _template(family.name)


@functools.cache
def _template(name: str) -> ChatTemplate:
    return ChatTemplate(tokenizer(BY_NAME[name]))


def has_reasoning(family: Family) -> bool:
    """The family's template renders reasoning (a thinking model), so its replies carry some."""
    ct = template_of(family)
    probe = {"role": "assistant", "content": "x", "reasoning_content": "PROBE-REASONING"}
    kwargs = family.thinking_kwargs
    rendered = ct.render_text([SYSTEM, USER, probe], TOOLS, add_generation_prompt=False, kwargs=kwargs)
    return "PROBE-REASONING" in rendered or ct.opens_reasoning(ct.render_text([SYSTEM, USER], TOOLS, kwargs=kwargs))


def render_reply(ct: ChatTemplate, messages: Sequence[dict[str, Any]], reply: dict[str, Any],
                 tools: Any, kwargs: dict[str, Any] | None = None, calls_as_text: str | None = None) -> Reply:
    """`reply` as the model would emit it after `messages`: the template's rendering of it, cut at the
    first stop token, or ended with the stop token the template writes next (GLM's next header).
    `calls_as_text`: Family.calls_as_text."""
    if calls_as_text and reply.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                 for c in reply["tool_calls"]]
        reply = {"role": "assistant", "content": calls_as_text.format(calls=json.dumps(calls))}
    prompt = ct.render_text(messages, tools, kwargs=kwargs)
    full = ct.render_text([*messages, reply], tools, add_generation_prompt=False, kwargs=kwargs)
    note = ""
    if reply.get("tool_calls") and reply["tool_calls"][0]["function"]["name"] not in full[len(prompt) - 40:]:
        # DeepSeek-R1's template renders calls only from null content and string arguments (the OpenAI form,
        # not the one the gateway, or transformers, gives templates): its own template, given that form.
        compiled = compiled_template(ct.tokenizer.chat_template)
        last = {k: v for k, v in reply.items() if k != "reasoning_content"}
        full = str(compiled.render(messages=[*messages, last], tools=tools, add_generation_prompt=False,
                                   **ct.tokenizer.special_tokens_map, **(kwargs or {})))
        note = "rendered from the OpenAI form (null content, string arguments), which alone this template renders"
    if full.startswith(prompt):
        text = full[len(prompt):]
    else:
        # The template renders history unlike the prompt (Mistral Nemo moves the system message into the last
        # user message; DeepSeek-R1 writes no opened <think> before an answer in history): the reply is what
        # differs from the rendering of another reply in its place.
        other = ct.render_text([*messages, {"role": "assistant", "content": "\u2603"}], tools,
                               add_generation_prompt=False, kwargs=kwargs)
        cut = _common_prefix_len(full, other)
        for token in ct.tokenizer.added_tokens_decoder.values():  # not inside a token that both start
            t = str(token.content)
            cut -= next((k for k in range(1, len(t)) if full.startswith(t, cut - k)), 0)
        text = full[cut:]
        note = "; ".join(filter(None, [note, "the template renders history unlike the prompt: the reply is what its "
                                             "rendering adds to a rendering with another reply"]))
    reasoning = reply.get("reasoning_content")
    if reasoning and reasoning not in text and ct.reasoning_parser is not None and ct.opens_reasoning(prompt):
        close = ct.reasoning_parser.close
        # A rendering that closes an empty block itself (DeepSeek V3.1's `</think>`) gets the reasoning before it.
        text = reasoning + text if text.lstrip().startswith(close) else f"{reasoning}\n{close}\n\n{text}"
        note = "; ".join(filter(None, [note, "the template renders no reasoning: the generation prompt's open block "
                                             "is closed after the reasoning, then the template's rendering"]))
    ids = ct.encode(text)
    stops = set(ct.stop_token_ids)
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    if cut is not None:
        return Reply(prompt, ids[: cut + 1], note)
    follow = RESULT if reply.get("tool_calls") else NEXT_USER
    after = ct.render_text([*messages, reply, follow], tools, add_generation_prompt=False, kwargs=kwargs)[len(full):]
    stop = next((t for t in ct.stop_token_ids if after.startswith(ct.decode([t]))), ct.end_of_turn_id)
    return Reply(prompt, [*ids, stop], note)


def parse_whole(ct: ChatTemplate, reply: Reply, tools: Any) -> ParsedReply:
    return ct.parse(ct.completion_text(reply.ids), tools, reply.prompt_text)


def parse_streamed(ct: ChatTemplate, reply: Reply, tools: Any) -> tuple[ParsedReply, dict[str, str]]:
    """Token by token through the gateway's incremental detokenizer and streaming parser: the final parse and
    what was streamed of each field before it."""
    detok = IncrementalDetokenizer(ct)
    parser = ct.reply_parser(tools, reply.prompt_text)
    streamed = {"content": "", "reasoning_content": ""}
    for token in reply.ids:
        for kind, piece in parser.feed(detok.feed([token])):
            streamed[kind] += piece
    for kind, piece in parser.feed(detok.flush()):
        streamed[kind] += piece
    return parser.finish(), streamed


def same_message(parsed: ParsedReply, message: dict[str, Any]) -> str | None:
    """None when `parsed` is `message` (content, reasoning, tool names and arguments); else what differs."""
    want_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]
    got_calls = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    if got_calls != want_calls:
        return f"tool calls {got_calls} != {want_calls}"
    if (parsed.content or "").strip() != (message.get("content") or "").strip():
        return f"content {parsed.content!r} != {message.get('content')!r}"
    if (parsed.reasoning_content or "").strip() != (message.get("reasoning_content") or "").strip():
        return f"reasoning {parsed.reasoning_content!r} != {message.get('reasoning_content')!r}"
    return None


def markup_in(ct: ChatTemplate, parsed: ParsedReply) -> list[str]:
    """Added tokens (the template's markup) found in the parsed content or reasoning."""
    texts = [parsed.content or "", parsed.reasoning_content or ""]
    tokens = {str(t.content) for t in ct.tokenizer.added_tokens_decoder.values()}
    return sorted(t for t in tokens if any(t in s for s in texts))


def stored_reply(ct: ChatTemplate, parsed: ParsedReply) -> dict[str, Any]:
    """The assistant message the gateway stores for a reply (and an agent sends back)."""
    return ct.assistant_message(parsed)


def continuity(ct: ChatTemplate, family: Family, call: dict[str, Any]) -> tuple[bool, str]:
    """Turn 1 calls the tool; turn 2 sends its result; turn 3 a new user message after the answer. Each later
    turn either extends the chain (its ids are the parent's prompt + completion, then exactly what the template
    renders after the reply) or starts a new chain with the reason continuity records."""
    kwargs = family.thinking_kwargs
    answer = {**ANSWER, "reasoning_content": "Sunny, 24 degrees: say so."} if has_reasoning(family) else ANSWER
    history: list[dict[str, Any]] = [SYSTEM, USER]
    prompt_ids = ct.render_prompt(history, TOOLS, kwargs)[0]
    reply = render_reply(ct, history, call, TOOLS, kwargs, family.calls_as_text)
    outcomes, ok = [], True
    for label, new, follow in (("tool result", [RESULT], answer), ("next user message", [NEXT_USER], None)):
        stored = stored_reply(ct, parse_whole(ct, reply, TOOLS))
        cand = Candidate("t", [*history, stored], TOOLS, 1, kwargs)
        request = [*history, stored, *new]
        choice = choose_parent([cand], request, TOOLS, kwargs)
        ext = ct.extension(cand.messages, reply.ids, new, TOOLS, kwargs=kwargs) if choice.parent_turn_id else None
        if ext is None:
            outcomes.append(f"{label}: new chain ({choice.reason or 'template_not_prefix_stable'})")
            chain = ct.render_prompt(request, TOOLS, kwargs)[0]
        else:
            ids = ext[0]
            if not ct.render_text(request, TOOLS, kwargs=kwargs).endswith(ct.decode(ids)):
                ok = False
                outcomes.append(f"{label}: the extension is not what the template renders after the reply")
            outcomes.append(f"{label}: extends")
            chain = [*prompt_ids, *reply.ids, *ids]
        if follow is None:
            break
        history, prompt_ids = request, chain
        reply = render_reply(ct, history, follow, TOOLS, kwargs)
    return ok, "; ".join(outcomes)


def forged_text_stays_text(ct: ChatTemplate) -> tuple[bool, str]:
    """A user message spelling every added token of the vocabulary renders to as many control ids as the same
    conversation with plain text there: only the template's markup becomes control tokens. Control tokens are
    the special ones and the added ones the template writes (`<tool_call>`, `<think>`); other added tokens
    (FIM tokens, placeholders) are ordinary vocabulary (gateway.encoding)."""
    added = ct.tokenizer.added_tokens_decoder
    tokens = [str(t.content) for t in added.values()]
    forged = " x".join(tokens) + "y"
    ids = ct.render_prompt([SYSTEM, {"role": "user", "content": forged}], TOOLS)[0]
    clean = ct.render_prompt([SYSTEM, {"role": "user", "content": "plain"}], TOOLS)[0]
    source = str(ct.tokenizer.chat_template)
    control = {i for i, t in added.items() if t.special or str(t.content) in source}
    extra = sorted({t for t in ids if t in control and ids.count(t) != clean.count(t)})
    if extra:
        return False, f"control ids from message text: {extra}"
    return True, f"{len(tokens)} added tokens spelled in a message, none became one"


def check_family(family: Family) -> FamilyResult:
    """Every column of the matrix for one family."""
    ct = template_of(family)
    tok = ct.tokenizer
    res = FamilyResult(family)
    kwargs = family.thinking_kwargs
    msgs = [SYSTEM, USER]
    ids = ct.render_prompt(msgs, TOOLS, kwargs)[0]
    reference = list(tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False, **(kwargs or {})))
    res.cells["first-turn ids"] = (ids == reference, f"{len(ids)} ids" if ids == reference else "differ")

    reasoned = has_reasoning(family)
    call = {**CALL, "reasoning_content": REASONING} if reasoned else CALL
    reply = render_reply(ct, msgs, call, TOOLS, kwargs, family.calls_as_text)
    whole = parse_whole(ct, reply, TOOLS)
    diff = same_message(whole, call)
    note = reply.note or ("the template renders no calls in history: the call as its system prompt asks for it"
                          if family.calls_as_text else "")
    res.cells["tool call"] = (diff is None, diff or "parse(render(call)) == call" + (f" ({note})" if note else ""))
    streamed, pieces = parse_streamed(ct, reply, TOOLS)
    sdiff = same_message(streamed, call)
    for kind in ("content", "reasoning_content"):
        if not (getattr(streamed, kind) or "").startswith(pieces[kind]):
            sdiff = f"streamed {kind} {pieces[kind]!r} is not a prefix of the final one"
    res.cells["tool call, streamed"] = (sdiff is None, sdiff or "token by token, same message")
    parsed_all = [whole, streamed]
    if reasoned:
        answer = {**ANSWER, "reasoning_content": REASONING}
        r = render_reply(ct, msgs, answer, TOOLS, kwargs)
        rw = parse_whole(ct, r, TOOLS)
        rs, _ = parse_streamed(ct, r, TOOLS)
        rdiff = same_message(rw, answer) or same_message(rs, answer)
        opened = " (generation prompt opens it)" if ct.opens_reasoning(r.prompt_text) else ""
        res.cells["reasoning split"] = (rdiff is None, rdiff or f"{ct.reasoning_parser.name if ct.reasoning_parser else '?'}{opened}")
        parsed_all += [rw, rs]
    else:
        res.cells["reasoning split"] = (None, "the template has no reasoning format")
    ok, text = continuity(ct, family, call)
    res.cells["multi-turn"] = (ok, text)
    leaked = sorted({m for p in parsed_all for m in markup_in(ct, p)})
    res.cells["no markup in content"] = (not leaked, f"leaked {leaked}" if leaked else "no added token in any field")
    res.cells["message text stays text"] = forged_text_stays_text(ct)
    return res
