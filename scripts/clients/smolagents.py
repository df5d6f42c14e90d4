"""smolagents' `ToolCallingAgent` on `OpenAIServerModel`, with a `@tool`: smolagents renders its own system prompt
and memory and sends the whole conversation again each step (a new chain each step)."""

from __future__ import annotations

import pathlib
from typing import Any

from _common import MODEL, QUESTION, SYSTEM, calculate, result, version

LABEL = "smolagents (ToolCallingAgent)"
LANGUAGE = "python"
MODES = "ToolCallingAgent, chat.completions with tools, 3 steps at most"
REQUIREMENTS = ["smolagents==1.26.0", "openai==3.57.0"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.utils import AgentGenerationError

    @tool
    def calculate_tool(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses.

        Args:
            expression: e.g. 12*(3+4)
        """
        return calculate(expression)

    calculate_tool.name = "calculate"
    model = OpenAIServerModel(model_id=MODEL, api_base=base_url, api_key=api_key, temperature=0, max_tokens=128,
                              client_kwargs={"max_retries": 0, "timeout": 300})
    agent = ToolCallingAgent(tools=[calculate_tool], model=model, max_steps=3, instructions=SYSTEM, verbosity_level=0)
    try:
        answer = agent.run(QUESTION)
    except AgentGenerationError as e:  # the model call itself failed (an HTTP error)
        return result(False, f"AgentGenerationError: {e}", version("smolagents"))
    errors = [str(s.error)[:120] for s in agent.memory.steps if getattr(s, "error", None)]
    # step errors are the tiny model's (no tool call, a malformed one); an HTTP error would have raised above
    return result(True, f"answer {str(answer)[:80]!r}; {len(errors)} step error(s) from the model's output"
                        + (f", e.g. {errors[0]!r}" if errors else ""), version("smolagents"))
