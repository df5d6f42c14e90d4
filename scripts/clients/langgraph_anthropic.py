"""LangGraph's prebuilt ReAct agent on LangChain's `ChatAnthropic` (the Messages API), the same task as
langgraph_openai.py."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from _common import MODEL
from _langgraph import react

LABEL = "LangGraph + ChatAnthropic"
LANGUAGE = "python"
MODES = "create_react_agent, messages with tools"
REQUIREMENTS = ["langgraph==1.2.24", "langchain-openai==1.7.4", "langchain-anthropic==1.7.10"]
VENV = "langgraph"


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model_name=MODEL, base_url=os.environ["ROLLWAY_ANTHROPIC_BASE_URL"], api_key=api_key,
                        temperature=0, max_tokens=128, max_retries=0, timeout=300)
    return react(llm, ("langgraph", "langchain-anthropic"))
