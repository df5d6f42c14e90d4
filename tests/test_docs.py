"""Every document the code and docs cite is in the repository, and every cited section is a heading of it.

A citation is `docs/<name>.md`, optionally followed by a quoted section name (`docs/architecture.md
"Continuity and chains"`, also with a comma or colon between, or across a line break). Documents that are
not in the repository (an internal briefing, matched by `GONE`) must not be cited.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".sh", ".ini", ".cfg"}
SKIP = {".git", "rollway.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache", "node_modules", ".venv"}
CITATION = re.compile(r'docs/([\w.-]+\.md)(?:[,:]?\s*(?:#\s*)?"([^"\n]+)")?')
# Built from parts, so that this file does not itself name what it forbids.
GONE = re.compile(r"\b(" + "|".join(name + r"\.md" for name in ("design", "lessons", "style")) + r")\b|/work/"
                  + "shared")


def sources() -> list[Path]:
    skip = SKIP | {cfg.parent.name for cfg in ROOT.glob("*/pyvenv.cfg")}  # a virtual env made in the checkout
    return [p for p in ROOT.rglob("*")
            if p.suffix in SUFFIXES and p.is_file() and not skip & set(p.relative_to(ROOT).parts)
            and p.resolve() != Path(__file__).resolve()]


def headings(doc: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.MULTILINE)}


def citations(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in CITATION.finditer(text)]


def test_cited_documents_and_sections_exist() -> None:
    missing = []
    for path in sources():
        for name, section in citations(path.read_text(errors="replace")):
            doc = ROOT / "docs" / name
            where = path.relative_to(ROOT)
            if not doc.is_file():
                missing.append(f"{where}: docs/{name}")
            elif section is not None and section not in headings(doc):
                missing.append(f'{where}: docs/{name} "{section}"')
    assert missing == []


def test_no_citation_of_documents_outside_the_repository() -> None:
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in sources()
             for m in GONE.finditer(p.read_text(errors="replace"))]
    assert found == []


def test_the_citation_pattern() -> None:
    text = 'see docs/architecture.md "Weight versions", docs/http-api.md, "Lifecycle" and docs/x.md\n    "A B".'
    assert citations(text) == [("architecture.md", "Weight versions"), ("http-api.md", "Lifecycle"),
                               ("x.md", "A B")]
    assert citations("docs/scaling.md alone") == [("scaling.md", None)]
