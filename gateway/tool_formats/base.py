"""The record of a tool-call format (`ToolFormat`) and of a reasoning format (`ReasoningFormat`).

Each tool-call format is one module of this package holding one `ToolFormat`: how a chat template shows it
(detection signs), how a reply writes it (markers and a decoder, or a scanner of its own), how a forced
tool_choice is decoded in it (a grammar shape), and the reasoning markers its family pairs with it. The
machinery they share lives in `gateway.tool_decoders` (calls, ids, argument typing) and
`gateway.tool_scanners` (the streaming block scanner).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.tool_decoders import Decoder, Schemas, new_call_id
from gateway.tool_scanners import BlockScanner, ReplyParser, ToolCallScanner

Signs = tuple[tuple[str, ...], ...]
"""Ways a chat template shows a format: any entry whose strings all occur in the template's source."""


def json_call_tag(begin: str, params: dict[str, Any], end: str) -> dict[str, Any]:
    """A structural-tag `tag` whose content is the tool's arguments held to their JSON schema."""
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": params}, "end": end}


def quoted(name: str) -> str:
    """A function name as a JSON string (how the JSON formats write it)."""
    return json.dumps(name, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class GrammarShape:
    """How a forced tool_choice is written in a format (gateway.tool_grammar builds the structural tag)."""

    call: Callable[[str, dict[str, Any]], dict[str, Any]]
    """(function name, its parameters' JSON schema) -> the structural-tag `tag` of one call."""
    separator: str
    """Between two calls, as the family's template writes them."""
    before: str = ""
    after: str = ""
    """Around the whole list of calls (Granite's `<|tool_call|>[` ... `]`)."""


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A reasoning format: the markers around the reasoning at the start of a reply."""

    name: str
    open: str
    close: str
    signs: Signs = ()
    """How a chat template shows it (empty: only named, or paired with a tool-call format)."""
    reply_parser: Callable[[bool], ReplyParser] | None = None
    """A format of channels rather than markers (harmony): the parser of the whole reply, given whether tools
    were offered."""
    families: str = ""
    """Which model families write it (docs/models.md)."""


THINK = ReasoningFormat("think", "<think>", "</think>", signs=(("<think>",),),
                        families="Qwen3, QwQ, DeepSeek, GLM, Kimi-K2-Thinking")
"""The default: a template that never mentions reasoning still gets `<think>` split off a reply that opens it."""
MAGISTRAL = ReasoningFormat("mistral", "[THINK]", "[/THINK]", signs=(("[THINK]",),), families="Magistral")


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A tool-call format: everything the gateway knows of it, in one record (one module a format)."""

    name: str
    """The `--tool-parser` value."""
    families: str
    """Which model families write it (docs/models.md's table)."""
    example: str
    """A tool call as the family's template writes it (markdown, for docs/models.md's table)."""
    signs: Signs
    """How a chat template that renders this format shows it (gateway.model_formats; the registry's order
    is the order formats are tried in)."""
    start: str = ""
    end: str | None = None
    """The markers around a block of calls (`end=None`: the block runs to the end of the reply)."""
    decoder: Decoder | None = None
    """A block's inside -> calls (None: not a tool call; the block stays content)."""
    scanner: Callable[[Schemas], ToolCallScanner] | None = None
    """A scanner of its own, for a format that is not a block between markers (llama3_json); else a
    `BlockScanner` over `start`/`end` with `decoder`."""
    close_optional: bool = False
    """A block still open when the reply ends is decoded too (DeepSeek-R1 writes no closing marker)."""
    new_id: Callable[[], str] = new_call_id
    """The gateway's tool-call ids, of a form the family's template accepts back."""
    grammar: GrammarShape | None = None
    """How a forced tool_choice is decoded in this format (None: refused with a 400 naming the format)."""
    reasoning: ReasoningFormat | None = None
    """The family's own reasoning format, paired with this one: chosen with it when the reasoning format is
    auto (harmony's analysis channel)."""
    reply_parser: Callable[[bool], ReplyParser] | None = None
    """A format of channels rather than markers (harmony): the parser of the whole reply."""
    stop_tokens: tuple[str, ...] = ()
    """The tokens that end a reply in this format, when the vocabulary has them all (harmony's
    `<|return|>`, `<|call|>`; else the template's end of turn and the model's eos ids)."""
    aliases: tuple[str, ...] = ()
    """Other names `--tool-parser` accepts for it (SGLang's `--tool-call-parser` names)."""

    def new_scanner(self, schemas: Schemas) -> ToolCallScanner:
        """A fresh scanner for one reply, given the request's tool schemas."""
        if self.scanner is not None:
            return self.scanner(schemas)
        if self.decoder is None:
            raise TypeError(f"tool format {self.name!r} has neither a scanner nor a decoder")
        return BlockScanner(self.start, self.end, self.decoder, schemas, self.new_id,
                            close_optional=self.close_optional)
