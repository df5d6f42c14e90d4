"""The packages' import boundaries (docs/architecture.md "Components"), read from the source with `ast`:
every import statement counts, at module level or inside a function.

- The trainer reaches the gateway only over HTTP: nothing in trainer/ imports `gateway` (the lease wire
  format it decodes lives in `rollway.wire`).
- The gateway is torch-free and the engine is a stand-in for SGLang: neither imports the other, nor the
  trainer.
- No import cycle inside gateway/, trainer/ or engine/ (a cycle forces imports into function bodies and
  makes the import order matter).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every absolute module name an import statement in `path` names, with `from a import b` giving both
    `a` and `a.b` (b may be a submodule). Relative imports are resolved against the file's package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                name = _module_name(path)
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    files = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    return {name: {m for m in imports_of(p) if m in files and m != name} for name, p in files.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `g` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(g):
        if start not in state and (found := visit(start)):
            return found
    return None


def offending_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in sorted(imports_of(path)):
            if module.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(ROOT)} imports {module}")
    return out


@pytest.mark.parametrize(("package", "forbidden"), [
    ("trainer", ("gateway", "engine")),
    ("gateway", ("trainer", "engine")),
    ("engine", ("gateway", "trainer")),
])
def test_package_boundaries(package: str, forbidden: tuple[str, ...]) -> None:
    assert offending_imports(package, forbidden) == []


@pytest.mark.parametrize("package", ["gateway", "trainer", "engine"])
def test_no_import_cycle(package: str) -> None:
    assert cycle(graph(package)) is None


def test_the_checks_see_lazy_imports_and_cycles(tmp_path: Path) -> None:
    """The helpers themselves: an import inside a function counts, and a two-module cycle is found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from gateway.wire import decode_array\n    import trainer.client\n")
    assert {"gateway.wire", "gateway.wire.decode_array", "trainer.client"} <= imports_of(src)
    assert cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
