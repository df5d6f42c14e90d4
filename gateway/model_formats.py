"""Which tool-call and reasoning formats a model speaks, told from its chat template.

A chat template renders an assistant message's tool calls in the model's own format, so the markup it
writes names the format (checked in this order: a template that renders `<tool_call>` with `<function=`
inside is Qwen3-Coder's, not Hermes'):

    <|channel|> ... <|message|>            harmony      (gpt-oss: tool calls and reasoning)
    <|tool_calls_section_begin|>           kimi_k2
    <｜tool▁calls▁begin｜>                  deepseek     (V3.x, R1)
    <arg_key>                              glm45        (GLM-4.5, 4.6, 4.7)
    <function=  and  <parameter=           qwen3_coder
    [TOOL_CALLS]                           mistral
    <|tool_call|>                          granite      (Granite 3.x)
    <tool_call>                            hermes       (Qwen2.5, Qwen3, QwQ, Hermes 2/3, Granite 4)
    <|python_tag|>, "parameters"           llama3_json  (Llama 3.1, 3.2, 3.3)

Reasoning: `[THINK]` in the template is Magistral's format, harmony its channels, anything else `<think>`
(split off only when a reply opens it, or when the generation prompt did: `ChatTemplate.opens_reasoning`).
A template that mentions tools in none of these ways is unknown: the gateway starts with a warning and
refuses requests that carry tools until `--tool-parser` names the format (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass

_TOOL_SIGNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("deepseek", ("tool▁calls▁begin",)),
    ("glm45", ("<arg_key>",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("granite", ("<|tool_call|>",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('"parameters"', "<|eot_id|>")),
)
_REASONING_SIGNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "analysis")),
    ("mistral", ("[THINK]",)),
    ("think", ("<think>",)),
)


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


def _first(signs: tuple[tuple[str, tuple[str, ...]], ...], source: str) -> str | None:
    return next((name for name, needles in signs if all(n in source for n in needles)), None)


def detect(template_source: str, *, tool_parser: str = "auto", reasoning_parser: str = "auto") -> ModelFormats:
    """The formats for a template: a named parser wins over detection; "none" turns one off."""
    if tool_parser == "auto":
        tool, tool_from = _first(_TOOL_SIGNS, template_source), "template"
    else:
        tool, tool_from = (None, "none") if tool_parser == "none" else (tool_parser, "setting")
    if reasoning_parser == "auto":
        # A template that never mentions reasoning still gets `<think>` split off a reply that opens it.
        reasoning = _first(_REASONING_SIGNS, template_source)
        reasoning_from = "template" if reasoning else "default"
        reasoning = reasoning or "think"
        if tool == "harmony":
            reasoning, reasoning_from = "harmony", "template"
    else:
        reasoning, reasoning_from = (None, "none") if reasoning_parser == "none" else (reasoning_parser, "setting")
    if tool is None and tool_from == "template":
        tool_from = "none"
    return ModelFormats(tool, reasoning, tool_from, reasoning_from)
