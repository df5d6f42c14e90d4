"""Pieces of `gateway.templating`: templates that are not prefix stable, stop ids, message forms,
replies and incremental decoding."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.hf_messages import hf_message
from gateway.templating import ChatTemplate, IncrementalDetokenizer
from gateway.tool_parsers import ParsedReply, ParsedToolCall
from tests.gateway.template_calls import extension_ids, parse, render_ids
from tests.gateway.text_tokenizers import chatml, chatml_tokenizer, llama31

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]

# --- templates that are not prefix stable ----------------------------------------------------------

# Qwen3's habit, reduced: reasoning is rendered only for assistant messages after the last user message.
STRIPS_OLD_REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A final assistant message left open (as for "continue this message"), closed once more follows.
OPEN_FINAL_REPLY = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- if not (loop.last and m.role == 'assistant') %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# History that changes with every call: a message count in the system line.
COUNTS_MESSAGES = (
    "{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

THOUGHTFUL = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
]


def test_template_that_strips_old_reasoning() -> None:
    ct = ChatTemplate(chatml_tokenizer(), chat_template=STRIPS_OLD_REASONING)
    done = [*ct.encode("<think>\nGreet back.\n</think>\n\nHello."), ct.end_of_turn_id]
    # a tool result keeps the reasoning in history: prefix stable, extends
    ext = extension_ids(ct, THOUGHTFUL, done, [{"role": "tool", "content": "x"}], None)
    assert ext is not None and ct.decode(ext) == "\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n"
    # a new user message strips it: not prefix stable, so a new chain
    assert extension_ids(ct, THOUGHTFUL, done, [{"role": "user", "content": "Again"}], None) is None


def test_template_that_leaves_the_final_reply_open() -> None:
    ct = ChatTemplate(chatml_tokenizer(), chat_template=OPEN_FINAL_REPLY)
    done = [*ct.encode("Hello."), ct.end_of_turn_id]
    # "...Hi<|im_end|>\n<|im_start|>assistant\nHello." is a prefix of the longer render, but the reply has
    # no end-of-turn of its own there; taking Hi's would put the reply's text into the bridge. What the longer
    # render writes next starts with the stop token the model emitted (as GLM's next header does): the chain
    # holds it once, and the extension is what follows it.
    ext = extension_ids(ct, THOUGHTFUL, done, [{"role": "user", "content": "Again"}], None)
    assert ext == ct.encode("\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
    cut_off = ct.encode("Hello.")  # no stop token emitted: nothing to tell where the reply ends
    assert extension_ids(ct, THOUGHTFUL, cut_off, [{"role": "user", "content": "Again"}], None) is None


def test_template_that_rewrites_history() -> None:
    ct = ChatTemplate(chatml_tokenizer(), chat_template=COUNTS_MESSAGES)
    done = [*ct.encode("Hello."), ct.end_of_turn_id]
    assert extension_ids(ct, THOUGHTFUL, done, [{"role": "user", "content": "Again"}], None) is None


# --- pieces ----------------------------------------------------------------------------------------


def test_end_of_turn_and_stop_ids() -> None:
    ct, tok = chatml(), chatml().tokenizer
    assert (ct.end_of_turn, ct.stop_token_ids) == ("<|im_end|>", [tok.convert_tokens_to_ids("<|im_end|>")])
    # the Llama tokenizer also carries <|im_end|>; the template's own token wins
    ll, ltok = llama31(), llama31().tokenizer
    assert ll.end_of_turn == "<|eot_id|>"
    assert ll.stop_token_ids == ltok.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])


def test_stop_ids_from_generation_config(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    chatml_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert tok.convert_ids_to_tokens([2, 0]) == ["<|im_end|>", "<|endoftext|>"]
    assert ChatTemplate(tok).stop_token_ids == [2, 0]  # eos ids first, end-of-turn deduplicated
    assert ChatTemplate(tok, generation_eos_ids=[0]).stop_token_ids == [0, 2]


def test_hf_message_normalises_openai_form() -> None:
    msg = {
        "role": "assistant",
        "content": None,
        "name": None,
        "reasoning_content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    assert hf_message(msg) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "tool_calls": [],
    }
    assert hf_message(parts) == {"role": "user", "content": "ab"}
    with pytest.raises(BadRequest, match="image_url"):
        hf_message({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})


def test_openai_and_hf_forms_render_the_same() -> None:
    ct = chatml()
    hf_form = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
    ]
    openai_form = [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":   "Paris"}'},
                }
            ],
        },
    ]
    assert render_ids(ct, hf_form, TOOLS) == render_ids(ct, openai_form, TOOLS)
    assert (
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in ct.render_text(openai_form, TOOLS)
    )


def test_assistant_message_shape() -> None:
    parsed = ParsedReply(None, "think", [ParsedToolCall("call_1", "f", '{"a": 1}')])
    assert chatml().assistant_message(parsed) == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    assert chatml().assistant_message(ParsedReply("hi", None, [])) == {"role": "assistant", "content": "hi"}


def test_completion_text_keeps_markers_and_drops_the_stop_token() -> None:
    ct = chatml()
    ids = [*ct.encode('<think>x</think><tool_call>\n{"name": "f"}\n</tool_call>'), ct.end_of_turn_id]
    assert ct.completion_text(ids) == '<think>x</think><tool_call>\n{"name": "f"}\n</tool_call>'
    assert [c.name for c in parse(ct, ids).tool_calls] == ["f"]


def test_incremental_detokenizer_matches_one_decode() -> None:
    ct = chatml()
    text = "Grüße, 世界! 🙂 <tool_call> ok\n\n  é"
    ids = [*ct.encode(text), ct.end_of_turn_id]
    rng = random.Random(7)
    for _ in range(30):
        d = IncrementalDetokenizer(ct)
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out.append(d.feed(ids[i : i + n]))
            i += n
        out.append(d.flush())
        assert all("\ufffd" not in piece for piece in out)
        assert "".join(out) == text


# --- rendering is transformers' own ------------------------------------------------------------------

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "rain"},
     {"role": "assistant", "content": "It rains.", "reasoning_content": "Report it."},
     {"role": "user", "content": "Thanks"}],
]


@pytest.mark.parametrize("make", [chatml, llama31], ids=["chatml", "llama31"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_text_equals_apply_chat_template(make: Any, with_tools: bool) -> None:
    """The gateway renders with transformers' compiled template directly; the text is apply_chat_template's."""
    ct = make()
    tools = TOOLS if with_tools else None
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = ct.tokenizer.apply_chat_template(
                [hf_message(m) for m in messages], tools=tools, add_generation_prompt=gen, tokenize=False
            )
            assert ct.render_text(messages, tools, add_generation_prompt=gen) == expected


def test_reasoning_reaches_templates_under_each_name() -> None:
    template = "{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}]{% endfor %}"
    ct = ChatTemplate(chatml_tokenizer(), chat_template=template)
    assert ct.render_text(THOUGHTFUL, None) == "[|][Greet back.|Greet back.]"


def test_common_prefix_len_matches_a_character_loop() -> None:
    from gateway.templating import _common_prefix_len

    rng = random.Random(0)
    for _ in range(5000):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert _common_prefix_len(a, b) == n, (a, b)


# The generation prompt opens a think block whose first character is also the end marker's.
THINK_PROMPT = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def test_an_empty_reply_extends_when_the_generation_prompt_shares_the_markers_first_character() -> None:
    ct = ChatTemplate(chatml_tokenizer(), chat_template=THINK_PROMPT)
    prev = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    parent_prompt = ct.render_text(prev[:1], None, add_generation_prompt=True)
    new = [{"role": "user", "content": "Again"}]
    got = ct.extension(prev, [ct.end_of_turn_id], new, None, parent_prompt=parent_prompt)
    assert got is not None
    assert got[0] == ct.encode("\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert got == ct.extension(prev, [ct.end_of_turn_id], new, None)  # as without the kept prompt text
