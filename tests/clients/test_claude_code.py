"""Claude Code through rollway, unmodified: the Claude Agent SDK (`query()`, its bundled CLI, headless and offline)
and the CLI itself (`claude -p`), each pointed at a session with ANTHROPIC_BASE_URL, on a tool task against the
gateway on the CPU engine with the tuned tiny model (trained on the requests Claude Code sends: model.py). A whole
tool round trip each: the model calls the offered tool by its offered name (the SDK's MCP tool
`mcp__calc__calculate` with an expression, the CLI's `Bash` with `echo a+b`), Claude Code runs it and sends its
result back (the calculator's result, what bash printed), and the model answers after it. Every call is answered 2xx and stored as exactly the engine's tokens. The SDK and its CLI live in a pinned venv (scripts/clients/claude_agent_sdk.py, made from PyPI
on first use; the test is skipped where that cannot be made)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.clients import model
from tests.clients.conftest import Stack, assert_engine_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DRIVER = Path(__file__).resolve().parents[2] / "scripts" / "clients" / "claude_agent_sdk.py"


def _driver() -> Any:
    spec = importlib.util.spec_from_file_location("rollway_claude_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def driver() -> Any:
    mod = _driver()
    try:
        mod.ensure_venv()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"the pinned claude-agent-sdk venv could not be made (PyPI unreachable?): {e}")
    return mod


def _check_stored(stack: Stack, session_id: str, since: int, calls: int) -> dict[str, Any]:
    """Every call stored, as the engine's exact tokens, one chain (assert_engine_chain)."""
    record = assert_engine_chain(stack, session_id, since, turns=calls)
    for turn in record["turns"]:
        assert turn["request"]["asked"]["max_tokens"] == 128000  # Claude Code's own, cut to the context
        assert turn["request"]["asked"]["context_management"]["edits"][0]["type"] == "clear_thinking_20251015"
        roles = [m["role"] for m in turn["request"]["messages"]]
        assert roles[:3] == ["system", "user", "system"], roles  # Claude Code's environment entry, in place
    return record


def _assert_round_trip(record: dict[str, Any], kind: str) -> str:
    """Two turns: a call of the offered tool by its name with arguments the tool runs; then, with the tool's
    successful result in the request, the final answer. Returns that result (what the tool computed from the
    model's own arguments: the tiny model does not copy the question's numbers reliably)."""
    name = model.CLAUDE_CODE_TOOLS[kind]
    first, second = sorted(record["turns"], key=lambda t: t["seq"])
    [call] = first["reply"]["tool_calls"]
    expression = model.claude_code_expression(kind, json.loads(call["function"]["arguments"]))
    assert call["function"]["name"] == name and expression is not None, call
    result = model.claude_code_result(kind, expression)  # the calculator's result, or what echo printed
    results = [m for m in second["request"]["messages"] if m["role"] == "tool"]
    assert results == [{"role": "tool", "tool_call_id": call["id"], "content": result}], results  # no is_error
    assert second["request"]["messages"][-1] == results[0]  # the answer comes right after the result
    assert not second["reply"].get("tool_calls") and second["reply"]["content"] == model.ANSWER, second["reply"]
    [stored] = record["tool_calls"]
    assert stored["name"] == name and stored["result"] == result, stored
    return result


def test_claude_agent_sdk_tool_task(stack: Stack, driver: Any, tmp_path: Path) -> None:
    s = stack.new_session()
    since = len(stack.proxy.generate_records(0))
    out = driver.run(s.base_url, s.api_key, tmp_path)  # runs itself in the pinned venv
    print(json.dumps(out))
    assert out["ok"], out["detail"]
    assert out["version"] == driver.VERSION and out["calls"] == 2, out
    # the SDK saw the call of its MCP tool, ran it once, sent what it returned, and ended on the model's answer
    result = _assert_round_trip(_check_stored(stack, s.id, since, 2), "sdk")
    assert out["tool_uses"] == ["mcp__calc__calculate"] and out["tool_results"] == [result], out
    assert out["result"] == model.ANSWER, out


def test_claude_code_cli_headless(stack: Stack, driver: Any, tmp_path: Path) -> None:
    """`claude -p` itself, with the Claude Code tools it ships (the system prompt cut to fit a 4k context): Bash,
    allowed for `echo` only, runs the model's `echo a+b` and sends what it printed back."""
    s = stack.new_session()
    since = len(stack.proxy.generate_records(0))
    cli = driver.bundled_cli()
    env = driver.cli_env(s.anthropic_base_url, s.api_key, tmp_path / "home")
    proc = subprocess.run(
        [str(cli), "-p", "What is 12+7?", "--output-format", "json", "--max-turns", "3",
         "--system-prompt", driver.SYSTEM, "--tools", "Bash", "--allowedTools", "Bash(echo:*)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["api_error_status"] is None and not result.get("errors"), result
    assert result["subtype"] == "success" and not result["is_error"] and result["num_turns"] == 2, result
    assert result["permission_denials"] == [] and result["result"] == model.ANSWER, result
    _assert_round_trip(_check_stored(stack, s.id, since, 2), "cli")
