"""LangGraph's prebuilt ReAct agent (`create_react_agent`) on LangChain's `ChatOpenAI`, with a `@tool`: the model
calls the tool, LangGraph runs it and sends the result back, the model answers."""

from __future__ import annotations

import pathlib
from typing import Any

from _common import MODEL
from _langgraph import react

LABEL = "LangGraph + ChatOpenAI"
LANGUAGE = "python"
MODES = "create_react_agent, chat.completions with tools"
REQUIREMENTS = ["langgraph==1.2.24", "langchain-openai==1.7.4", "langchain-anthropic==1.7.10"]
VENV = "langgraph"


def chat_model(base_url: str, api_key: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base_url, api_key=api_key, temperature=0, max_tokens=128, max_retries=0,
                      timeout=300)


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    return react(chat_model(base_url, api_key), ("langgraph", "langchain-openai"))
