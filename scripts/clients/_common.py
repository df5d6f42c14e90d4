"""What the drivers share: the task the client tests' tuned model was trained on (tests/clients/model.py), and
helpers. Standard library only: every driver's venv imports it."""

from __future__ import annotations

import importlib.metadata
from typing import Any

MODEL = "policy"
SYSTEM = "Use the calculate tool, then answer with the number only."
QUESTION = "What is 12+7?"
TOOL_DESCRIPTION = "Evaluate an arithmetic expression with + - * / and parentheses."
OPENAI_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "calculate", "description": TOOL_DESCRIPTION,
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
                   "required": ["expression"]}}}


def calculate(expression: str) -> str:
    """The tool: a + b, a - b or a * b of two integers."""
    for op in "+-*":
        a, sep, b = str(expression).partition(op)
        if sep and a.strip().isdigit() and b.strip().isdigit():
            x, y = int(a), int(b)
            return str(x + y if op == "+" else x - y if op == "-" else x * y)
    return "error: unsupported expression"


def version(*dists: str) -> str:
    return ", ".join(f"{d} {importlib.metadata.version(d)}" for d in dists)


def result(ok: bool, detail: str, ver: str, calls: int = 0, chains: int = 0) -> dict[str, Any]:
    """The driver's answer; calls and chains are 0 where the driver cannot see them (the matrix counts the
    gateway's stored turns)."""
    return {"ok": ok, "calls": calls, "chains": chains, "detail": detail[:500], "version": ver}
