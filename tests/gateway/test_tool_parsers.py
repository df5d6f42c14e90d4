"""Tool-call and reasoning parsing, whole and streamed (pure text; no tokenizer needed)."""

from __future__ import annotations

import json
import random
import re

import pytest

from gateway.tool_formats import FORMATS
from gateway.tool_parsers import (
    ParsedReply,
    StreamingReplyParser,
    ToolParser,
    get_tool_parser,
    parse_reply,
)

HERMES = get_tool_parser("hermes")
LLAMA = get_tool_parser("llama3_json")


def calls(reply: ParsedReply) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in reply.tool_calls]


def test_unknown_parser_lists_the_known_ones() -> None:
    known = ", ".join(sorted(f.name for f in FORMATS))
    assert known.startswith("deepseek, glm45, granite, harmony, hermes, kimi_k2, llama3_json, mistral, ")
    with pytest.raises(ValueError, match=re.escape(f"unknown tool parser 'qwen'; known: {known}")):
        get_tool_parser("qwen")


# --- hermes -----------------------------------------------------------------------------------------


def test_hermes_content_and_two_calls() -> None:
    text = (
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n</tool_call>'
    )
    reply = parse_reply(text, HERMES)
    assert reply.content == "Let me check both."
    assert reply.reasoning_content is None
    # arguments are re-serialised with json.dumps(ensure_ascii=False): "ü" stays as it is
    assert calls(reply) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Zürich", "unit": "C"}'),
    ]
    ids = [c.id for c in reply.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and ids[0] != ids[1]


def test_hermes_only_calls_gives_null_content() -> None:
    text = '\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n'
    reply = parse_reply(text, HERMES)
    assert (reply.content, reply.reasoning_content) == (None, None)
    assert calls(reply) == [("search", "{}")]


def test_hermes_text_between_and_after_blocks_is_content() -> None:
    text = 'A <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> B <tool_call>{"name": "g"}</tool_call> C'
    reply = parse_reply(text, HERMES)
    assert reply.content == "A  B  C"  # the outside text, joined, stripped at the ends
    assert calls(reply) == [("f", '{"x": 1}'), ("g", "{}")]  # missing arguments: {}


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # empty name
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["f"]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_hermes_malformed_block_stays_text(block: str) -> None:
    text = "Before. " + block
    reply = parse_reply(text, HERMES)
    assert reply == ParsedReply(text, None, [])


def test_hermes_malformed_block_next_to_a_good_one() -> None:
    text = '<tool_call>{bad}</tool_call><tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call>'
    reply = parse_reply(text, HERMES)
    assert reply.content == "<tool_call>{bad}</tool_call>"
    assert calls(reply) == [("f", '{"a": "b"}')]


def test_hermes_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"x y\\"}"}</tool_call>'
    assert calls(parse_reply(text, HERMES)) == [("f", '{"q": "x y"}')]


# --- llama3_json ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
        ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', [("f", '{"x": 1}')]),
        (' \n<|python_tag|> {"name": "f", "arguments": {"x": 1}} ', [("f", '{"x": 1}')]),
        (
            '{"name": "f", "parameters": {"s": "a;b"}}; {"name": "g", "parameters": {}}',
            [("f", '{"s": "a;b"}'), ("g", "{}")],
        ),
        ('{"name": "f", "parameters": {}};', [("f", "{}")]),
        ('{"name": "f"}', [("f", "{}")]),
    ],
)
def test_llama3_json_calls(text: str, expected: list[tuple[str, str]]) -> None:
    reply = parse_reply(text, LLAMA)
    assert reply.content is None
    assert calls(reply) == expected


@pytest.mark.parametrize(
    "text",
    [
        '{"answer": 42}',  # JSON, but not a call
        'Sure: {"name": "f", "parameters": {}}',  # a call inside prose is not a call
        '{"name": "f", "parameters": {}} and more',  # trailing text
        '{"name": "f", "parameters": {}}; oops',
        '{"name": "f", "parameters": ',  # cut off
        "<|python_tag|>print(1)",
        "Plain answer.",
    ],
)
def test_llama3_json_anything_else_stays_text(text: str) -> None:
    assert parse_reply(text, LLAMA) == ParsedReply(text.strip(), None, [])


# --- reasoning ---------------------------------------------------------------------------------------


def test_reasoning_is_split_from_a_leading_think_block() -> None:
    text = '<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>'
    reply = parse_reply(text, HERMES)
    assert reply.reasoning_content == "The user wants Paris."
    assert reply.content is None
    assert calls(reply) == [("w", "{}")]


def test_reasoning_off_keeps_think_as_content() -> None:
    text = "<think>hm</think>Answer."
    assert parse_reply(text, HERMES, reasoning=False) == ParsedReply(text, None, [])


def test_unclosed_think_is_all_reasoning() -> None:
    assert parse_reply("<think>still going", HERMES) == ParsedReply("", "still going", [])


def test_think_not_at_the_start_is_content() -> None:
    text = "Answer <think>x</think>"
    assert parse_reply(text, HERMES) == ParsedReply(text, None, [])


def test_generation_prompt_that_opened_think() -> None:
    reply = parse_reply("plan\n</think>\n\nDone.", HERMES, in_reasoning=True)
    assert reply == ParsedReply("Done.", "plan", [])


def test_no_tool_parser_parses_no_calls() -> None:
    text = '<tool_call>{"name": "f"}</tool_call>'
    assert parse_reply(text, None) == ParsedReply(text, None, [])


def test_empty_reply_has_empty_content() -> None:
    assert parse_reply("", HERMES) == ParsedReply("", None, [])
    assert parse_reply("<think></think>", HERMES) == ParsedReply("", None, [])


# --- streaming ---------------------------------------------------------------------------------------


def test_streaming_holds_back_a_possible_marker() -> None:
    p = StreamingReplyParser(HERMES)
    assert p.feed("<th") == []
    assert p.feed("ink>Let") == [("reasoning_content", "Let")]
    assert p.feed(" me think </th") == [("reasoning_content", " me think")]  # "</th" and " " held
    assert p.feed("ink>\n\nHi <tool") == [("content", "Hi")]
    assert p.feed('_call>{"name": "f", "arguments": {}}</tool') == []
    assert p.tool_calls == []
    assert p.feed("_call> bye") == [("content", "  bye")]  # the held " " comes back with the next text
    assert [c.name for c in p.tool_calls] == ["f"]
    final = p.finish()
    assert final.content == "Hi  bye" and final.reasoning_content == "Let me think"


def test_streaming_false_alarm_releases_the_held_text() -> None:
    p = StreamingReplyParser(HERMES)
    assert p.feed("x <tool") == [("content", "x")]
    assert p.feed("box> y") == [("content", " <toolbox> y")]


def test_streaming_llama_json_is_held_until_the_end() -> None:
    p = StreamingReplyParser(LLAMA)
    assert p.feed(' {"name": "f", ') == []
    assert p.feed('"parameters": {}}') == []
    final = p.finish()
    assert final.content is None and calls(final) == [("f", "{}")]

    p = StreamingReplyParser(LLAMA)
    assert p.feed("The answer") == [("content", "The answer")]
    assert p.feed(' is {"x": 1}') == [("content", ' is {"x": 1}')]


def _replies() -> list[str]:
    think = ["", "<think>\nLet me see: 2 < 3 and </thi is not a tag.\n</think>\n\n", "<think>unclosed "]
    bodies = [
        "Plain answer with <tool box> and a trailing space ",
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": {"k": "<tool_call>"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nDone.',
        '<tool_call>\n{"name": "bad" "arguments": {}}\n</tool_call> after',
        'Tail <tool_call>{"name": "x", "arguments": {}}',
        "ends with a partial marker <tool_ca",
        "ünïcödé ✓ text\n\n  ",
        "",
    ]
    llama = [
        '<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}; {"name": "g", "parameters": {}}',
        ' {"name": "f", "parameters": {"x": 1}}',
        '{"not": "a call"}',
        "<|python_ta",
        'Text first {"name": "f"}',
    ]
    return [t + b for t in think for b in bodies + llama]


@pytest.mark.parametrize("parser", [HERMES, LLAMA], ids=lambda p: p.name)
@pytest.mark.parametrize("reasoning", [True, False])
def test_random_chunkings_stream_the_same_reply(parser: ToolParser, reasoning: bool) -> None:
    rng = random.Random(1234)
    for text in _replies():
        whole = parse_reply(text, parser, reasoning=reasoning)
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 12))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            p = StreamingReplyParser(parser, reasoning)
            emitted = {"content": "", "reasoning_content": ""}
            for piece in pieces:
                for kind, delta in p.feed(piece):
                    assert delta
                    emitted[kind] += delta
            final = p.finish()
            assert (final.content, final.reasoning_content) == (whole.content, whole.reasoning_content), text
            assert calls(final) == calls(whole)
            # what was streamed is a prefix of the final value: text that became a tool call never was
            assert (final.content or "").startswith(emitted["content"]), (text, pieces)
            assert (final.reasoning_content or "").startswith(emitted["reasoning_content"]), (text, pieces)
            for call in final.tool_calls:
                assert json.loads(call.arguments) is not None


def test_stream_releases_everything_when_the_reply_ends_cleanly() -> None:
    """Held-back text is only ever a possible marker, an open block or trailing whitespace."""
    text = 'Hi.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nBye.'
    p = StreamingReplyParser(HERMES)
    streamed = "".join(d for ch in text for _, d in p.feed(ch))
    assert streamed == p.finish().content == "Hi.\n\nBye."


def test_feed_after_finish_is_an_error() -> None:
    p = StreamingReplyParser(HERMES)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")
