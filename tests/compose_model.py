"""The compose files as compose reads them, for the static checks (tests/test_compose.py): PyYAML plus compose's
`!reset`/`!override` tags, `${VAR}` interpolated with compose's rules from .env.example, the override merged with
compose's merge rules; and what a service runs, mounts and points at."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "docker-compose.yml"
CPU = ROOT / "docker-compose.cpu.yml"
ONE_GPU = ROOT / "docker-compose.one-gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SECRETS = {"ROLLWAY_ADMIN_KEY", "POSTGRES_PASSWORD"}
TEST_SECRETS = {"ROLLWAY_ADMIN_KEY": "test-admin-key", "POSTGRES_PASSWORD": "test-pg-password"}
# Services without a healthcheck, and why. Both exit when done; their dependents wait for
# `service_completed_successfully`, which test_one_shot_services_are_awaited_to_completion checks.
NO_HEALTHCHECK = {
    "migrate": "one-shot `rollway db upgrade`: runs to completion, then exits",
    "init-model": "one-shot `rollway init-model` (CPU override): writes the tiny model, then exits",
}
SUBCOMMAND = {
    "migrate": "db",
    "gateway": "serve",
    "trainer": "train",
    "runner": "rollout",
    "init-model": "init-model",
}


# ---------------------------------------------------------------- reading compose files as compose does


class Tagged:
    def __init__(self, value: Any) -> None:
        self.value = value


class Reset(Tagged):
    """`!reset`: remove the attribute the base file set."""


class Override(Tagged):
    """`!override`: replace the attribute instead of merging it."""


class ComposeLoader(yaml.SafeLoader):
    pass


def _tag(cls: type[Tagged]) -> Any:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            return cls(loader.construct_mapping(node, deep=True))
        if isinstance(node, yaml.SequenceNode):
            return cls(loader.construct_sequence(node, deep=True))
        return cls(loader.construct_scalar(node))  # type: ignore[arg-type]

    return construct


ComposeLoader.add_constructor("!reset", _tag(Reset))
ComposeLoader.add_constructor("!override", _tag(Override))

VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_]\w*))"
)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader subclass


def strings(node: Any) -> list[str]:
    if isinstance(node, Tagged):
        return strings(node.value)
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def references(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every `${NAME<op><arg>}` / `$NAME` in the file's values, as (name, op, arg)."""
    refs = []
    for s in strings(doc):
        for m in VAR.finditer(s):
            if not m["escaped"]:
                refs.append((m["name"] or m["bare"], m["op"] or "", m["arg"] or ""))
    return refs


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: ${V}, ${V:-d}, ${V-d}, ${V:?e}, ${V?e}, ${V:+a}, ${V+a}, $V, $$."""
    if isinstance(node, Tagged):
        return type(node)(interpolate(node.value, env))
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"] or "", m["arg"] or ""
        value, unset = env.get(name), name not in env
        empty = unset or value == ""
        if op in (":?", "?") and (empty if op == ":?" else unset):
            raise LookupError(f"required variable {name} is missing a value: {arg}")
        if op in (":-", "-") and (empty if op == ":-" else unset):
            return arg
        if op in (":+", "+"):
            return "" if (empty if op == ":+" else unset) else arg
        return value or ""

    out = VAR.sub(sub, node)
    assert "${" not in out, f"unsupported (nested?) interpolation in {node!r}"
    return out


def env_example() -> dict[str, str]:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"([A-Z_][A-Z0-9_]*)=(.*)$", line)
        if m:
            env[m[1]] = m[2]
    return env


def stack_env() -> dict[str, str]:
    return {**env_example(), **TEST_SECRETS}


def _volumes_by_target(vols: list[Any]) -> dict[str, Any]:
    return {mount(v)["target"]: v for v in vols}


def merge(base: Any, over: Any, key: str = "") -> Any:
    """Compose's merge rules (reference/compose-file/merge) for what these files use."""
    if isinstance(over, Override):
        return over.value
    if key in ("command", "entrypoint", "test") or not isinstance(base, dict | list):
        return over
    if key == "volumes" and isinstance(base, list):  # unique by target
        return list({**_volumes_by_target(base), **_volumes_by_target(over)}.values())
    if isinstance(base, list):
        return base + over
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Reset):
            out.pop(k, None)
        else:
            out[k] = merge(out[k], v, k) if k in out else (v.value if isinstance(v, Override) else v)
    return out


def mount(v: Any) -> dict[str, Any]:
    """Short or long volume syntax as {source, target, read_only, named}."""
    if isinstance(v, dict):
        source, target, ro = v.get("source", ""), v["target"], bool(v.get("read_only"))
    else:
        parts = v.split(":")
        if len(parts) == 1:
            source, target, ro = "", parts[0], False
        else:
            source, target = parts[0], parts[1]
            ro = len(parts) > 2 and "ro" in parts[2].split(",")
    named = bool(source) and not source.startswith(("/", ".", "~", "$"))
    return {"source": source, "target": target, "read_only": ro, "named": named}


def project(with_cpu: bool | str, **extra_env: str) -> dict[str, Any]:
    """The GPU stack (False), the CPU stack (True), or the one-GPU stack ("one-gpu")."""
    env = {**stack_env(), **extra_env}
    doc = interpolate(load(BASE), env)
    if with_cpu == "one-gpu":
        doc = merge(doc, interpolate(load(ONE_GPU), env))
    elif with_cpu:
        doc = merge(doc, interpolate(load(CPU), env))
    return doc


CONFIGS: dict[str, bool | str] = {"gpu": False, "cpu": True, "one-gpu": "one-gpu"}


def argv_of(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def dockerfile_entrypoint(svc: dict[str, Any]) -> list[str] | None:
    build = svc.get("build")
    if not isinstance(build, dict):
        return None
    text = (ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).read_text()
    m = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    return json.loads(m[1]) if m else None


def rollway_argv(svc: dict[str, Any]) -> list[str] | None:
    """The argv after `rollway` when the service runs the rollway CLI, else None."""
    entry = svc.get("entrypoint") or dockerfile_entrypoint(svc)
    if entry != ["rollway"]:
        return None
    return argv_of(svc)


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def under(path: str, target: str) -> bool:
    return (
        PurePosixPath(path) == PurePosixPath(target) or PurePosixPath(target) in PurePosixPath(path).parents
    )


def covering_mount(svc: dict[str, Any], path: str) -> dict[str, Any]:
    mounts = [mount(v) for v in svc.get("volumes", []) if under(path, mount(v)["target"])]
    assert mounts, f"no volume covers {path}"
    return max(mounts, key=lambda m: len(m["target"]))


def model_users(svcs: dict[str, Any]) -> dict[str, str]:
    """Service -> the model folder it reads."""
    sg = argv_of(svcs["sglang"])
    return {
        "sglang": flag(sg, "--model-path") if "--model-path" in sg else flag(sg, "--model"),
        "gateway": flag(argv_of(svcs["gateway"]), "--tokenizer"),
        "trainer": flag(argv_of(svcs["trainer"]), "--model"),
    }
