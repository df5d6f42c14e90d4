"""Write the model-family matrix of docs/models.md: every family's real chat template and vocabulary run
through the gateway's templating, parsers and continuity (tests/model_checks.py), one row a family; and the
table of tool-call formats, one row a format of the registry (gateway.tool_formats).

    python scripts/model_matrix.py            # rewrites both tables between their markers in docs/models.md
    python scripts/model_matrix.py --print    # prints them instead
    python scripts/model_matrix.py --formats  # rewrites the formats table alone (no real files needed)

The first run downloads the pinned llama-cpp-python sdist (77 MB, the real files: tests/realfiles.py) into
~/.cache/rollway-test-files and builds the tokenizers there (a few minutes on 2 cores). Exits 1 when a
cell fails; tests/gateway/test_model_families.py asserts the same cells.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.tool_formats import FORMATS  # noqa: E402

DOC = ROOT / "docs" / "models.md"
START, END = "<!-- matrix:start (written by scripts/model_matrix.py) -->", "<!-- matrix:end -->"
FORMATS_START = "<!-- formats:start (written by scripts/model_matrix.py from gateway/tool_formats) -->"
FORMATS_END = "<!-- formats:end -->"


def formats_table() -> str:
    """docs/models.md's table of tool-call formats, from the registry: one row a format."""
    lines = ["| `--tool-parser` | families | a tool call | forced tool_choice | reasoning |", "|---|---|---|---|---|"]
    for f in sorted(FORMATS, key=lambda f: f.name):
        name = f"`{f.name}`" + (f" (also {', '.join(f'`{a}`' for a in f.aliases)})" if f.aliases else "")
        example = f.example.replace("|", "\\|")
        grammar = "✓" if f.grammar is not None else "—"
        reasoning = f"`{f.reasoning.name}`" if f.reasoning is not None else "from the template"
        lines.append(f"| {name} | {f.families} | {example} | {grammar} | {reasoning} |")
    return "\n".join(lines)


def replace_between(doc: str, start: str, end: str, text: str) -> str:
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{text}\n{end}{tail}"


def cell(ok: bool | None, text: str, column: str) -> str:
    text = text.replace("|", "\\|")
    if ok is None:
        return f"— {text}"
    if not ok:
        return f"✗ {text}"
    return f"✓ {text}" if column == "multi-turn" else "✓"


def table(results: list[Any]) -> str:
    from tests.model_checks import COLUMNS
    from tests.realfiles import SDIST

    lines = ["| family | template | vocabulary | " + " | ".join(COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    notes: list[str] = []
    for r in results:
        f = r.family
        vocab = f"`{f.vocab}`"
        if f.substitute:
            if f.substitute not in notes:
                notes.append(f.substitute)
            vocab += f" (substitute {notes.index(f.substitute) + 1})"
        cells = [cell(*r.cells[c], c) for c in COLUMNS]
        lines.append(f"| {f.name} | `{f.template}` | {vocab} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Files from `{SDIST}` (llama.cpp's `models/`). Substitute vocabularies (the cells of those rows "
                 "were checked on them):")
    lines.append("")
    lines += [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    rendered = [(r.family.name, r.cells["tool call"][1]) for r in results]
    details = [f"- {name}: {text.split('== call (', 1)[1][:-1]}" for name, text in rendered if "== call (" in text]
    if details:
        lines += ["", "How a tool-call reply was rendered where the template does not simply write it:", "", *details]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the tables instead of writing docs/models.md")
    parser.add_argument("--formats", action="store_true", help="the formats table alone (no real files needed)")
    args = parser.parse_args()
    formats = formats_table()
    if args.formats:
        if args.print:
            print(formats)
        else:
            DOC.write_text(replace_between(DOC.read_text(), FORMATS_START, FORMATS_END, formats))
            print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
        return 0
    from tests.model_checks import COLUMNS, check_family
    from tests.realfiles import FAMILIES

    results = []
    for family in FAMILIES:
        print(f"checking {family.name} ...", file=sys.stderr, flush=True)
        results.append(check_family(family))
    text = table(results)
    if args.print:
        print(formats, text, sep="\n\n")
    else:
        doc = replace_between(DOC.read_text(), FORMATS_START, FORMATS_END, formats)
        DOC.write_text(replace_between(doc, START, END, text))
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    failed = [(r.family.name, c) for r in results for c in COLUMNS if r.cells[c][0] is False]
    for name, column in failed:
        print(f"FAILED: {name}: {column}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
