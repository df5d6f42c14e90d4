"""mini-swe-agent's `DefaultAgent` with its default config (`config/default.yaml`), its `LitellmModel` (LiteLLM
chat.completions with its `bash` tool) and a `LocalEnvironment` in a temporary folder, 3 steps at most. The agent
appends each reply and the command's output to its history, but on a reply with no tool call (a format error) it
appends only its error message: the reply is left out of the next prompt, which then starts a new chain."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from _common import MODEL, QUESTION, result, version

LABEL = "mini-swe-agent"
LANGUAGE = "python"
MODES = "DefaultAgent + default.yaml, LitellmModel (chat.completions, bash tool), LocalEnvironment, 3 steps at most"
REQUIREMENTS = ["mini-swe-agent==2.4.6"]


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    os.environ.update({
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of LiteLLM's price list at import
        "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(workdir / "mswea-config"),
        "MSWEA_COST_TRACKING": "ignore_errors",  # a self-hosted model has no price in LiteLLM's map
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # an HTTP error is reported, not retried 10 times
    })
    from importlib.resources import files

    import litellm
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    config = yaml.safe_load((files("minisweagent") / "config" / "default.yaml").read_text())
    task_dir = workdir / "task"
    task_dir.mkdir(exist_ok=True)
    model = LitellmModel(model_name=f"openai/{MODEL}", **{**config["model"], "model_kwargs": {
        **config["model"].get("model_kwargs", {}), "api_base": base_url, "api_key": api_key, "temperature": 0,
        "max_tokens": 128, "timeout": 300}})
    env = LocalEnvironment(**{**config["environment"], "cwd": str(task_dir)})
    agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": 3})
    ver = version("mini-swe-agent", "litellm")
    try:
        out = agent.run(QUESTION)
    except litellm.exceptions.APIError as e:  # an HTTP error from the gateway (BadRequestError and the rest)
        return result(False, f"{type(e).__name__}: {e}", ver)
    roles = [m.get("role") for m in agent.messages]
    errors = sum(m.get("extra", {}).get("interrupt_type") == "FormatError" for m in agent.messages)
    return result(True, f"exit {out.get('exit_status')!r} after {agent.n_calls} calls; {errors} format error(s) "
                        f"(no tool call from the model); messages {roles}", ver, agent.n_calls)
