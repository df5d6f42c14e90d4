"""The conversation as the agent saw it, turn by turn, and the per-session figures of the group page.

A turn that extends its parent shows only what is new since the parent's reply (the tool results, the next
user message): the rest is on the page already. A turn that starts a new chain shows its whole request,
under the reason the chain broke.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, cast

import orjson
from sqlalchemy import Table, Text, func, literal, select, text
from sqlalchemy import cast as sql_cast

from gateway.records import _looks_failed
from gateway.store.db import DbEngine
from gateway.store.models import Turn
from gateway.store.store import TurnRow
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


@dataclass(slots=True)
class LightTurn:
    """A turn without its token arrays or its request's history, for the conversation: what the page shows of
    a 200-turn session without reading its megabytes of tokens (the token view loads those on demand)."""

    id: str
    seq: int
    parent_id: str | None
    reply: dict[str, Any]
    versions: bytes
    temperature: float
    finish_reason: str
    continuity: str
    chain_reason: str | None
    client_disconnected: bool
    reward: float | None
    prompt_len: int
    timings: dict[str, Any]
    completion_len: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    asked: dict[str, Any] = field(default_factory=dict)
    first_new: int = 0
    """Index in its request's messages of the first one its parent's request and reply did not have."""
    new_messages: list[dict[str, Any]] = field(default_factory=list)


# Each request holds the whole history the agent replayed: a long session's requests are O(turns²) of JSON
# (4.3 MB for the benchmark's 200 turns; parsing it all took 0.25 s). The database hands over only what is
# new in each turn, the messages past its parent's count, taking the arrays apart in C.
_TAIL_SQL = {  # each parent's count computed once (MATERIALIZED), not once per element: 0.33 -> 0.05 s
    "sqlite": """WITH x AS MATERIALIZED (
            SELECT t.seq, t.request, COALESCE(json_array_length(p.request, '$.messages') + 1, 0) AS first
            FROM turns t LEFT JOIN turns p ON p.id = t.parent_id WHERE t.session_id = :sid)
        SELECT x.seq, j.key, j.value FROM x, json_each(x.request, '$.messages') j WHERE j.key >= x.first
        ORDER BY x.seq, j.key""",
    # PostgreSQL's json is text, parsed again by every function given it: each request's messages are taken out
    # once (x), counted once (n), taken apart once (here 3 parses of 4.3 MB, ~140 ms; it was 6, ~230 ms).
    "postgresql": """WITH x AS MATERIALIZED (
            SELECT t.id, t.parent_id, t.seq, t.request->'messages' AS m FROM turns t WHERE t.session_id = :sid),
        y AS MATERIALIZED (SELECT id, parent_id, seq, CASE WHEN json_typeof(m) = 'array' THEN m END AS m FROM x),
        n AS MATERIALIZED (SELECT id, json_array_length(m) AS n FROM y WHERE m IS NOT NULL)
        SELECT y.seq, j.idx - 1, j.value::text FROM y LEFT JOIN n ON n.id = y.parent_id
            CROSS JOIN LATERAL json_array_elements(y.m) WITH ORDINALITY AS j(value, idx)
        WHERE j.idx - 1 >= COALESCE(n.n + 1, 0) ORDER BY 1, 2""",
}


async def light_turns(engine: DbEngine, session_id: str) -> list[LightTurn]:
    names = [f.name for f in fields(LightTurn)][:13]
    req = T.c.request
    extract = ((func.json_extract(req, "$.sampling"), func.json_extract(req, "$.asked"))
               if engine.dialect.name == "sqlite" else
               (sql_cast(req.op("->")(literal("sampling")), Text), sql_cast(req.op("->")(literal("asked")), Text)))
    q = (select(*(T.c[n] for n in names), func.length(T.c.completion_ids), *extract)
         .where(T.c.session_id == session_id).order_by(T.c.seq))
    async with engine.connect() as conn:
        rows: list[Any] = list((await conn.execute(q)).all())
        tails = (await conn.execute(text(_TAIL_SQL[engine.dialect.name]), {"sid": session_id})).all()
    turns = {}
    for r in rows:
        turn = LightTurn(*r[:13])
        turn.completion_len, turn.sampling, turn.asked = int(r[13] or 0) // 4, _obj(r[14]), _obj(r[15])
        turns[turn.seq] = turn
    for seq, index, value in tails:
        turn = turns[seq]
        if not turn.new_messages:
            turn.first_new = int(index)
        message = orjson.loads(value)
        turn.new_messages.append(message if isinstance(message, dict) else {"role": "?", "content": str(message)})
    return list(turns.values())


def _obj(raw: Any) -> dict[str, Any]:
    value = orjson.loads(raw) if isinstance(raw, str | bytes) else raw
    return value if isinstance(value, dict) else {}


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
            call = calls.get(m["tool_call_id"] or "")
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
