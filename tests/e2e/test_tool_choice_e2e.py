"""Forced tool choice end to end: `rollway serve` with its CPU engine and the random tiny model, the real
openai SDK. Whatever the weights, `tool_choice="required"` and a named function give a tool call that parses,
names an offered tool and whose arguments match its schema; response_format json_schema gives JSON that
matches; the stored turn holds exactly the engine's output ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from rollway.embedded import free_port, wait_healthy

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
}, "required": ["city", "days"]}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "description": "alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
MESSAGES: list[Any] = [{"role": "user", "content": "what is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    data = tmp_path_factory.mktemp("serve") / "data"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ROLLWAY_ADMIN_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "serve", "--port", str(port), "--data-dir", str(data)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=240)
        yield url, (data / "admin_key").read_text().strip()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def session(served: tuple[str, str]) -> tuple[openai.OpenAI, str, str]:
    url, key = served
    group = httpx.post(f"{url}/v1/groups", json={"task": {}, "n_samples": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    cred = group["sessions"][0]
    client = openai.OpenAI(base_url=cred["base_url"], api_key=cred["api_key"], max_retries=0, timeout=300)
    return client, cred["session_id"], key


def stored_turn(served: tuple[str, str], session_id: str, key: str) -> dict[str, Any]:
    r = httpx.get(f"{served[0]}/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return r.json()["turns"][-1]  # type: ignore[no-any-return]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_forced_tool_choice_gives_a_valid_call(served: tuple[str, str], choice: Any) -> None:
    for _ in range(3):
        client, sid, key = session(served)
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=300)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", message
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == "set_alarm"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        turn = stored_turn(served, sid, key)
        assert len(turn["completion_ids"]) == r.usage.completion_tokens
        assert turn["reply"]["tool_calls"][0]["function"]["name"] == call.name


def test_response_format_json_schema(served: tuple[str, str]) -> None:
    client, _, _ = session(served)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), WEATHER)
