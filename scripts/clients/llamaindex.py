"""LlamaIndex's workflow `ReActAgent` with a `FunctionTool`, on `OpenAILike` (chat.completions, no native tool
calling), asked two questions in one conversation (one memory). The agent renders its ReAct prompt (tools and
format as text in its own system message) and keeps its own rendering of each reply, not the model's text: the
memory holds "Thought: ...\nAnswer: ..." (the parsed step), and within a question each step's reasoning is sent
back as "Thought/Action/Action Input" re-rendered from the parse, with "Observation:" user messages. A prompt
then edits the model's earlier message, so each call starts a new chain (`edited_message`)."""

from __future__ import annotations

import asyncio
import os
import pathlib
from typing import Any

from _common import MODEL, QUESTION, SYSTEM, calculate, result, version

FOLLOW_UP = "And 2*22?"

LABEL = "LlamaIndex (ReAct agent)"
LANGUAGE = "python"
MODES = "workflow ReActAgent on OpenAILike (chat.completions, streamed), 3 iterations at most"
REQUIREMENTS = ["llama-index-core==0.14.25", "llama-index-llms-openai-like==0.8.1"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    # offline: tiktoken's encodings come from llama-index's bundled cache, NLTK's data too; nothing else is fetched
    os.environ.setdefault("LLAMA_INDEX_CACHE_DIR", str(workdir / "llama-index-cache"))
    import openai
    from llama_index.core.agent.workflow import ReActAgent
    from llama_index.core.memory import ChatMemoryBuffer
    from llama_index.core.tools import FunctionTool
    from llama_index.core.workflow.errors import WorkflowRuntimeError
    from llama_index.llms.openai_like import OpenAILike

    def calculate_tool(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        return calculate(expression)

    llm = OpenAILike(model=MODEL, api_base=base_url, api_key=api_key, temperature=0, max_tokens=128,
                     is_chat_model=True, is_function_calling_model=False, context_window=4096, max_retries=0,
                     timeout=300)
    tool = FunctionTool.from_defaults(fn=calculate_tool, name="calculate")
    agent = ReActAgent(tools=[tool], llm=llm, system_prompt=SYSTEM)
    ver = version("llama-index-core", "llama-index-llms-openai-like")

    async def go() -> list[Any]:
        # a second question in the same conversation, through one memory (a Context reused across runs drops the
        # default memory in this version: "Skipping serialization of known unserializable key: memory")
        memory = ChatMemoryBuffer.from_defaults(llm=llm)
        return [await agent.run(user_msg=q, memory=memory, max_iterations=3) for q in (QUESTION, FOLLOW_UP)]

    try:
        outs = asyncio.run(go())
    except openai.APIStatusError as e:  # the gateway refused a call
        return result(False, f"{type(e).__name__}: {e}", ver)
    except WorkflowRuntimeError as e:  # the tiny model did not finish in ReAct's text format within 3 steps
        return result(True, f"the model's output did not complete ReAct's format: {str(e).splitlines()[0][:200]}",
                      ver)
    tools = [c.tool_name for o in outs for c in o.tool_calls]
    answers = "; ".join(repr(str(o.response.content)[:24]) for o in outs)
    if tools:
        return result(True, f"tool calls {tools}; answers {answers}", ver)
    return result(True, "the model never wrote ReAct's 'Thought:' format: each reply taken whole as the answer (one "
                        "step a question, no tool run), and sent back in the next prompt as 'Thought: (Implicit) ... "
                        f"Answer: ...'; answers {answers}", ver)
