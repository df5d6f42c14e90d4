"""The registry of tool-call formats (gateway.tool_formats): every list of formats is read from it, and each
record is consistent with itself (its signs name it, its grammar writes what its parser reads). Pure text,
no tokenizer; a new format is checked here by being registered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.model_formats import detect
from gateway.settings import Settings
from gateway.tool_formats import FORMATS, REASONING_FORMATS, get_tool_format, tool_format_names
from gateway.tool_grammar import ForcedTools, structural_tag
from gateway.tool_parsers import parse_reply
from rollway.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
GRAMMAR_FORMATS = [f.name for f in FORMATS if f.grammar is not None]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_names_and_aliases_are_unique() -> None:
    names = [n for f in FORMATS for n in (f.name, *f.aliases)]
    assert len(names) == len(set(names))
    assert not {"auto", "none"} & set(names)
    assert len({r.name for r in REASONING_FORMATS}) == len(REASONING_FORMATS)


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
def test_each_formats_own_signs_name_it(fmt: str) -> None:
    """No format registered before it shadows it: a template showing any one of its signs is told as it."""
    for needles in get_tool_format(fmt).signs:
        assert detect("\n".join(needles)).tool_parser == fmt


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
def test_a_named_format_or_its_alias_is_the_format(fmt: str) -> None:
    f = get_tool_format(fmt)
    for name in (f.name, *f.aliases):
        assert Settings(tool_parser=name).tool_parser == f.name
        found = detect("{{ messages }}", tool_parser=name)
        assert (found.tool_parser, found.tool_source) == (f.name, "setting")
        if f.reasoning is not None:  # a paired reasoning format comes with it
            assert found.reasoning_parser == f.reasoning.name


def test_settings_refuse_an_unknown_parser_listing_the_registry() -> None:
    with pytest.raises(ValidationError, match=f"unknown tool parser 'qwen'; known: auto, none, "
                                              f"{', '.join(tool_format_names())}"):
        Settings(tool_parser="qwen")
    with pytest.raises(ValidationError, match="unknown reasoning parser 'deep'; known: auto, none, harmony, "):
        Settings(reasoning_parser="deep")


def test_the_cli_help_lists_the_registry() -> None:
    serve = next(a for a in build_parser()._actions if getattr(a, "choices", None)).choices["serve"]  # type: ignore[union-attr]
    help_of = {a.dest: a.help or "" for a in serve._actions}
    assert f"auto (from the chat template) | {' | '.join(tool_format_names())} | none" in help_of["tool_parser"]
    assert " | ".join(sorted(r.name for r in REASONING_FORMATS)) in help_of["reasoning_parser"]


def test_settings_validation_imports_no_templating() -> None:
    """Configuration is a leaf: validating `--tool-parser` reads the registry, not the templating or parsers."""
    code = ("import sys; from gateway.settings import Settings; Settings(tool_parser='hermes', reasoning_parser='think',"
            " chat_template_kwargs={'x': 1}); heavy = [m for m in ('gateway.templating', 'gateway.tool_parsers', "
            "'gateway.tool_grammar', 'gateway.errors', 'transformers', 'fastapi') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_docs_table_is_the_registrys() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import model_matrix
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    doc = (ROOT / "docs" / "models.md").read_text()
    table = doc.split(model_matrix.FORMATS_START, 1)[1].split(model_matrix.FORMATS_END, 1)[0]
    assert table.strip() == model_matrix.formats_table(), "run: python scripts/model_matrix.py --formats"


def _forced_text(node: dict, args: dict[str, dict]) -> str:
    """The text a structural tag forces, with `args[name]` written where a tool's JSON arguments go."""
    kind = node["type"]
    if kind == "structural_tag":
        return _forced_text(node["format"], args)
    if kind == "sequence":
        return "".join(_forced_text(e, args) for e in node["elements"])
    if kind == "const_string":
        return str(node["value"])
    if kind == "tags_with_separator":
        return str(node["separator"]).join(_forced_text(t, args) for t in node["tags"])
    assert kind == "tag" and node["content"]["type"] == "json_schema", node
    name = next(n for n in args if json.dumps(n) in node["begin"])
    return f"{node['begin']}{json.dumps(args[name])}{node['end']}"


@pytest.mark.parametrize("fmt", GRAMMAR_FORMATS)
def test_what_a_formats_grammar_forces_its_parser_reads(fmt: str) -> None:
    """parse(grammar(calls)) == calls, for one call and for two, whole: the grammar writes the format's own markup."""
    args = {"get_weather": {"city": "Zürich", "days": 2}, "get_time": {}}
    for forced in (ForcedTools("get_weather", parallel=False), ForcedTools(None)):
        tag = json.loads(structural_tag(fmt, TOOLS, forced))
        text = _forced_text(tag, args)
        reply = parse_reply(text, get_tool_format(fmt), tools=TOOLS)
        want = ["get_weather"] if forced.name else ["get_weather", "get_time"]
        assert [c.name for c in reply.tool_calls] == want, text
        assert [json.loads(c.arguments) for c in reply.tool_calls] == [args[n] for n in want]
        assert reply.content is None, text
