"""Tokenizers and chat templates for the text-level gateway tests, built once per test process.

Both use the engine's locally trained byte-level BPE (`engine.tiny_model.build_tokenizer`): one with
its ChatML/Qwen2.5 template (hermes tool calls), one with `LLAMA31_TEMPLATE` and Llama 3.1's special
tokens (llama3_json tool calls). Nothing is downloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from gateway.templating import ChatTemplate
from tests.gateway.chat_templates import LLAMA31_SPECIAL_TOKENS, LLAMA31_TEMPLATE


@functools.cache
def chatml_tokenizer() -> Any:
    from engine.tiny_model import build_tokenizer

    return build_tokenizer(seed=0)


@functools.cache
def llama31_tokenizer() -> Any:
    from engine.tiny_model import build_tokenizer

    tok = build_tokenizer(seed=0, extra_special_tokens=LLAMA31_SPECIAL_TOKENS, chat_template=LLAMA31_TEMPLATE)
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    return tok


@functools.cache
def chatml() -> ChatTemplate:
    return ChatTemplate(chatml_tokenizer(), tool_parser="hermes")


@functools.cache
def llama31() -> ChatTemplate:
    tok = llama31_tokenizer()
    # Llama 3.1's generation_config lists <|end_of_text|>, <|eom_id|> and <|eot_id|>.
    eos = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])
    return ChatTemplate(tok, tool_parser="llama3_json", generation_eos_ids=eos)


def stop_texts(ct: ChatTemplate) -> list[str]:
    return [ct.decode([i]) for i in ct.stop_token_ids]


def model_reply_ids(
    ct: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    reply: dict[str, Any],
    tools: Sequence[dict[str, Any]] | None,
) -> list[int]:
    """What a model that follows its template emits for `reply` after the prompt of `messages`: the
    reply's rendered text up to and including its end-of-turn token, tokenized on its own (as
    generated, not as part of one long string)."""
    prompt = ct.render_text(messages, tools, add_generation_prompt=True)
    full = ct.render_text([*messages, reply], tools, add_generation_prompt=False)
    assert full.startswith(prompt)
    tail = full[len(prompt) :]
    end = min(tail.index(m) + len(m) for m in stop_texts(ct) if m in tail)
    return ct.encode(tail[:end])
