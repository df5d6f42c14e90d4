"""Write the model-family matrix of docs/models.md: every family's real chat template and vocabulary run
through the gateway's templating, parsers and continuity (tests/model_checks.py), one row a family.

    python scripts/model_matrix.py            # rewrites the table between the markers in docs/models.md
    python scripts/model_matrix.py --print    # prints it instead

The first run downloads the pinned llama-cpp-python sdist (77 MB, the real files: tests/realfiles.py) into
~/.cache/rollway-test-files and builds the tokenizers there (a few minutes on 2 cores). Exits 1 when a
cell fails; tests/gateway/test_model_families.py asserts the same cells.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.model_checks import COLUMNS, FamilyResult, check_family  # noqa: E402
from tests.realfiles import FAMILIES, SDIST  # noqa: E402

DOC = ROOT / "docs" / "models.md"
START, END = "<!-- matrix:start (written by scripts/model_matrix.py) -->", "<!-- matrix:end -->"


def cell(ok: bool | None, text: str, column: str) -> str:
    text = text.replace("|", "\\|")
    if ok is None:
        return f"— {text}"
    if not ok:
        return f"✗ {text}"
    return f"✓ {text}" if column == "multi-turn" else "✓"


def table(results: list[FamilyResult]) -> str:
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
    parser.add_argument("--print", action="store_true", help="print the table instead of writing docs/models.md")
    args = parser.parse_args()
    results = []
    for family in FAMILIES:
        print(f"checking {family.name} ...", file=sys.stderr, flush=True)
        results.append(check_family(family))
    text = table(results)
    if args.print:
        print(text)
    else:
        doc = DOC.read_text()
        head, rest = doc.split(START, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    failed = [(r.family.name, c) for r in results for c in COLUMNS if r.cells[c][0] is False]
    for name, column in failed:
        print(f"FAILED: {name}: {column}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
