"""The package declares what it imports, and claims only the Python it can run on.

Every third-party module that a shipped package imports (at any depth, lazily or not) must be declared in
the dependency group that installs that package: the core dependencies for the gateway, the CLI, the
runner, the agents and the migrations; the `engine` extra for `engine/`; the `train` extra for `trainer/`.
A missing declaration is exactly how `pip install -e '.[all]' && rollway demo` once failed on a fresh
machine (`httpx` came only with the `dev` extra).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OWN = {"rollway", "rollway_common", "gateway", "engine", "trainer", "migrations", "rollway_agents", "agents"}
# Import name -> distribution name where the two differ.
DIST = {"yaml": "pyyaml", "pydantic_settings": "pydantic-settings", "prometheus_client": "prometheus-client",
        "sklearn": "scikit-learn"}
# Modules that a declared distribution provides under another name.
PROVIDED_BY = {"starlette": "fastapi", "anyio": "fastapi", "typing_extensions": "pydantic"}
# Which dependency groups install each shipped package (the core dependencies always).
GROUPS = {"rollway_common": [], "gateway": [], "rollway": [], "agents": [], "migrations": [], "engine": ["engine"],
          "trainer": ["train"]}
# Files that import an optional extra's module (lazily, behind an option that is off by default): file -> extras.
OPTIONAL = {"trainer/tracking.py": ["wandb", "mlflow"],
            # torch: imported only by the engine and the trainer (tests/test_import_graph.py keeps the gateway off it)
            "rollway_common/process_group.py": ["engine", "train"],
            "rollway_common/tensor_payload.py": ["engine", "train"]}


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _declared(extras: list[str]) -> set[str]:
    names = {_name(r) for r in PROJECT["dependencies"]}
    for extra in extras:
        for req in PROJECT["optional-dependencies"][extra]:
            if req.startswith("rollway["):  # rollway[engine,train]
                names |= _declared(req[len("rollway["):req.index("]")].split(","))
            else:
                names.add(_name(req))
    return names


def _third_party_imports(package: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            for m in modules:
                top = m.split(".")[0]
                where = str(path.relative_to(ROOT))
                optional = {_name(r) for e in OPTIONAL.get(where, []) for r in PROJECT["optional-dependencies"][e]}
                if top not in sys.stdlib_module_names and top not in OWN and not (
                        top in optional or top.replace("_", "-") + "-skinny" in optional):
                    found.setdefault(top, where)
    return found


def test_every_runtime_import_is_declared() -> None:
    missing = []
    for package, extras in GROUPS.items():
        declared = _declared(extras)
        for module, where in _third_party_imports(package).items():
            dist = PROVIDED_BY.get(module, DIST.get(module, module)).lower().replace("_", "-")
            if dist not in declared:
                missing.append(f"{module} (imported by {where}; install group of {package}/: "
                               f"core{''.join(' + ' + e for e in extras)})")
    assert not missing, "imports not declared in pyproject.toml:\n  " + "\n  ".join(missing)


def test_dev_extra_is_not_needed_at_run_time() -> None:
    """The runtime groups stand alone: nothing a shipped package imports comes only from `dev`."""
    runtime = _declared(["engine", "train"])
    dev_only = {_name(r) for r in PROJECT["optional-dependencies"]["dev"] if not r.startswith("rollway[")} - runtime
    for package in GROUPS:
        for module, where in _third_party_imports(package).items():
            dist = PROVIDED_BY.get(module, DIST.get(module, module)).lower().replace("_", "-")
            assert dist not in dev_only, f"{where} imports {module}, which only the dev extra installs"


def test_requires_python_matches_the_code() -> None:
    """`tomllib` (trainer/config.py) is 3.11+; the claim, ruff's target and mypy's must agree."""
    text = (ROOT / "pyproject.toml").read_text()
    tool = tomllib.loads(text)["tool"]
    assert PROJECT["requires-python"].strip() == ">=3.11"
    assert tool["ruff"]["target-version"] == "py311"
    assert tool["mypy"]["python_version"] == "3.11"


def test_the_readmes_client_sdks_come_with_all() -> None:
    """The README's agent examples use the OpenAI SDK (core) and the Anthropic SDK: `pip install '.[all]'`
    installs both (issue 28: `anthropic` came only with `dev`)."""
    readme = (ROOT / "README.md").read_text()
    assert "ANTHROPIC_BASE_URL" in readme and "OPENAI_BASE_URL" in readme
    assert {"openai", "anthropic"} <= _declared(["all"])


def test_the_tracking_extras_are_optional() -> None:
    """W&B and MLflow are extras of their own: neither the core, `all` nor the trainer's `train` installs them."""
    extras = PROJECT["optional-dependencies"]
    assert _name(extras["wandb"][0]) == "wandb" and _name(extras["mlflow"][0]).startswith("mlflow")
    for group in (["all"], ["train"], []):
        assert not {n for n in _declared(group) if n.startswith(("wandb", "mlflow"))}, group


def test_every_package_folder_ships() -> None:
    """A wheel holds only the packages `[tool.setuptools] packages` names (no discovery): every folder with an
    `__init__.py` under a shipped package must be listed, or a non-editable install fails on its import."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = {v: k for k, v in tool.get("package-dir", {}).items()}
    missing = []
    for top in listed:
        if "." in top:
            continue
        base = ROOT / dirs.get(top, top)
        for init in base.rglob("__init__.py"):
            name = ".".join([top, *init.parent.relative_to(base).parts])
            if name not in listed:
                missing.append(name)
    assert missing == []
