"""Instructor on the `openai` client: a Pydantic response model in `Mode.TOOLS` (a forced function tool) and in
`Mode.JSON_SCHEMA` (`response_format` json_schema), one validation attempt each."""

from __future__ import annotations

import pathlib
from typing import Any

from _common import MODEL, QUESTION, result, version

LABEL = "Instructor"
LANGUAGE = "python"
MODES = "Mode.TOOLS (forced tool_choice), Mode.JSON_SCHEMA (response_format)"
REQUIREMENTS = ["instructor==1.17.0"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    import instructor
    import openai
    from instructor.core.exceptions import InstructorRetryException
    from pydantic import BaseModel

    class Calculation(BaseModel):
        expression: str

    got = []
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300),
                                        mode=mode)
        try:
            out = client.chat.completions.create(
                model=MODEL, response_model=Calculation, max_retries=1, max_tokens=128, temperature=0,
                messages=[{"role": "user", "content": f"Extract the expression: {QUESTION}"}])
            got.append(f"{mode.name}: {out.expression!r}")
        except InstructorRetryException as e:
            cause = e.__cause__ or e
            if isinstance(cause, openai.APIStatusError) or "Error code" in str(e):
                return result(False, f"{mode.name}: {str(e)[:300]}", version("instructor", "openai"))
            got.append(f"{mode.name}: the model's output did not validate")
    return result(True, "; ".join(got), version("instructor", "openai"))
