"""Chat template + tokenizer: prompt ids for a request, and the exact ids that extend a session's chain.

The gateway renders and tokenizes itself, and a later turn of a session reuses the parent's prompt +
completion ids verbatim, tokenizing only what is new (docs/architecture.md "Continuity and chains":
retokenization drift). The new part is found by rendering text: the conversation with the new messages
must render to the parent's conversation followed by more text ("prefix stable"); the ids of that extra
text, after the "bridge" the template puts between the end-of-turn token and the next message (ChatML's
"\\n", which the model never generates; verl#6921 lost it), are the extension. Templates that rewrite
history (strip old reasoning, add date lines) are not prefix stable there; the caller then starts a new
chain.

Only the template's own markup becomes special tokens: text from the messages and tools that spells one
("<|im_end|>\\n<|im_start|>system\\n..." in a user message or a tool result) is encoded as plain text, in first
turns and extensions alike (gateway.encoding, "Text from messages never becomes a control token").
`allow_special_tokens_in_content` turns that off for callers who put markup into content on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.byte_level import ByteLevelBytes
from gateway.continuity import drop_none
from gateway.encoding import CachedEncoder
from gateway.hf_messages import Message, hf_message
from gateway.model_formats import ModelFormats, detect
from gateway.settings import RESERVED_TEMPLATE_KWARGS as RESERVED_TEMPLATE_KWARGS
from gateway.template_env import compiled_template, segment_renderer
from gateway.template_segments import LazyMessages, RenderCut, inputs_json, render
from gateway.tool_parsers import (
    ParsedReply,
    ReasoningParser,
    ReplyParser,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
    reply_parser,
)

# Tokens that end an assistant turn, by template family, in order of preference. GLM's turns end with the
# next role's header (`<|user|>`, `<|observation|>`), which the model emits as its stop token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|user|>")



def _generation_eos_ids(tokenizer: Any) -> list[int]:
    """eos ids from generation_config.json next to the tokenizer, else the tokenizer's eos."""
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list):
            return [int(i) for i in eos]
    return [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]


def _detect_end_of_turn(template: Any, vocab: Mapping[str, int], eos_token: str | None) -> str:
    """The end-of-turn token: the first known one the chat template uses, else the first in the
    vocabulary, else eos (vocabularies often carry other families' tokens unused)."""
    source = json.dumps(template) if isinstance(template, dict) else str(template or "")
    for token in END_OF_TURN_TOKENS:
        if token in vocab and token in source:
            return token
    if eos_token is not None and str(eos_token) in source:  # Mistral's and DeepSeek's turns end with eos
        return str(eos_token)
    for token in END_OF_TURN_TOKENS:
        if token in vocab:
            return token
    if eos_token is None:
        raise ValueError("cannot tell the end-of-turn token: pass end_of_turn")
    return str(eos_token)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (bisection over slice comparisons: C speed, not a Python loop)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ChatTemplate:
    """A tokenizer's chat template, its stop ids and its tool-call format, for one served model."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        end_of_turn: str | None = None,
        generation_eos_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        allow_special_tokens_in_content: bool = False,
    ) -> None:
        """`allow_special_tokens_in_content`: text from messages and tools that spells a special or markup token
        becomes that token, as a plain render + encode does (for trusted callers that put markup into content on
        purpose); by default it is plain text (module docstring). `tool_parser`, `reasoning_parser`: a format
        name, "auto" (told from the template, gateway.model_formats) or "none"."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        """Replaces the tokenizer's own template when given (tests render other families on one tokenizer)."""
        source = chat_template or tokenizer.chat_template
        markup = "\n".join(source.values()) if isinstance(source, dict) else str(source or "")
        self.formats: ModelFormats = detect(markup, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
        self.tool_parser: ToolParser | None = (
            get_tool_parser(self.formats.tool_parser) if self.formats.tool_parser else None)
        """None: the template's tool-call format is unknown; requests with tools are refused."""
        self.reasoning_parser: ReasoningParser | None = (
            get_reasoning_parser(self.formats.reasoning_parser) if self.formats.reasoning_parser else None)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        """The Rust tokenizer of a fast tokenizer (None for a slow one)."""
        self._bytes: ByteLevelBytes | None = None
        """Each id's bytes, for a byte-level tokenizer (`decode`); None where the tokenizer decodes."""
        self._bytes_built = False
        """`_bytes` is built once: by `warm_decoder` or the first decode (~0.3 s for a 150k vocabulary)."""
        vocab = tokenizer.get_vocab()
        self.end_of_turn = end_of_turn or _detect_end_of_turn(
            chat_template or tokenizer.chat_template, vocab, tokenizer.eos_token
        )
        if self.end_of_turn not in vocab:
            raise ValueError(f"end-of-turn token {self.end_of_turn!r} is not in the vocabulary")
        self.end_of_turn_id: int = vocab[self.end_of_turn]
        eos = list(generation_eos_ids) if generation_eos_ids is not None else _generation_eos_ids(tokenizer)
        self.stop_token_ids: list[int] = list(dict.fromkeys([*eos, self.end_of_turn_id]))
        """Model eos ids (generation_config) and the end-of-turn id, deduplicated, in that order."""
        stops = self.tool_parser.stop_tokens if self.tool_parser is not None else ()
        if stops and all(t in vocab for t in stops):  # gpt-oss: its `<|end|>` ends one message of a reply
            self.stop_token_ids = [vocab[t] for t in stops]
        self._stop_set = frozenset(self.stop_token_ids)
        self._markers = tuple(self.decode([i]) for i in self.stop_token_ids)
        self._longest_marker = max(map(len, self._markers), default=1)
        self._encoder = CachedEncoder(
            tokenizer, protect_content=not allow_special_tokens_in_content, markup=markup
        )
        self._variables = dict(tokenizer.special_tokens_map)

    # --- rendering ---------------------------------------------------------------------------------

    def render_text(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, *, add_generation_prompt: bool = True,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered prompt text (message text as the client sent it)."""
        hf_messages, hf_tools, hf_kwargs, marked = self._template_input(messages, tools, kwargs)
        text = self._render(hf_messages, hf_tools, add_generation_prompt, hf_kwargs)
        return self._encoder.unmark(text) if marked else text

    def _template_input(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> tuple[list[dict[str, Any]], list[Any] | None, dict[str, Any], bool]:
        """Messages, tools and chat_template_kwargs in the form the template takes, and whether their strings
        were marked (some spell a protected token: its marks render instead, and `_encode` turns them into
        plain text)."""
        hf_messages = [hf_message(m) for m in messages]
        hf_tools = drop_none(list(tools)) if tools else None
        hf_kwargs = dict(kwargs or {})
        if not self._encoder.forged(hf_messages, hf_tools, hf_kwargs):
            return hf_messages, hf_tools, hf_kwargs, False
        return (self._encoder.mark(hf_messages), self._encoder.mark(hf_tools), self._encoder.mark(hf_kwargs),
                True)

    def _render(
        self, hf_messages: list[dict[str, Any]], hf_tools: list[Any] | None, add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        template = self.tokenizer.get_chat_template(self.chat_template, hf_tools)
        compiled = compiled_template(template)
        if compiled is None:  # a transformers without the compiled-template cache: its public path
            return str(self.tokenizer.apply_chat_template(
                hf_messages, tools=hf_tools, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=self.chat_template, **kwargs,
            ))
        # What apply_chat_template renders (special tokens as variables, then the caller's kwargs), without
        # its copy of every input into plain types: ours are plain JSON already. A third less time a render.
        variables = {**self._variables, **kwargs} if kwargs else self._variables
        return render(compiled, {**variables, "messages": hf_messages, "tools": hf_tools, "documents": None,
                                 "add_generation_prompt": add_generation_prompt})

    def _encode(self, text: str, marked: bool) -> list[int]:
        return self._encoder.encode_marked(text) if marked else self._encoder.encode(text)

    def encode(self, text: str) -> list[int]:
        """Text to ids; no BOS is added (a template that wants one renders it). Special-token text in `text` is
        the token: this is for text that is all markup or all the model's (a rendered prompt goes through
        render_prompt, which keeps message text plain)."""
        return self._encoder.encode(text)

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, kwargs: Mapping[str, Any] | None = None
    ) -> tuple[list[int], str]:
        """The prompt of a first turn (or of a new chain): the whole conversation + generation prompt, as
        ids and as the rendered text; `kwargs`, the request's chat_template_kwargs."""
        ids, text, _ = self.render_prompt_cut(messages, tools, kwargs)
        return ids, text

    def render_prompt_cut(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, kwargs: Mapping[str, Any] | None = None
    ) -> tuple[list[int], str, RenderCut | None]:
        """`render_prompt`, and where a turn extending this one may cut the text (`extension`'s `parent_cut`)."""
        hf_messages, hf_tools, hf_kwargs, marked = self._template_input(messages, tools, kwargs)
        fast = None if marked else self._whole_by_segments(hf_messages, hf_tools, hf_kwargs)
        if fast is not None:
            return self._encode(fast[0], False), fast[0], fast[1]
        text = self._render(hf_messages, hf_tools, True, hf_kwargs)
        cut = None if marked else self._cut(hf_messages, hf_tools, hf_kwargs, text)
        return self._encode(text, marked), (self._encoder.unmark(text) if marked else text), cut

    def _whole_by_segments(self, hf_messages: list[dict[str, Any]], hf_tools: list[Any] | None,
                           kwargs: Mapping[str, Any]) -> tuple[str, RenderCut] | None:
        """`_render`'s text with a generation prompt and its cut, rendered by segments (`Renderer.whole`: the head
        of a run's system prompt and tools is rendered once, not on every first turn); None when the template
        renders whole only, or when this render raised (the whole render then raises what the template raises)."""
        renderer = segment_renderer(self.tokenizer.get_chat_template(self.chat_template, hf_tools))
        if renderer is None:
            return None
        try:
            return renderer.whole(self._segment_variables(hf_tools, kwargs), hf_messages, inputs_json(hf_tools, kwargs))
        except Exception:  # the whole render below raises it, with the template's own message
            return None

    def _segment_variables(self, hf_tools: list[Any] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """What `_render` passes the template besides the messages and add_generation_prompt."""
        variables = {**self._variables, **kwargs} if kwargs else self._variables
        return {**variables, "tools": hf_tools, "documents": None}

    def _cut(self, hf_messages: list[dict[str, Any]], hf_tools: list[Any] | None, kwargs: Mapping[str, Any],
             text: str) -> RenderCut | None:
        """Where `text`, the whole render of `hf_messages`, may be cut (`Renderer.cut`); None when the template
        renders whole only."""
        renderer = segment_renderer(self.tokenizer.get_chat_template(self.chat_template, hf_tools))
        if renderer is None:
            return None
        return renderer.cut(self._segment_variables(hf_tools, kwargs), hf_messages, inputs_json(hf_tools, kwargs), text)

    def extension(
        self,
        prev_messages: Sequence[Message],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[Any] | None,
        *,
        parent_prompt: str | None = None,
        kwargs: Mapping[str, Any] | None = None,
        check_new_chars: Callable[[int], None] | None = None,
    ) -> tuple[list[int], str] | None:
        """`extension_cut` without the cut."""
        ext = self.extension_cut(prev_messages, prev_completion_ids, new_messages, tools, parent_prompt=parent_prompt,
                                 kwargs=kwargs, check_new_chars=check_new_chars)
        return None if ext is None else ext[:2]

    def extension_cut(
        self,
        prev_messages: Sequence[Message],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[Any] | None,
        *,
        parent_prompt: str | None = None,
        parent_cut: RenderCut | None = None,
        kwargs: Mapping[str, Any] | None = None,
        check_new_chars: Callable[[int], None] | None = None,
    ) -> tuple[list[int], str, RenderCut | None] | None:
        """The ids to append to the parent's prompt + completion ids for `new_messages`, with the rendered
        text of the whole new prompt; None when the template is not prefix stable here (the caller starts
        a new chain, "template_not_prefix_stable").

        `prev_messages` is the parent's request messages followed by its reply (an assistant message);
        `parent_prompt`, the parent's own rendered prompt text when the caller kept it (saves a render).
        The ids are: [end-of-turn, when the parent was cut off without a stop token] + the bridge after the
        reply's end-of-turn + the new messages + the generation prompt. All of it is prompt (loss mask 0).
        Whatever stop token the model emitted (Llama's <|eom_id|> or <|eot_id|>) stays in the chain as
        emitted. A template that renders no end marker after the reply (GLM: the next role's header ends a
        turn, and the model emits that header as its stop token) extends when what it renders next starts
        with the stop token the model emitted; the chain holds it once. `kwargs`: the chat_template_kwargs
        of parent and request (continuity extends only turns with the same ones). `check_new_chars`: called,
        before anything is tokenized, with how many characters the full rendering adds after the parent's
        conversation (the text of the new messages, as the client sent it); it may raise to refuse the request.

        `parent_cut`: where `parent_prompt` may be cut (`render_prompt_cut`, an earlier `extension_cut`). With it,
        a message-local template (gateway.template_segments) renders only the segments after the cut: the same
        two texts as whole renders, at a cost that does not grow with the conversation. Also returned: the cut
        of the new prompt, for the turn that extends this one (None: that one renders whole).
        """
        if not prev_messages or not new_messages:
            raise ValueError("extension needs the parent's messages and at least one new message")
        # The two renders as texts from `base` on: whole renders from 0; renders by segments from a little before
        # the parent prompt's cut (the texts before it are the parent prompt's own, and are not copied).
        fast = None
        cut: RenderCut | None
        if parent_cut is not None and parent_prompt is not None:
            try:
                fast = self._by_segments(prev_messages, new_messages, tools, kwargs, parent_prompt, parent_cut)
            except Exception:  # the whole renders below raise what the template raises
                fast = None
        if fast is not None and parent_prompt is not None:
            full_rest, prefix_rest, known, cut = fast
            marked = False
            base = max(0, known - self._longest_marker)
            before = parent_prompt[base:known]
            full, prefix = before + full_rest, before + prefix_rest
            whole = parent_prompt[:known] + full_rest
        else:
            hf_all, hf_tools, hf_kwargs, marked = self._template_input(
                [*prev_messages, *new_messages], tools, kwargs)
            hf_prev = hf_all[: len(prev_messages)]
            whole = full = self._render(hf_all, hf_tools, True, hf_kwargs)
            prefix = self._render(hf_prev, hf_tools, False, hf_kwargs)
            cut = None if marked else self._cut(hf_all, hf_tools, hf_kwargs, full)
            base = 0
        if check_new_chars is not None:
            unmark = self._encoder.unmark if marked else str
            check_new_chars(len(unmark(full)) - len(unmark(prefix)))
        if not full.startswith(prefix):
            return None
        # The reply's end-of-turn is the last stop marker inside the reply's own rendering: a template that
        # renders a final assistant message unterminated would otherwise send us back to the end of an
        # earlier message. The reply starts where the rendering of what came before it stops agreeing.
        # Marked renders are compared with marked renders only: the kept text is the client's.
        if parent_prompt is None or marked:
            parent_prompt = self._render(hf_prev[:-1], hf_tools, False, hf_kwargs)
        # The parent's prompt ends with the generation prompt, which may share leading characters with the
        # reply's end marker (an empty reply): step back so the marker is searched for from its start.
        shared = _common_prefix_len(parent_prompt[base:], prefix)
        reply_start = max(0, shared - self._longest_marker + 1)
        end = -1
        for marker in self._markers:
            at = prefix.rfind(marker, reply_start)
            if at >= 0:
                end = max(end, at + len(marker))
        if end < 0:
            if not prev_completion_ids or prev_completion_ids[-1] not in self._stop_set:
                return None
            emitted = self.decode(prev_completion_ids[-1:])
            if not full.startswith(emitted, len(prefix)):
                return None
            text = full[len(prefix) + len(emitted):]
            return self._encode(text, marked), (self._encoder.unmark(whole) if marked else whole), cut
        text = prefix[end:] + full[len(prefix) :]
        if not prev_completion_ids or prev_completion_ids[-1] not in self._stop_set:
            text = self.end_of_turn + text  # cut off by max_tokens (or aborted): close the turn
        return self._encode(text, marked), (self._encoder.unmark(whole) if marked else whole), cut

    def _by_segments(
        self, prev: Sequence[Message], new: Sequence[Message], tools: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None, parent_prompt: str, cut: RenderCut,
    ) -> tuple[str, str, int, RenderCut] | None:
        """`extension`'s two renders (all messages + generation prompt; `prev` alone) by segments, each from the
        parent prompt's cut on, where that cut is, and the new prompt's cut; None when the proof does not cover
        this request (`Renderer.extend`)."""
        hf_tools = drop_none(list(tools)) if tools else None
        hf_kwargs = dict(kwargs or {})
        renderer = segment_renderer(self.tokenizer.get_chat_template(self.chat_template, hf_tools))
        n = len(prev)
        if renderer is None or not renderer.usable(cut, n, parent_prompt, inputs_json(hf_tools, hf_kwargs)):
            return None
        messages = LazyMessages([*prev, *new], hf_message)
        if self._encoder.forged([messages[i] for i in range(n - 1, len(messages))]):
            return None  # the parent's prompt was not marked; the reply or a new message would be
        ext = renderer.extend(self._segment_variables(hf_tools, hf_kwargs), messages, n, parent_prompt, cut)
        return None if ext is None else (ext[0], ext[1], cut.offset, ext[2])

    # --- replies -----------------------------------------------------------------------------------

    def opens_reasoning(self, prompt_text: str | None) -> bool:
        """Whether the generation prompt of `prompt_text` opened the reasoning block (DeepSeek-R1's
        `<｜Assistant｜><think>\n`, a thinking DeepSeek V3.1): the reply then starts inside it and only closes
        it. A prompt that opened and closed it (Qwen3 with enable_thinking false) did not."""
        rp = self.reasoning_parser
        if rp is None or rp.reply_parser is not None or not prompt_text:  # harmony's channels: no open block
            return False
        return prompt_text.rstrip().endswith(rp.open)

    def reply_parser(
        self, tools: Sequence[Any] | None, prompt_text: str | None, *, reasoning: bool = True
    ) -> ReplyParser:
        """A fresh parser for one reply to a prompt: the template's formats, tool calls only when tools were
        offered, starting inside the reasoning when the prompt opened it. `reasoning=False` (the gateway's
        `reasoning` setting off) splits no reasoning off, harmony's channels excepted."""
        rp = self.reasoning_parser
        if not reasoning and (rp is None or rp.reply_parser is None):
            rp = None
        return reply_parser(self.tool_parser if tools else None, rp,
                            in_reasoning=rp is not None and self.opens_reasoning(prompt_text), tools=tools)

    def parse(self, text: str, tools: Sequence[Any] | None, prompt_text: str | None, *,
              reasoning: bool = True) -> ParsedReply:
        """A whole reply's text parsed (`reply_parser`, fed at once)."""
        parser = self.reply_parser(tools, prompt_text, reasoning=reasoning)
        parser.feed(text)
        return parser.finish()

    def completion_text(self, ids: Sequence[int]) -> str:
        """The reply text for the parsers: special tokens kept (they carry the markers), the final
        stop token dropped."""
        if ids and ids[-1] in self._stop_set:
            ids = ids[:-1]
        return self.decode(ids)

    @staticmethod
    def assistant_message(parsed: ParsedReply) -> dict[str, Any]:
        """The reply as the OpenAI-form assistant message a client sends back (and continuity stores).

        `reasoning_content` is kept when there is some: templates that render it see it on the
        parent, and continuity ignores it when comparing, so clients that drop it still extend.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content is not None:
            msg["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
        return msg

    def warm_decoder(self) -> ByteLevelBytes | None:
        """Builds `decode`'s table of each id's bytes now (the gateway does at start, not on its first reply)."""
        if not self._bytes_built:
            self._bytes = ByteLevelBytes.build(self._backend) if self._backend is not None else None
            self._bytes_built = True
        return self._bytes

    def decode(self, ids: Iterable[int]) -> str:
        """Ids to text with special tokens kept and no space clean-up (the exact text), except a NUL: a model
        can generate the byte, but a request holding one is refused (PostgreSQL can't store it), so an agent
        sending the reply back would be refused. A NUL is written U+FFFD; the recorded ids stay the model's."""
        ids = list(ids)
        text = self._decode_by_table(ids)
        if text is None:
            if self._backend is not None:  # what transformers' decode calls, without its wrapper
                text = str(self._backend.decode(ids, skip_special_tokens=False))
            else:
                text = str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        return text.replace("\x00", "\ufffd") if "\x00" in text else text

    def _decode_by_table(self, ids: list[int]) -> str | None:
        table = self.warm_decoder()
        if table is None or min(ids, default=0) < 0:
            return None
        try:
            return table.decode(ids)
        except IndexError:  # an id past the tokenizer's (a model's padded vocabulary): the tokenizer skips it
            return None


class IncrementalDetokenizer:
    """Text deltas for ids that arrive a few at a time, decoding only a short window each time.

    Decoding all ids at every chunk is quadratic in the reply length; this keeps two offsets (as
    vLLM's detokenizer does) and holds back a delta that ends in an incomplete UTF-8 sequence.
    Stop ids are dropped (they end the reply; their text is not content).
    """

    def __init__(self, template: ChatTemplate) -> None:
        self._decode = template.decode
        self._stop = frozenset(template.stop_token_ids)
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already in the returned text

    def feed(self, new_ids: Iterable[int]) -> str:
        self._ids.extend(i for i in new_ids if i not in self._stop)
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def flush(self) -> str:
        """The rest, incomplete characters included (the reply ended inside one)."""
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]
