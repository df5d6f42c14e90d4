"""Which tool-call and reasoning formats a model speaks, told from its chat template.

A chat template renders an assistant message's tool calls in the model's own format, so the markup it
writes names the format: each format's record (gateway.tool_formats) lists its signs, and the formats are
tried in the registry's order (a template that renders `<tool_call>` with `<function=` inside is
Qwen3-Coder's, not Hermes'). docs/models.md "Formats" lists them.

Reasoning: the reasoning formats' signs in the same way (`[THINK]` is Magistral's, harmony's its
channels), anything else `<think>` (split off only when a reply opens it, or when the generation prompt did:
`ChatTemplate.opens_reasoning`); a tool-call format with a reasoning format of its own (harmony) brings it.
A template that mentions tools in none of these ways is unknown: the gateway starts with a warning and
refuses requests that carry tools until `--tool-parser` names the format (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_formats import FORMATS, REASONING_FORMATS, THINK, Signs, get_tool_format


@dataclass(frozen=True, slots=True)
class ModelFormats:
    tool_parser: str | None
    """None: the template's tool-call format is unknown (requests with tools are refused)."""
    reasoning_parser: str | None
    """None: no reasoning split."""
    tool_source: str
    reasoning_source: str
    """'template' (detected), 'setting' (named by --tool-parser / --reasoning-parser) or 'none'."""

    def describe(self) -> str:
        tools = self.tool_parser or "unknown (requests with tools are refused; name it with --tool-parser)"
        return (f"tool-call format {tools} ({self.tool_source}), reasoning format "
                f"{self.reasoning_parser or 'none'} ({self.reasoning_source})")


def _shows(signs: Signs, source: str) -> bool:
    return any(all(n in source for n in needles) for needles in signs)


def detect(template_source: str, *, tool_parser: str = "auto", reasoning_parser: str = "auto") -> ModelFormats:
    """The formats for a template: a named parser wins over detection (an alias names its format); "none"
    turns one off."""
    if tool_parser == "auto":
        tool = next((f.name for f in FORMATS if _shows(f.signs, template_source)), None)
        tool_from = "template" if tool else "none"
    else:
        tool, tool_from = (None, "none") if tool_parser == "none" else (get_tool_format(tool_parser).name, "setting")
    reasoning: str | None
    if reasoning_parser == "auto":
        paired = get_tool_format(tool).reasoning if tool else None
        if paired is not None:
            reasoning, reasoning_from = paired.name, "template"
        else:
            # A template that never mentions reasoning still gets `<think>` split off a reply that opens it.
            shown = next((r.name for r in REASONING_FORMATS if _shows(r.signs, template_source)), None)
            reasoning, reasoning_from = (shown, "template") if shown else (THINK.name, "default")
    else:
        reasoning, reasoning_from = (None, "none") if reasoning_parser == "none" else (reasoning_parser, "setting")
    return ModelFormats(tool, reasoning, tool_from, reasoning_from)
