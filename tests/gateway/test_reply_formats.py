"""The tool-call and reasoning formats beyond Hermes and Llama 3 (pure text; no tokenizer needed): each read
whole, under random chunkings of the stream, malformed blocks kept as content, and chosen from the markup of
a template. The same formats on the families' real templates are in test_model_families.py."""

from __future__ import annotations

import json
import random
import re

import pytest

from gateway.model_formats import detect
from gateway.tool_parsers import ParsedReply, get_reasoning_parser, get_tool_parser, parse_reply, reply_parser

ARGS = {"city": "Paris", "days": 3}

# format -> (reply text with one call to get_weather(ARGS) after "Let me check.", markup that must not leak)
CALLS = {
    "qwen3_coder": ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "glm45": "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "kimi_k2": "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "mistral": 'Let me check.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "days": 3}',
    "granite": 'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "nemotron_json": 'Let me check.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</TOOLCALL>',
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
MARKUP = re.compile(r"<\|?/?(tool|function|parameter|arg_|think|TOOLCALL)|\[TOOL_CALLS\]|\[ARGS\]|<｜|<\|tool")


def _streamed(text: str, fmt: str, rng: random.Random, **kw: object) -> tuple[ParsedReply, dict[str, str]]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 15))))
    parser = reply_parser(get_tool_parser(fmt), kw.get("reasoning", True), tools=TOOLS,  # type: ignore[arg-type]
                          in_reasoning=bool(kw.get("in_reasoning", False)))
    emitted = {"content": "", "reasoning_content": ""}
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        for kind, piece in parser.feed(text[a:b]):
            emitted[kind] += piece
    return parser.finish(), emitted


@pytest.mark.parametrize("fmt", list(CALLS))
def test_each_format_reads_its_call_whole_and_streamed(fmt: str) -> None:
    text = CALLS[fmt]
    whole = parse_reply(text, get_tool_parser(fmt), tools=TOOLS)
    assert whole.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", ARGS)]
    rng = random.Random(7)
    for _ in range(60):
        final, emitted = _streamed(text, fmt, rng)
        assert (final.content, [(c.name, c.arguments) for c in final.tool_calls]) == \
            (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
        assert (final.content or "").startswith(emitted["content"]) and not MARKUP.search(emitted["content"])


@pytest.mark.parametrize("fmt", [f for f in CALLS if f not in ("mistral", "granite")])
def test_a_malformed_call_stays_content(fmt: str) -> None:
    """A block that does not decode is text, as the model wrote it (never an exception)."""
    broken = CALLS[fmt].replace('"days": 3}', '"days": 3').replace("</function>", "</func>").replace(
        "<arg_value>3</arg_value>", "3")
    reply = parse_reply(broken, get_tool_parser(fmt), tools=TOOLS)
    assert reply.tool_calls == [] and reply.content == broken.strip()


def test_nemotron_calls_are_one_json_list_after_the_reasoning() -> None:
    """Nemotron Nano 2 writes all of a reply's calls in one `<TOOLCALL>[...]</TOOLCALL>`, after the reasoning its
    generation prompt opened; an argument object may come as a JSON string. Anything but a non-empty list of
    named calls in a closed block is content, as written."""
    fmt = get_tool_parser("nemotron_json")
    text = ('Two calls.\n</think>\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]</TOOLCALL>')
    for reply in (parse_reply(text, fmt, in_reasoning=True, tools=TOOLS),
                  _streamed(text, fmt.name, random.Random(3), in_reasoning=True)[0]):
        assert (reply.reasoning_content, reply.content) == ("Two calls.", None)
        assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == \
            [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    for broken in ('<TOOLCALL>{"name": "get_weather", "arguments": {}}</TOOLCALL>', "<TOOLCALL>[]</TOOLCALL>",
                   '<TOOLCALL>[{"arguments": {}}]</TOOLCALL>', '<TOOLCALL>[{"name": "get_weather", "arguments": {}}]'):
        reply = parse_reply(broken, fmt, tools=TOOLS)
        assert reply.tool_calls == [] and reply.content == broken


def test_xml_values_follow_the_schema() -> None:
    """A string parameter stays a string even when it reads as JSON; others are JSON when they parse."""
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n42\n</parameter>\n<parameter=n>\n42\n</parameter>\n"
            "<parameter=tags>\n[\"a\"]\n</parameter>\n<parameter=note>\nnot json\n</parameter>\n</function>\n</tool_call>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"code": {"type": "string"}}}}}]
    (call,) = parse_reply(text, get_tool_parser("qwen3_coder"), tools=tools).tool_calls
    assert json.loads(call.arguments) == {"code": "42", "n": 42, "tags": ["a"], "note": "not json"}


def test_mistral_v3_list_and_ids_the_template_accepts() -> None:
    text = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    reply = parse_reply(text, get_tool_parser("mistral"))
    assert [c.name for c in reply.tool_calls] == ["a", "b"] and reply.content is None
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in reply.tool_calls)
    two = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert [c.name for c in parse_reply(two, get_tool_parser("mistral")).tool_calls] == ["a", "b"]


def test_deepseek_r1_call_form_and_an_unclosed_section() -> None:
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>')
    (call,) = parse_reply(text, get_tool_parser("deepseek")).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", ARGS)
    cut = text[: text.index("```<")]  # cut off inside the call: stays content
    assert parse_reply(cut, get_tool_parser("deepseek")).tool_calls == []


HARMONY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
           '<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}')


def test_harmony_channels_whole_and_streamed() -> None:
    fmt = get_tool_parser("harmony")
    reply = parse_reply(HARMONY, fmt, reasoning=get_reasoning_parser("harmony"))
    assert reply.reasoning_content == "Need the weather." and reply.content is None
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", ARGS)]
    final = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.")
    answer = parse_reply(final, None, reasoning=get_reasoning_parser("harmony"))
    assert (answer.reasoning_content, answer.content) == ("Think.", "It is sunny.")
    rng = random.Random(3)
    for text in (HARMONY, final):
        whole = parse_reply(text, fmt, reasoning=get_reasoning_parser("harmony"))
        for _ in range(60):
            got, emitted = _streamed(text, "harmony", rng, reasoning=get_reasoning_parser("harmony"))
            assert (got.content, got.reasoning_content) == (whole.content, whole.reasoning_content)
            for kind in emitted:
                assert (getattr(got, kind) or "").startswith(emitted[kind])
                assert "<|" not in emitted[kind] and "commentary" not in emitted[kind]


def test_reasoning_opened_by_the_prompt_and_magistral_markers() -> None:
    r1 = parse_reply("Plan.\n</think>\n\nAnswer.", None, in_reasoning=True)
    assert (r1.reasoning_content, r1.content) == ("Plan.", "Answer.")
    mistral = parse_reply("[THINK]Plan.[/THINK]Answer.", None, reasoning=get_reasoning_parser("mistral"))
    assert (mistral.reasoning_content, mistral.content) == ("Plan.", "Answer.")


@pytest.mark.parametrize(("markup", "tool", "reasoning"), [
    ("{{ '<tool_call>' }}{{ '<think>' }}", "hermes", "think"),
    ("<tool_call>\n<function=x>\n<parameter=y>", "qwen3_coder", "think"),
    ("<tool_call>{{ name }}<arg_key>k</arg_key><think>", "glm45", "think"),
    ("<|tool_calls_section_begin|>", "kimi_k2", "think"),
    ("<｜tool▁calls▁begin｜><think>", "deepseek", "think"),
    ("[TOOL_CALLS][THINK]", "mistral", "mistral"),
    ("<|tool_call|>", "granite", "think"),
    ("<AVAILABLE_TOOLS>...<TOOLCALL>[{...}]</TOOLCALL>...<think>\n", "nemotron_json", "think"),
    ("<|python_tag|><|eot_id|>", "llama3_json", "think"),
    ('{"name": ..., "parameters": ...}<|eot_id|>', "llama3_json", "think"),
    ("<|start|>assistant<|channel|>final<|message|>", "harmony", "harmony"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None, "think"),
])
def test_formats_are_told_from_the_template(markup: str, tool: str | None, reasoning: str) -> None:
    found = detect(markup)
    assert (found.tool_parser, found.reasoning_parser) == (tool, reasoning)
    assert detect(markup, tool_parser="hermes", reasoning_parser="none").tool_parser == "hermes"
    assert detect(markup, tool_parser="none").tool_parser is None
