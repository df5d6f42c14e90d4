"""Files that ship with the package, found from the installed code (any directory, any install mode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def agents_dir() -> Path:
    """`agents/` of a source checkout, else the installed `rollway_agents` package data."""
    checkout = Path(__file__).resolve().parent.parent / "agents"
    if (checkout / "arithmetic.py").is_file():
        return checkout
    spec = importlib.util.find_spec("rollway_agents")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the example agents are not installed (package rollway_agents)")
    return Path(next(iter(spec.submodule_search_locations)))


def agent_file(name: str) -> Path:
    return agents_dir() / name
