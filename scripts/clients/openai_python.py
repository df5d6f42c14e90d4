"""The `openai` Python SDK: Chat Completions with a function tool, the first step streamed, the tool's result
sent back, the second not streamed."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from _common import MODEL, OPENAI_TOOL, QUESTION, SYSTEM, calculate, result, version

LABEL = "openai (Python SDK)"
LANGUAGE = "python"
MODES = "chat.completions: function tool, streamed and not"
REQUIREMENTS = ["openai==3.57.0"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[OPENAI_TOOL], max_tokens=128,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    if not calls:
        return result(False, f"the model called no tool: {content!r}", version("openai"), 1, 1)
    tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                  for c in calls.values()]
    messages.append({"role": "assistant", "content": content or None, "tool_calls": tool_calls})
    for c in calls.values():
        messages.append({"role": "tool", "tool_call_id": c["id"],
                         "content": calculate(json.loads(c["arguments"]).get("expression", ""))})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[OPENAI_TOOL], max_tokens=128,
                                            temperature=0)
    return result(True, f"called {[c['arguments'] for c in calls.values()]}, then answered "
                        f"{second.choices[0].message.content!r}", version("openai"), 2, 1)
