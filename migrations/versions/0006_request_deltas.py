"""request deltas: a turn that extends its parent stores only what its request adds (issue 31)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27

Each turn's `request` held every message the agent replayed, so a session's requests grew as turns² (62 bytes
stored per byte of conversation on SQLite for 120-turn sessions). The gateway now writes a turn that extends its
parent as a delta on the parent's request (gateway/store/requests.py); this revision rewrites the rows already
there the same way, a batch of sessions at a time, each batch one statement committed on its own. The schema does
not change (`$base` in a request tells its form), so rows of either form stay readable throughout: a run that
stops (killed, a lost connection) leaves a store that reads as before, and running the upgrade again continues
after the last batch it committed (`settings.request_deltas_after`) and rewrites no row twice (a delta is left
as it is). The downgrade writes every request whole again, the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

from gateway.store.requests import delta, expand, is_delta

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

SESSIONS_PER_BATCH = 200
ROWS_PER_STATEMENT = 500
PROGRESS = {"upgrade": "request_deltas_after", "downgrade": "request_deltas_undone_after"}
"""settings keys: the last session id (in id order) whose turns a run rewrote; removed when that run completes."""

settings = sa.table("settings", sa.column("key", sa.String), sa.column("value", sa.JSON))
sessions = sa.table("sessions", sa.column("id", sa.String))
T = sa.table("turns", sa.column("id", sa.String), sa.column("session_id", sa.String), sa.column("seq", sa.Integer),
             sa.column("parent_id", sa.String), sa.column("request", sa.JSON), sa.column("reply", sa.JSON))
"""The columns of `turns` this revision reads and writes, as they are at revision 0006 (not the live model's table,
which later revisions may change)."""


class _Row:
    __slots__ = ("id", "parent_id", "reply", "request", "stored")

    def __init__(self, id: str, parent_id: str | None, request: Any, reply: Any) -> None:
        self.id, self.parent_id, self.stored, self.reply = id, parent_id, request, reply
        self.request = request if isinstance(request, dict) else {}


def _compact(rows: list[_Row]) -> dict[str, Any]:
    """Rows of one session (seq order) -> {turn id: its request as a delta} for the whole ones that extend."""
    expand(rows)
    by_id = {r.id: r for r in rows}
    out = {}
    for r in rows:
        parent = by_id.get(r.parent_id or "")
        if parent is None or is_delta(r.stored) or not isinstance(r.stored, dict):
            continue
        base = [*(parent.request.get("messages") or []), parent.reply]
        d = delta(r.stored, parent.id, base, parent.request)
        if d is not r.stored:
            out[r.id] = d
    return out


def _whole(rows: list[_Row]) -> dict[str, Any]:
    expand(rows)
    return {r.id: r.request for r in rows if is_delta(r.stored)}


def _rewrite(conn: sa.Connection, way: str, rewrite: Callable[[list[_Row]], dict[str, Any]]) -> None:
    key = PROGRESS[way]
    conn.execute(sa.delete(settings).where(settings.c.key == PROGRESS["downgrade" if way == "upgrade" else "upgrade"]))
    after = conn.execute(sa.select(settings.c.value).where(settings.c.key == key)).scalar()
    after = after if isinstance(after, str) else ""
    while True:
        sids = list(conn.execute(sa.select(sessions.c.id).where(sessions.c.id > after)
                                 .order_by(sessions.c.id).limit(SESSIONS_PER_BATCH)).scalars())
        if not sids:
            break
        q = (sa.select(T.c.session_id, T.c.id, T.c.parent_id, T.c.request, T.c.reply)
             .where(T.c.session_id.in_(sids)).order_by(T.c.session_id, T.c.seq))
        by_session: dict[str, list[_Row]] = {}
        for sid, *rest in conn.execute(q):
            by_session.setdefault(sid, []).append(_Row(*rest))
        updates: dict[str, Any] = {}
        for rows in by_session.values():
            updates.update(rewrite(rows))
        items = list(updates.items())
        for i in range(0, len(items), ROWS_PER_STATEMENT):  # each statement is atomic: its rows or none
            part = items[i:i + ROWS_PER_STATEMENT]
            value = sa.case(*[(T.c.id == tid, sa.bindparam(f"r{j}", req, type_=T.c.request.type))
                              for j, (tid, req) in enumerate(part)], else_=T.c.request)
            conn.execute(T.update().where(T.c.id.in_([tid for tid, _ in part])).values(request=value))
        after = sids[-1]
        done = conn.execute(sa.update(settings).where(settings.c.key == key).values(value=after)).rowcount
        if not done:
            conn.execute(sa.insert(settings).values(key=key, value=after))
    conn.execute(sa.delete(settings).where(settings.c.key == key))


def upgrade() -> None:
    with op.get_context().autocommit_block():  # every statement commits on its own: a stopped run keeps its work
        _rewrite(op.get_bind(), "upgrade", _compact)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        _rewrite(op.get_bind(), "downgrade", _whole)
