"""Files that ship with the package, found from the installed code (any directory, any install mode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""A model folder's tokenizer and chat template files, copied verbatim wherever a folder is written from another
(`rollway init-model` from a tokenizer folder, the trainer's published weights from the model it started from)."""


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
