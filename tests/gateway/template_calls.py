"""The gateway's template calls in the shapes the tests compare: token ids alone, and a reply parsed with
the template's tool-call format.

The gateway goes through `TurnService` (gateway/turns.py), which keeps the rendered text next to the ids
and picks the parser per request; these wrappers are for tests and benchmarks that check ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.templating import ChatTemplate, Message
from gateway.tool_parsers import ParsedReply, parse_reply


def render_ids(ct: ChatTemplate, messages: Sequence[Message], tools: Sequence[Any] | None) -> list[int]:
    """The prompt ids of a first turn (or of a new chain)."""
    return ct.render_prompt(messages, tools)[0]


def extension_ids(
    ct: ChatTemplate,
    prev_messages: Sequence[Message],
    prev_completion_ids: Sequence[int],
    new_messages: Sequence[Message],
    tools: Sequence[Any] | None,
) -> list[int] | None:
    """`ChatTemplate.extension`'s ids alone (None where the template is not prefix stable)."""
    ext = ct.extension(prev_messages, prev_completion_ids, new_messages, tools)
    return None if ext is None else ext[0]


def parse(ct: ChatTemplate, ids: Sequence[int], *, reasoning: bool = True, tools_offered: bool = True) -> ParsedReply:
    """Completion ids to reasoning, content and tool calls (no tool parsing when none were offered)."""
    return parse_reply(ct.completion_text(ids), ct.tool_parser if tools_offered else None, reasoning=reasoning)
