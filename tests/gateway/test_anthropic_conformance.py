"""docs/conformance-anthropic.md against the code: every field the Messages request models declare, every field
refused, and every content block the translation reads has a row; ignored fields are logged once."""

from __future__ import annotations

import logging
import re
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.anthropic.protocol import REFUSED_FIELDS, CountTokensRequest, MessagesRequest, ThinkingConfig
from gateway.anthropic.translate import _NOT_TEXT

DOC = (Path(__file__).resolve().parents[2] / "docs" / "conformance-anthropic.md").read_text()


def rows() -> set[str]:
    """The backticked names in the first cell of each table row."""
    names: set[str] = set()
    for line in DOC.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            names |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize("model", [MessagesRequest, CountTokensRequest])
def test_every_declared_field_has_a_row(model: Any) -> None:
    names = rows()
    missing = {name for name in model.model_fields
               if name not in names and not any(n.startswith(name + ".") for n in names)}
    assert not missing, f"fields without a row in docs/conformance-anthropic.md: {sorted(missing)}"
    assert {"messages", "max_tokens", "tool_choice.disable_parallel_tool_use"} <= names


def test_every_refused_field_and_block_has_a_row() -> None:
    names = rows()
    assert set(REFUSED_FIELDS) <= names
    assert set(_NOT_TEXT) | {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"} <= names
    assert {"x-api-key", "anthropic-version", "anthropic-beta"} <= names
    for kind in ThinkingConfig.model_fields["type"].annotation.__args__:  # type: ignore[union-attr]
        assert f'"{kind}"' in DOC or f"`{kind}`" in DOC, kind
    for event in ("message_start", "ping", "content_block_start", "content_block_stop", "message_delta",
                  "message_stop", "error"):
        assert event in names, event
    for delta in ("thinking_delta", "signature_delta", "text_delta", "input_json_delta"):
        assert f"`content_block_delta` `{delta}`" in DOC, delta


def test_ignored_fields_are_logged_once(gateway: Any, caplog: pytest.LogCaptureFixture) -> None:
    cred = gateway.group(2)["sessions"][0]
    probe = f"probe_{secrets.token_hex(4)}"  # names are logged once per process: fresh ones for each run
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", f"{probe}_block": 1}]}], probe: True}
    with caplog.at_level(logging.INFO, logger="rollway.gateway"):
        for _ in range(2):
            r = httpx.post(f"{gateway.url}/v1/messages", json=body, timeout=30,
                           headers={"x-api-key": cred["api_key"], "anthropic-beta": f"{probe}-beta"})
            assert r.status_code == 200, r.text
    logged = [r.getMessage() for r in caplog.records]
    for text in (f"ignoring unknown request field messages.{probe}",
                 f"ignoring unknown request field messages.text.{probe}_block",
                 f"ignoring anthropic-beta {probe}-beta"):
        assert sum(m == text or m.startswith(text + " ") for m in logged) == 1, (text, logged)
