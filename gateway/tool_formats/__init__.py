"""The tool-call formats the gateway reads and writes: one module a format, registered here in one place.

A format's module holds one `ToolFormat` (gateway.tool_formats.base): its detection signs, markers, decoder or
scanner, grammar shape and paired reasoning format. Everything that lists formats reads `FORMATS`: detection
from a chat template (gateway.model_formats), `--tool-parser` (gateway.settings, `rollway serve --help`), the
reply parsers (gateway.tool_parsers), forced tool_choice (gateway.tool_grammar) and docs/models.md's table
(scripts/model_matrix.py). Adding a format is a module here, a line in `FORMATS`, and its tests.

Importing this package is cheap (the standard library and the shared parsing machinery), so settings
validation may use it.
"""

from __future__ import annotations

from gateway.tool_formats import (
    deepseek,
    glm45,
    granite,
    harmony,
    hermes,
    kimi_k2,
    llama3_json,
    mistral,
    nemotron_json,
    qwen3_coder,
)
from gateway.tool_formats.base import MAGISTRAL, THINK, GrammarShape, ReasoningFormat, Signs, ToolFormat

__all__ = [
    "FORMATS",
    "REASONING_FORMATS",
    "THINK",
    "GrammarShape",
    "ReasoningFormat",
    "Signs",
    "ToolFormat",
    "get_reasoning_format",
    "get_tool_format",
    "reasoning_format_names",
    "tool_format_names",
]

FORMATS: tuple[ToolFormat, ...] = (
    # In the order a chat template is tried against their signs: a template that renders `<tool_call>` with
    # `<function=` inside is Qwen3-Coder's, not Hermes'; `<tool_call>` alone is Hermes'.
    harmony.FORMAT,
    kimi_k2.FORMAT,
    deepseek.FORMAT,
    glm45.FORMAT,
    qwen3_coder.FORMAT,
    mistral.FORMAT,
    nemotron_json.FORMAT,
    granite.FORMAT,
    hermes.FORMAT,
    llama3_json.FORMAT,
)
"""Every tool-call format, in detection order."""

REASONING_FORMATS: tuple[ReasoningFormat, ...] = (
    *dict.fromkeys(f.reasoning for f in FORMATS if f.reasoning is not None and f.reasoning != THINK), MAGISTRAL, THINK)
"""Every reasoning format, in detection order: those paired with a tool-call format first, `think` last."""

_TOOL_BY_NAME: dict[str, ToolFormat] = {n: f for f in FORMATS for n in (f.name, *f.aliases)}
_REASONING_BY_NAME: dict[str, ReasoningFormat] = {r.name: r for r in REASONING_FORMATS}


def tool_format_names() -> list[str]:
    """The formats' names (without aliases), sorted."""
    return sorted(f.name for f in FORMATS)


def reasoning_format_names() -> list[str]:
    return sorted(_REASONING_BY_NAME)


def get_tool_format(name: str) -> ToolFormat:
    """The format named `name` (or one of its aliases); ValueError lists the known ones."""
    try:
        return _TOOL_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(tool_format_names())}") from None


def get_reasoning_format(name: str) -> ReasoningFormat:
    try:
        return _REASONING_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_format_names())}") from None
