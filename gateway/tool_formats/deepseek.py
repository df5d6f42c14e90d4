"""DeepSeek V3.x and R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>` (R1: `function<｜tool▁sep｜>f\\n```json\\n{...}\\n```` inside)."""

from __future__ import annotations

import re

from gateway.tool_decoders import ParsedToolCall, Schemas, call_from_args, repeated
from gateway.tool_formats.base import ToolFormat

_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_R1_ARGS = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.S)


def _call(m: re.Match[str]) -> ParsedToolCall | None:
    head, rest = m.group(1).strip(), m.group(2)
    r1 = _R1_ARGS.fullmatch(rest) if head == "function" else None
    if r1 is not None:  # R1: function<｜tool▁sep｜>name\n```json\n{...}\n```
        return call_from_args(r1.group(1).strip(), r1.group(2).strip())
    return call_from_args(head, rest.strip())


def decode(inner: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    return repeated(_CALL, inner, _call)


FORMAT = ToolFormat(
    name="deepseek",
    families="DeepSeek V3.1, V3.x, R1",
    example="`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` "
            "(R1: `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` inside)",
    signs=(("tool▁calls▁begin",),),
    start="<｜tool▁calls▁begin｜>", end="<｜tool▁calls▁end｜>", decoder=decode,
    # DeepSeek-R1's template writes no `<｜tool▁calls▁end｜>` after a single call, and models trained on it
    # may not either.
    close_optional=True,
    aliases=("deepseekv3", "deepseekv31"),
)
