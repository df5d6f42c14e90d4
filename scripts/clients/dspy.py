"""DSPy's `ReAct` module (`question -> answer`, a calculate tool) on `dspy.LM` (LiteLLM, OpenAI-compatible): DSPy
renders its own prompt with the trajectory so far each step (a new chain each step)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from _common import MODEL, QUESTION, calculate, result, version

LABEL = "DSPy (ReAct)"
LANGUAGE = "python"
MODES = "dspy.ReAct on dspy.LM (LiteLLM chat.completions), 3 iterations at most"
REQUIREMENTS = ["dspy==3.4.1"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of LiteLLM's price list at import
    os.environ["DSPY_CACHEDIR"] = str(workdir / "dspy-cache")
    import dspy
    import litellm
    from dspy.utils.exceptions import AdapterParseError

    def calculate_tool(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        return calculate(expression)

    calculate_tool.__name__ = "calculate"
    lm = dspy.LM(f"openai/{MODEL}", api_base=base_url, api_key=api_key, temperature=0, max_tokens=128, cache=False,
                 num_retries=0)
    dspy.configure(lm=lm)
    react = dspy.ReAct("question -> answer", tools=[calculate_tool], max_iters=3)
    try:
        out = react(question=QUESTION)
    except litellm.exceptions.APIError as e:  # an HTTP error from the gateway (BadRequestError and the rest)
        return result(False, f"{type(e).__name__}: {e}", version("dspy", "litellm"))
    except AdapterParseError as e:  # the tiny model's text did not parse into DSPy's fields (both adapters)
        return result(True, f"the model's output did not parse into DSPy's fields ({str(e).splitlines()[0]})",
                      version("dspy", "litellm"))
    return result(True, f"answer {out.answer!r}; trajectory keys {len(out.trajectory)}", version("dspy", "litellm"))
