"""The OpenAI Agents SDK: `Runner.run` with a `@function_tool` on the Responses API (what
tests/clients/test_agents_sdk.py covers in depth)."""

from __future__ import annotations

import pathlib
from typing import Any

import _common
from _common import MODEL, QUESTION, SYSTEM, result, version

LABEL = "OpenAI Agents SDK"
LANGUAGE = "python"
MODES = "Runner.run, Responses API with a function tool"
REQUIREMENTS = ["openai-agents==0.24.0"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    import asyncio

    from openai import AsyncOpenAI

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI

    @function_tool
    def calculate(expression: str) -> str:  # the name and schema the client tests' model was trained on
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        return _common.calculate(expression)

    async def go() -> Any:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
        agent = Agent(name="calculator", instructions=SYSTEM, tools=[calculate],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(max_tokens=128, temperature=0))
        try:
            return await Runner.run(agent, input=QUESTION, max_turns=4)
        finally:
            await client.close()

    from agents.exceptions import MaxTurnsExceeded

    try:
        out = asyncio.run(go())
    except MaxTurnsExceeded:
        return result(True, "stopped at max_turns (the model kept calling the tool)", version("openai-agents"))
    return result(True, f"final output {out.final_output!r}", version("openai-agents", "openai"))
