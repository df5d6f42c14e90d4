"""The packages' import layers (docs/architecture.md "Layers"), read from the source with `ast`: every import
statement counts, at module level or inside a function.

    layer 3  rollway/ (CLI, serve, view, demo, rollout, embedded engine), benchmarks/, scripts/, tests/
    layer 2  gateway/ (with migrations/, its store's schema history)   trainer/   engine/
    layer 1  rollway_common/ (the lease wire format, paths, process helpers, the custom process group)

- An import only runs down or sideways inside its own package: rollway_common/ imports nothing of ours;
  gateway/, trainer/ and engine/ import only themselves and rollway_common/ (never each other: the trainer
  reaches the gateway only over HTTP, the engine is a stand-in for SGLang), and nothing below the top imports
  rollway/, benchmarks/, scripts/ or tests/.
- The gateway is torch-free: it never imports `rollway_common.process_group` (torch's process groups) or
  `rollway_common.tensor_payload` (SGLang's tensor payload, torch's pickling).
- No import cycle anywhere, between packages or modules (a cycle forces imports into function bodies and makes
  the import order matter).
"""

from __future__ import annotations

import ast
import sys
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


# Package -> the packages of ours it may import besides itself. Layer 3 may import any package.
ALLOWED: dict[str, set[str]] = {
    "rollway_common": set(),
    "gateway": {"rollway_common", "migrations"},
    "migrations": {"rollway_common", "gateway"},  # env.py reads the store's models; the store runs migrations
    "trainer": {"rollway_common"},
    "engine": {"rollway_common"},
}
TOP = ("rollway", "benchmarks", "scripts", "tests", "agents")
OURS = (*ALLOWED, *TOP)


def all_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in OURS if (ROOT / package).is_dir()
            for p in sorted((ROOT / package).rglob("*.py"))}


def whole_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, over every package of ours."""
    files = all_modules()
    return {name: {m for m in imports_of(p) if m in files and m != name} for name, p in files.items()}


def imports_running_back_up() -> list[str]:
    """Each import, as `module -> module`, that leaves its package for one it may not import (ALLOWED)."""
    out = []
    for name, targets in sorted(whole_graph().items()):
        package = name.split(".")[0]
        if package in TOP:
            continue
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != package and other not in ALLOWED[package]:
                out.append(f"{name} -> {target}")
    return out


def test_no_import_runs_back_up() -> None:
    assert imports_running_back_up() == []


def test_the_leaf_imports_nothing_of_ours() -> None:
    """Stated apart from ALLOWED: a named import of any package of ours, existing or not, fails."""
    assert offending_imports("rollway_common", (*OURS, "rollway_agents")) == []


@pytest.mark.parametrize(("package", "forbidden"), [
    ("trainer", ("gateway", "engine", *TOP)),
    ("gateway", ("trainer", "engine", *TOP)),
    ("engine", ("gateway", "trainer", *TOP)),
])
def test_package_boundaries(package: str, forbidden: tuple[str, ...]) -> None:
    assert offending_imports(package, forbidden) == []


def test_the_gateway_stays_torch_free() -> None:
    """The leaf's torch module is for the engine and the trainer only; the gateway imports no torch at all."""
    assert offending_imports("gateway", ("torch",)) == []
    assert [m for p in (ROOT / "gateway").rglob("*.py") for m in imports_of(p)
            if m.startswith(("rollway_common.process_group", "rollway_common.tensor_payload"))] == []


def test_no_import_cycle_anywhere() -> None:
    assert cycle(whole_graph()) is None


@pytest.mark.parametrize("package", ["gateway", "trainer", "engine", "rollway_common"])
def test_no_import_cycle(package: str) -> None:
    assert cycle(graph(package)) is None


def test_the_checks_see_lazy_imports_and_cycles(tmp_path: Path) -> None:
    """The helpers themselves: an import inside a function counts, and a two-module cycle is found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from rollway_common.wire import decode_array\n    import trainer.client\n")
    assert {"rollway_common.wire", "rollway_common.wire.decode_array", "trainer.client"} <= imports_of(src)
    assert cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_rule_sees_a_back_up_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer check itself: a trainer module importing the CLI (as `trainer/launch.py` once imported
    `rollway.embedded`) is reported, and a two-module circle between benchmarks is a cycle."""
    for package in ("trainer", "rollway", "benchmarks"):
        (tmp_path / package).mkdir()
    (tmp_path / "trainer" / "launch.py").write_text("from rollway.embedded import die_with_parent\n")
    (tmp_path / "rollway" / "embedded.py").write_text("def f():\n    from engine.tiny_model import x\n")
    (tmp_path / "benchmarks" / "a.py").write_text("from benchmarks import b\n")
    (tmp_path / "benchmarks" / "b.py").write_text("def f():\n    from benchmarks.a import g\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports_running_back_up() == ["trainer.launch -> rollway.embedded"]
    assert cycle(whole_graph()) == ["benchmarks.a", "benchmarks.b", "benchmarks.a"]


def test_only_the_services_module_touches_app_state() -> None:
    """The gateway's services are one typed object (gateway/services.py): every other module of the gateway and
    the CLI reaches them through its accessors, never through `app.state` (or a scope's app's state)."""
    found = []
    for package in ("gateway", "rollway"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "gateway" / "services.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "app.state" in line or '["app"].state' in line:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


ROUTER_HOMES = ("gateway/routes/", "gateway/anthropic/", "gateway/ui/")
"""Where the gateway's routers live: routes/, or the folder of their API (docs/architecture.md "Layers")."""
ASSEMBLERS = ("gateway/app.py", "gateway/openapi.py")
"""The app builder and its OpenAPI document, which put the routers together."""


def test_routers_live_in_routes_and_logic_never_imports_them() -> None:
    """No router outside its homes (as gateway/weight_sync.py once held one), and no module of the gateway's
    logic imports a router module (gateway/weight_sync.py and gateway/viewer_auth.py once imported
    routes.common): the routes import the logic, not the other way round."""
    found = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where.startswith(ROUTER_HOMES) or where in ASSEMBLERS:
            continue
        tree = ast.parse(path.read_text(), where)
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "APIRouter"
               for n in ast.walk(tree)):
            found.append(f"{where} makes an APIRouter")
        found += [f"{where} imports {m}" for m in sorted(imports_of(path)) if m.startswith("gateway.routes.")]
    assert found == []
