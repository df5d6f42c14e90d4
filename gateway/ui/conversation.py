"""The conversation as the agent saw it, turn by turn, and the per-session figures of the group page.

A turn that extends its parent shows only what is new since the parent's reply (the tool results, the next
user message): the rest is on the page already. A turn that starts a new chain shows its whole request,
under the reason the chain broke.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, cast

from sqlalchemy import Table, func, select

from gateway.records import _looks_failed
from gateway.store.db import DbEngine
from gateway.store.models import Turn
from gateway.store.store import TurnRow
from gateway.store.views import LightTurn
from rollway_common.wire import unpack

T = cast(Table, Turn.__table__)
SHOWN_CHARS = 2000
"""Longer texts are cut on the page (the rest loads on a click): 200 turns of 4k tokens stay a light page."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" if isinstance(p, dict) and p.get("type") == "text"
                       else f"[{p.get('type', 'part') if isinstance(p, dict) else 'part'}]" for p in content)
    return json.dumps(content, ensure_ascii=False)


def _cut(text: str) -> dict[str, Any]:
    return {"text": text[:SHOWN_CHARS], "cut": len(text) > SHOWN_CHARS, "length": len(text)}


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        out.append({"id": call.get("id"), "name": fn.get("name"),
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
    return out


def message_view(message: dict[str, Any], index: int) -> dict[str, Any]:
    return {"index": index, "role": message.get("role", "?"), "content": _cut(_text(message.get("content"))),
            "reasoning": _cut(_text(message.get("reasoning_content"))) if message.get("reasoning_content") else None,
            "tool_calls": _calls(message), "tool_call_id": message.get("tool_call_id"), "name": message.get("name")}


def _versions(blob: bytes) -> list[int]:
    return unpack(blob, "int32")  # type: ignore[return-value]


async def token_turns(engine: DbEngine, session_id: str) -> list[TurnRow]:
    """The session's turns with their token arrays but not their messages (what the token view needs)."""
    names = [f.name for f in fields(TurnRow) if f.name not in ("request", "reply")]
    q = select(*(T.c[n] for n in names)).where(T.c.session_id == session_id).order_by(T.c.seq)
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
    return [TurnRow(**dict(zip(names, r, strict=True)), request={}, reply={}) for r in rows]


def turn_views(rows: list[LightTurn]) -> list[dict[str, Any]]:
    """Per turn: what is new in its request, its reply, sampling, timings and token figures."""
    calls = {c["id"]: c for r in rows for c in _calls(r.reply or {}) if c["id"]}
    seqs = {r.id: r.seq for r in rows}
    out = []
    for r in rows:
        new = [message_view(m, r.first_new + i) for i, m in enumerate(r.new_messages)]
        for m in new:
            tid = m["tool_call_id"]  # a string, but a store written before requests were checked may hold a dict
            call = calls.get(tid) if isinstance(tid, str) else None
            m["tool_name"] = call["name"] if call else None
            m["tool_failed"] = m["role"] == "tool" and _looks_failed(m["content"]["text"])
        versions = _versions(r.versions)
        t = r.timings or {}
        started, finished = t.get("started"), t.get("finished")
        out.append({
            "id": r.id, "seq": r.seq, "parent_id": r.parent_id,
            "parent_seq": seqs.get(r.parent_id) if r.parent_id else None,
            "continuity": r.continuity, "chain_reason": r.chain_reason, "finish_reason": r.finish_reason,
            "client_disconnected": r.client_disconnected, "reward": r.reward, "temperature": r.temperature,
            "sampling": {k: v for k, v in r.sampling.items() if v is not None},
            "asked": {k: v for k, v in r.asked.items() if v is not None},
            "new_messages": new, "skipped": r.first_new if r.parent_id else 0,
            "reply": message_view(r.reply, r.first_new + len(r.new_messages)) if r.reply else None,
            "prompt_tokens": r.prompt_len, "completion_tokens": r.completion_len,
            "versions": sorted(set(versions)),
            "seconds": (float(finished) - float(started)) if started and finished else None,
            "resubmits": t.get("resubmits"), "cached_tokens": t.get("cached_tokens"), "backend": t.get("backend"),
            "backends": t.get("backends"), "started": started,
        })
    return out


async def session_stats(engine: DbEngine, session_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per session of a group: turns, tokens generated, last prompt length, weight versions, tool calls,
    chain breaks and the last finish reason (one query over the group's turns)."""
    if not session_ids:
        return {}
    q = (select(T.c.session_id, T.c.seq, T.c.prompt_len, func.length(T.c.completion_ids), T.c.versions, T.c.reply,
                T.c.continuity, T.c.finish_reason)
         .where(T.c.session_id.in_(session_ids)).order_by(T.c.session_id, T.c.seq))
    out: dict[str, dict[str, Any]] = {}
    async with engine.connect() as conn:
        found: list[Any] = list((await conn.execute(q)).all())
        for sid, seq, prompt_len, clen, vblob, reply, continuity, finish in found:
            s = out.setdefault(sid, {"turns": 0, "generated": 0, "prompt_tokens": 0, "versions": set(),
                                     "tool_calls": 0, "chain_breaks": 0, "last_finish": None})
            s["turns"] += 1
            s["generated"] += int(clen or 0) // 4
            s["prompt_tokens"] = int(prompt_len)
            s["versions"].update(_versions(vblob))
            s["tool_calls"] += len((reply or {}).get("tool_calls") or [])
            s["chain_breaks"] += 1 if continuity == "new-chain" and seq > 1 else 0
            s["last_finish"] = finish
            last = (reply or {}).get("content")
            s["last_reply"] = _text(last)[:300] if last else s.get("last_reply")
    for s in out.values():
        s["versions"] = sorted(s["versions"])
    return out
