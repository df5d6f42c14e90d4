"""Requests stored as deltas on their parent's (gateway/store/requests.py, migration 0006): every reader gives
what it gave from whole requests, on recorded sessions, and the migration converts a store in place, stopped and
run again, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from alembic import command
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.store import db
from gateway.store.requests import is_delta
from gateway.store.store import Store, T
from gateway.store.views import light_turns
from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway

TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look something up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
MIGRATION = Path(__file__).parents[2] / "migrations" / "versions" / "0006_request_deltas.py"


def _chat(gw: LiveGateway, cred: dict[str, Any], messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    r = httpx.post(f"{cred['base_url']}/chat/completions", headers={"Authorization": f"Bearer {cred['api_key']}"},
                   json={"model": "m", "messages": messages, "max_tokens": 6, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _record(gw: LiveGateway) -> dict[str, list[list[dict[str, Any]]]]:
    """Sessions as agents make them; returns, per session, the messages each turn sent."""
    sent: dict[str, list[list[dict[str, Any]]]] = {}
    creds = gw.group(4)["sessions"]

    def turn(cred: dict[str, Any], messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        sent.setdefault(cred["session_id"], []).append(orjson.loads(orjson.dumps(messages)))
        return _chat(gw, cred, messages, **kw)

    # 1: the reply echoed as returned, tools every turn: the longest deltas
    m: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for i in range(5):
        reply = turn(creds[0], m, tools=TOOLS)
        m = [*m, {k: v for k, v in reply.items() if v is not None}, {"role": "user", "content": f"more {i} é"}]
    # 2: the reply re-serialised (keys reordered), tools changing half way, no tools at the end
    m = [{"role": "user", "content": "start"}]
    for i in range(4):
        reply = turn(creds[1], m, **({"tools": TOOLS} if i < 2 else {}))
        m = [*m, {"content": reply.get("content") or "", "role": "assistant"}, {"role": "user", "content": str(i)}]
    # 3: an edited history (a new chain) then extended again, and a branch back to the first turn
    m = [{"role": "user", "content": "a"}]
    r1 = turn(creds[2], m)
    m2 = [*m, {"role": "assistant", "content": r1["content"]}, {"role": "user", "content": "b"}]
    turn(creds[2], m2)
    edited = [{"role": "user", "content": "a, edited"}, *m2[1:]]
    r3 = turn(creds[2], edited)
    turn(creds[2], [*edited, {"role": "assistant", "content": r3["content"]}, {"role": "user", "content": "c"}])
    turn(creds[2], [*m2[:2], {"role": "user", "content": "branch"}])
    # 4: one turn only
    turn(creds[3], [{"role": "user", "content": "once"}])
    return sent


def _run(url: str, fn: Callable[[Any], Any], *, autocommit: bool = False) -> Any:
    async def go() -> Any:
        engine = create_async_engine(db.async_url(url))
        try:
            async with engine.connect() as conn:
                if autocommit:
                    conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                out = await conn.run_sync(fn)
                await conn.commit()
                return out
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _stored(url: str) -> dict[str, Any]:
    """turn id -> its request as stored."""
    rows = _run(url, lambda c: c.execute(select(T.c.id, T.c.request)).all())
    return {tid: req for tid, req in rows}


def _readers(gw_url: str, url: str, session_ids: list[str]) -> dict[str, Any]:
    """What every reader of turns answers: the session record, SFT export, the viewer's turn JSON and light
    turns, the session view's and leases' reads."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    out: dict[str, Any] = {}
    with httpx.Client(base_url=gw_url, headers=admin, timeout=60) as http:
        for sid in session_ids:
            rec = http.get(f"/v1/sessions/{sid}").json()
            out[f"record {sid}"] = rec
            for t in rec["turns"]:
                r = http.get(f"/ui/api/sessions/{sid}/turns/{t['id']}")
                assert r.status_code == 200, r.text
                out[f"ui turn {t['id']}"] = r.json()
        out["sft export"] = http.get("/v1/sessions", params={"include_turns": "true", "limit": 1000}).json()

    async def store_reads() -> dict[str, Any]:
        store = Store(db.create_engine(url))
        try:
            got: dict[str, Any] = {}
            for sid in session_ids:
                got[f"light {sid}"] = [dataclasses.asdict(t) for t in await light_turns(store.engine, sid)]
                got[f"rows {sid}"] = [dataclasses.asdict(r) for r in await store.session_turns(sid)]
            got["lease rows"] = {sid: [dataclasses.asdict(r) for r in rows]
                                 for sid, rows in (await store.turns_of_sessions(session_ids)).items()}
            return got
        finally:
            await store.close()

    out.update(asyncio.run(store_reads()))
    return orjson.loads(orjson.dumps(out, option=orjson.OPT_PASSTHROUGH_DATACLASS, default=_bytes))


def _bytes(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError


def _migration() -> Any:
    spec = importlib.util.spec_from_file_location("m0006", MIGRATION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded(db_url: str, tiny_model_dir: Path) -> Any:
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as gw:
        sent = _record(gw)
        yield gw, sent


def test_deltas_are_stored_and_every_reader_answers_as_from_whole_requests(recorded: Any, db_url: str) -> None:
    gw, sent = recorded
    sids = list(sent)
    live = _readers(gw.url, db_url, sids)
    stored = _stored(db_url)
    # Most turns that extend a parent are deltas, and a delta is far smaller than the whole request.
    deltas = [r for r in stored.values() if is_delta(r)]
    assert len(deltas) >= 9, stored
    for sid in sids:  # each turn's whole request holds exactly the messages the client sent
        assert [t["request"]["messages"] for t in live[f"record {sid}"]["turns"]] == sent[sid]
    first = live[f"record {sids[0]}"]["turns"]
    assert all(t["request"]["tools"] == TOOLS for t in first)
    assert all(stored[t["id"]].get("$same") == ["tools"] for t in first[1:])
    assert len(orjson.dumps(stored[first[-1]["id"]])) < len(orjson.dumps(first[-1]["request"])) / 2

    # The old representation: every request whole again (the downgrade), read by the same readers.
    command.downgrade(db._alembic_config(db_url), "0005")
    assert not any(is_delta(r) for r in _stored(db_url).values())
    old = _readers(gw.url, db_url, sids)
    assert old == live

    # The migration, stopped after two sessions' batches (of four), then run again: the same answers at each step.
    m = _migration()
    m.SESSIONS_PER_BATCH = 1
    calls = 0

    def stopping(rows: list[Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise KeyboardInterrupt
        return m._compact(rows)

    with pytest.raises(KeyboardInterrupt):
        _run(db_url, lambda c: m._rewrite(c, "upgrade", stopping), autocommit=True)
    part = _stored(db_url)
    done = {k for k, v in part.items() if is_delta(v)}
    assert done <= {k for k, v in stored.items() if is_delta(v)}
    progress = _run(db_url, lambda c: c.exec_driver_sql(
        "SELECT value FROM settings WHERE key = 'request_deltas_after'").scalar())
    assert progress is not None
    assert _readers(gw.url, db_url, sids) == old

    calls = -10**9  # the rest of the run: no stop
    seen: list[int] = []

    def counting(rows: list[Any]) -> dict[str, Any]:
        seen.append(len(rows))
        return m._compact(rows)

    _run(db_url, lambda c: m._rewrite(c, "upgrade", counting), autocommit=True)
    # It continued after the last committed batch: the sessions done before were not read again.
    sessions = _run(db_url, lambda c: c.exec_driver_sql("SELECT count(*) FROM sessions").scalar())
    assert len(seen) == sessions - 2
    after = _stored(db_url)
    assert {k for k, v in after.items() if is_delta(v)} == {k for k, v in stored.items() if is_delta(v)}
    assert after == stored  # the migration writes what the gateway wrote
    assert _run(db_url, lambda c: c.exec_driver_sql("SELECT count(*) FROM settings WHERE key LIKE 'request_%'")
                .scalar()) == 0
    # Through alembic: down (whole), up (deltas) again, and up once more changes nothing.
    command.downgrade(db._alembic_config(db_url), "0005")
    db.upgrade(db_url)
    assert _stored(db_url) == stored
    db.upgrade(db_url)
    assert _stored(db_url) == stored
    assert _readers(gw.url, db_url, sids) == old
