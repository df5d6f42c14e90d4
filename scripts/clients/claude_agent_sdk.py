"""Driver: the Claude Agent SDK (its bundled Claude Code CLI, headless, offline) through a rollway session.

    run(base_url, api_key, workdir) -> {"ok", "calls", "chains", "detail", "version", "tool_uses", "tool_runs",
                                        "tool_results", "result"}

`calls` are the distinct messages the SDK received; `tool_uses` the names of the tools the model called,
`tool_results` what the tool answered each time it ran, `result` the final text; `chains` is 0 (a session key cannot list its session's
turns without the session id: the client matrix reads them from the gateway).

`base_url` is the session's OpenAI base (`.../v1`; the Anthropic base is that without `/v1`, or
$ROLLWAY_ANTHROPIC_BASE_URL), `api_key` its key. The SDK's `query()` runs one tool task: the `calculate`
tool (an in-process MCP server of the SDK), no built-in tools, a short system prompt (Claude Code's own is
about 12k tokens, more than a small model's context), the tool allowed (no prompt), at most 4 turns. The CLI
talks to nothing but the gateway: ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY point it there, telemetry and
non-essential traffic are off, and HOME is a folder of `workdir` (no user settings are read).

Run where `claude_agent_sdk` imports (the client matrix's venv); elsewhere `run` makes the pinned venv
(PINNED_VENV, from PyPI, once) and runs itself there in a subprocess. `python scripts/clients/claude_agent_sdk.py
BASE_URL API_KEY WORKDIR` prints the result as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import venv
from typing import Any

LABEL = "Claude Agent SDK (bundled Claude Code CLI)"
LANGUAGE = "python"
MODES = "query() with an SDK MCP tool, streamed Messages (/v1/messages?beta=true), headless CLI"
VERSION = "0.2.189"
REQUIREMENTS = ["claude-agent-sdk==0.2.189"]  # VERSION
PINNED_VENV = pathlib.Path(os.environ.get("ROLLWAY_CLAUDE_SDK_VENV", f"~/.cache/rollway/venvs/claude-agent-sdk-{VERSION}")).expanduser()
"""The pinned venv `run` makes when `claude_agent_sdk` is not importable here."""
SYSTEM = "Use the calculate tool, then answer with the number only."
PROMPT = "What is 12+7?"
MAX_TURNS = 4


def cli_env(anthropic_base_url: str, api_key: str, home: pathlib.Path) -> dict[str, str]:
    """The CLI's environment: the gateway and its key, nothing of the user's, no traffic elsewhere."""
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "TZ")}
    return {**keep, "HOME": str(home), "ANTHROPIC_BASE_URL": anthropic_base_url, "ANTHROPIC_API_KEY": api_key,
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}


def calculate_text(expression: str) -> str:
    """The tool: a + b, a - b or a * b of two integers (what the task asks), else an error text."""
    for op in "+-*":
        a, sep, b = expression.partition(op)
        if sep and a.strip().isdigit() and b.strip().isdigit():
            x, y = int(a), int(b)
            return str(x + y if op == "+" else x - y if op == "-" else x * y)
    return "error: unsupported expression"


def anthropic_base(base_url: str) -> str:
    return os.environ.get("ROLLWAY_ANTHROPIC_BASE_URL") or base_url.rstrip("/").removesuffix("/v1")


async def _query(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    from claude_agent_sdk import (
        AssistantMessage,
        ClaudeAgentOptions,
        ResultMessage,
        __version__,
        create_sdk_mcp_server,
        query,
        tool,
    )

    calls: list[dict[str, Any]] = []

    @tool("calculate", "Evaluate an arithmetic expression with + - * / and parentheses.", {"expression": str})
    async def calculate(args: dict[str, Any]) -> dict[str, Any]:
        expr = str(args.get("expression", ""))
        calls.append({"expression": expr, "result": calculate_text(expr)})
        return {"content": [{"type": "text", "text": calls[-1]["result"]}]}

    stderr: list[str] = []
    options = ClaudeAgentOptions(
        system_prompt=SYSTEM, tools=[], mcp_servers={"calc": create_sdk_mcp_server("calc", tools=[calculate])},
        allowed_tools=["mcp__calc__calculate"], max_turns=MAX_TURNS,
        cwd=str(workdir), setting_sources=[], env=cli_env(anthropic_base(base_url), api_key, workdir / "home"),
        stderr=stderr.append,
    )
    messages: set[str] = set()
    result: Any = None
    tool_uses: list[str] = []
    errors: list[str] = []
    try:
        async for msg in query(prompt=PROMPT, options=options):
            if isinstance(msg, AssistantMessage):
                if msg.message_id:
                    messages.add(msg.message_id)
                if msg.error:
                    errors.append(str(msg.error))
                tool_uses += [b.name for b in msg.content if type(b).__name__ == "ToolUseBlock"]
            elif isinstance(msg, ResultMessage):
                result = msg
    except Exception as e:  # the CLI failed: its stderr says why
        errors.append(f"{type(e).__name__}: {e}"[:400])
    ok = result is not None and not result.is_error and not errors and result.api_error_status is None
    detail = (f"{len(messages)} messages, tool uses {tool_uses or 'none'}, the tool ran {len(calls)} times; "
              f"result {getattr(result, 'subtype', None)!r}: {str(getattr(result, 'result', ''))[:120]!r}")
    if not ok:
        detail += f"; errors {errors or getattr(result, 'errors', None)}; stderr {' '.join(stderr)[-400:]!r}"
    return {"ok": ok, "calls": len(messages), "chains": 0, "detail": detail, "version": __version__,
            "tool_uses": tool_uses, "tool_runs": len(calls), "tool_results": [c["result"] for c in calls],
            "result": getattr(result, "result", None)}


def _in_venv(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    python = ensure_venv()
    env = {**os.environ, "ROLLWAY_ANTHROPIC_BASE_URL": anthropic_base(base_url)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), __file__, base_url, api_key, str(workdir)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "calls": 0, "chains": 0, "version": VERSION,
                "detail": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}
    return dict(json.loads(lines[-1]))


def ensure_venv() -> pathlib.Path:
    """The pinned venv's python (made on first use, from PyPI)."""
    python = PINNED_VENV / "bin" / "python"
    if not python.is_file():
        venv.create(PINNED_VENV, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    return python


def bundled_cli() -> pathlib.Path:
    """The Claude Code CLI the pinned SDK's wheel bundles."""
    python = ensure_venv()
    out = subprocess.run([str(python), "-c", "import claude_agent_sdk, pathlib; print(pathlib.Path("
                          "claude_agent_sdk.__file__).parent / '_bundled' / 'claude')"],
                         capture_output=True, text=True, check=True, env={"PATH": os.environ.get("PATH", "")})
    return pathlib.Path(out.stdout.strip())


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    here = pathlib.Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != here]  # this file is not the SDK
    try:
        import claude_agent_sdk  # noqa: F401
    except ImportError:
        return _in_venv(base_url, api_key, workdir)
    import anyio

    try:
        return anyio.run(_query, base_url, api_key, workdir)
    except Exception as e:  # the row says what failed rather than the matrix losing it
        return {"ok": False, "calls": 0, "chains": 0, "version": VERSION, "detail": f"{type(e).__name__}: {e}"[:800]}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3]))))
