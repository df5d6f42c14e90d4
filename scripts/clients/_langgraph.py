"""What the two LangGraph drivers share: the prebuilt ReAct agent with the calculate tool."""

from __future__ import annotations

from typing import Any

from _common import QUESTION, SYSTEM, TOOL_DESCRIPTION, calculate, result, version


def react(llm: Any, dists: tuple[str, ...]) -> dict[str, Any]:
    from langchain_core.tools import tool
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculate_tool(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        return calculate(expression)

    calculate_tool.name = "calculate"
    calculate_tool.description = TOOL_DESCRIPTION
    agent = create_react_agent(llm, [calculate_tool], prompt=SYSTEM)
    try:
        out = agent.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 8})
    except GraphRecursionError:  # the model kept calling the tool: the protocol worked, the tiny model looped
        return result(True, "stopped at the recursion limit (the model kept calling the tool)", version(*dists))
    kinds = [type(m).__name__ for m in out["messages"]]
    return result(True, f"messages {kinds}; last {out['messages'][-1].content!r}"[:400], version(*dists))
