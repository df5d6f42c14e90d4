"""The structured record of a session (GET /v1/sessions/{id}): turns with exact token arrays, and the tool
calls reconstructed from them, like TRL's TurnRecord / ToolCallRecord for its own rollouts."""

from __future__ import annotations

import json
from typing import Any

from gateway.store.store import TurnRow
from rollway_common.wire import unpack


def _looks_failed(result: str | None) -> bool:
    if result is None:
        return False
    text = result.strip()
    if text.lower().startswith(("error", "traceback", "exception")):
        return True
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and bool(data.get("error"))


def session_record(session: dict[str, Any], rows: list[TurnRow]) -> dict[str, Any]:
    chains: dict[str, list[int]] = {}
    turns: list[dict[str, Any]] = []
    for r in rows:
        delta: list[int] = unpack(r.prompt_ids, "int32")  # type: ignore[assignment]
        completion: list[int] = unpack(r.completion_ids, "int32")  # type: ignore[assignment]
        prompt = chains[r.parent_id] + delta if r.parent_id and r.parent_id in chains else delta
        chains[r.id] = prompt + completion
        turns.append({
            "id": r.id, "seq": r.seq, "parent_id": r.parent_id, "continuity": r.continuity,
            "chain_reason": r.chain_reason, "finish_reason": r.finish_reason,
            "client_disconnected": r.client_disconnected, "constrained": r.constrained,
            "reward": r.reward, "temperature": r.temperature, "request": r.request, "reply": r.reply,
            "prompt_ids": prompt, "prompt_delta_len": len(delta), "completion_ids": completion,
            "logprobs": unpack(r.logprobs, "float32"), "versions": unpack(r.versions, "int32"),
            "timings": r.timings,
        })
    return {**session, "turns": turns, "tool_calls": tool_calls(rows)}


def tool_calls(rows: list[TurnRow]) -> list[dict[str, Any]]:
    """Each tool call the model made, with the result the agent sent back in a later turn."""
    calls: list[dict[str, Any]] = []
    for i, r in enumerate(rows):
        for tc in (r.reply or {}).get("tool_calls") or []:
            result, took, result_turn = None, None, None
            for later in rows[i + 1:]:
                for m in later.request.get("messages", []):
                    if m.get("role") == "tool" and m.get("tool_call_id") == tc.get("id"):
                        result, result_turn = m.get("content"), later.id
                        break
                if result_turn is not None:
                    # From this reply's end to the next call that carried the result: the tool's time
                    # plus the agent's own overhead.
                    took = float(later.timings.get("started", 0.0)) - float(r.timings.get("finished", 0.0))
                    break
            fn = tc.get("function", {})
            calls.append({
                "turn_id": r.id, "id": tc.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments"),
                "result": result, "result_turn_id": result_turn,
                "seconds": round(took, 6) if took is not None else None, "failed": _looks_failed(result),
            })
    return calls
