"""gpt-oss's harmony: channels rather than markers, so the whole reply is read by `gateway.harmony`; a call is a
message `<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}`, reasoning the
`analysis` channel."""

from __future__ import annotations

from gateway.harmony import HarmonyReplyParser
from gateway.tool_formats.base import ReasoningFormat, ToolFormat
from gateway.tool_scanners import NoToolsScanner


def _reply_parser(tools: bool) -> HarmonyReplyParser:
    return HarmonyReplyParser(tools=tools)


REASONING = ReasoningFormat(
    "harmony", "<|channel|>analysis", "<|end|>", signs=(("<|channel|>", "analysis"),), reply_parser=_reply_parser,
    families="gpt-oss's `analysis` channel; `final` and `commentary` without a recipient are content")

FORMAT = ToolFormat(
    name="harmony",
    families="gpt-oss",
    example="a message `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}`",
    signs=(("<|channel|>", "<|message|>"),),
    scanner=NoToolsScanner,  # the calls are HarmonyReplyParser's
    reply_parser=_reply_parser,
    reasoning=REASONING,
    stop_tokens=("<|return|>", "<|call|>"),
    aliases=("gpt-oss",),
)
