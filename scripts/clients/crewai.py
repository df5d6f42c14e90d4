"""CrewAI: a one-agent `Crew` with a `@tool`, on `crewai.LLM("openai/policy", base_url=...)` (CrewAI's native
OpenAI provider on the `openai` SDK: chat.completions with tools), 3 iterations at most. Telemetry and tracing
are switched off and its storage kept in the work folder, so nothing leaves the machine but the gateway's calls."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from _common import MODEL, QUESTION, SYSTEM, TOOL_DESCRIPTION, calculate, result, version

LABEL = "CrewAI"
LANGUAGE = "python"
MODES = "Crew of one Agent with a @tool on crewai.LLM (native OpenAI provider, chat.completions), 3 iterations at most"
REQUIREMENTS = ["crewai==1.15.30"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    os.environ.update({
        "CREWAI_DISABLE_TELEMETRY": "true", "CREWAI_DISABLE_TRACKING": "true", "OTEL_SDK_DISABLED": "true",
        "CREWAI_TRACING_ENABLED": "false", "CREWAI_STORAGE_DIR": str(workdir / "crewai-storage"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1",
        "HOME": str(workdir),  # CrewAI writes its user settings under ~ (its first-run prompt's answer and more)
    })
    import openai
    from crewai import LLM, Agent, Crew, Task
    from crewai.tools import tool

    ran: list[str] = []

    @tool("calculate")
    def calculate_tool(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        ran.append(expression)
        return calculate(expression)

    llm = LLM(model=f"openai/{MODEL}", base_url=base_url, api_key=api_key, temperature=0, max_tokens=128,
              max_retries=0, timeout=300)
    agent = Agent(role="Calculator", goal=SYSTEM, backstory=TOOL_DESCRIPTION, tools=[calculate_tool], llm=llm,
                  max_iter=3, allow_delegation=False, verbose=False)
    task = Task(description=QUESTION, expected_output="The number only.", agent=agent)
    crew = Crew(agents=[agent], tasks=[task], verbose=False)
    ver = version("crewai", "openai")
    try:
        out = crew.kickoff()
    except openai.APIStatusError as e:  # the gateway refused a call
        return result(False, f"{type(e).__name__}: {e}", ver)
    if not ran:  # CrewAI sends its tool with "strict": true and a schema of its own, which the tiny model misforms
        return result(True, f"the model wrote no well-formed tool call, so CrewAI took its text as the final answer: "
                            f"{str(out.raw)[:100]!r}", ver)
    return result(True, f"tool ran with {ran}; answer {str(out.raw)[:100]!r}", ver)
