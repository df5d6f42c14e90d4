"""The store folder is a layer of its own: gateway/store/ imports nothing of the gateway but its errors and
itself (the lease's samples are built by gateway/samples.py and handed in; the viewer's reads live in the
store, not the other way round). And only gateway/store/ tells SQLite and PostgreSQL apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
ALLOWED = ("gateway.errors", "gateway.store")


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_store_imports_nothing_of_the_gateway_above_it() -> None:
    bad = sorted(f"{p.name}: {m}" for p in (GATEWAY / "store").glob("*.py") for m in _imported(p)
                 if m.startswith("gateway") and not m.startswith(ALLOWED))
    assert bad == []


def test_only_the_store_tells_the_dialects_apart() -> None:
    """A dialect check (`dialect`, an `InLoopEngine` test, a driver's own errors) outside gateway/store/ is
    SQL knowledge leaking to the pages or routes."""
    sign = re.compile(r"\.dialect\b|dialect\.name|InLoopEngine|\bimport (sqlite3|asyncpg)\b|\"(sqlite|postgresql)\":")
    found = sorted(str(p.relative_to(GATEWAY)) for p in GATEWAY.rglob("*.py")
                   if "store" not in p.relative_to(GATEWAY).parts[:1] and sign.search(p.read_text()))
    assert found == []
