"""The `anthropic` Python SDK: Messages with a tool, tool_use then tool_result then the answer (what
tests/clients/test_anthropic.py covers in depth)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from _common import MODEL, OPENAI_TOOL, QUESTION, SYSTEM, calculate, result, version

LABEL = "anthropic (Python SDK)"
LANGUAGE = "python"
MODES = "messages: tool_use and tool_result"
REQUIREMENTS = ["anthropic==2.14.0"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    import anthropic

    client = anthropic.Anthropic(base_url=os.environ["ROLLWAY_ANTHROPIC_BASE_URL"], api_key=api_key, max_retries=0,
                                 timeout=300)
    fn = OPENAI_TOOL["function"]
    tools: Any = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model=MODEL, max_tokens=128, system=SYSTEM, tools=tools, messages=messages)
    uses = [b for b in first.content if b.type == "tool_use"]
    if not uses:
        return result(False, f"the model called no tool: {first.content!r}"[:300], version("anthropic"))
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                               "content": calculate(str(dict(u.input).get("expression", "")))}
                                              for u in uses]}]
    second = client.messages.create(model=MODEL, max_tokens=128, system=SYSTEM, tools=tools, messages=messages)
    return result(True, f"called {[u.input for u in uses]}, then answered {[b.model_dump() for b in second.content]}",
                  version("anthropic"), 2, 1)
