"""The store's viewer side (issue 16): viewer keys, signed-in /ui cookies, and what the trainer reports.

`Store` inherits these methods (`ViewerStore`), so the gateway, `rollway view` and the pages in gateway/ui/
all call them on `Services.store` (gateway/services.py). Reading methods for the pages:

    await store.training_steps(after_version=None, limit=1000)   # per step: loss, kl, entropy, ... (oldest first)
    await store.session_advantages(["sess_...", ...])            # per session: advantage, version, step, ...
    await store.group_advantages("grp_...")                      # the same, for the sessions of one group
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterable
from typing import Any, cast

from sqlalchemy import Table, and_, delete, func, or_, select, update

from gateway.errors import BadRequest, NotFound
from gateway.store.db import DbConnection, DbEngine
from gateway.store.models import TrainedSample, TrainingStep, UiSession, ViewerKey

VK = cast(Table, ViewerKey.__table__)
UI = cast(Table, UiSession.__table__)
TS = cast(Table, TrainingStep.__table__)
TR = cast(Table, TrainedSample.__table__)

MAX_STEPS_PAGE = 10_000
ADVANTAGES_CHUNK = 500  # ids per IN (...) query: well under SQLite's and asyncpg's parameter limits


def _hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


class ViewerStore:
    """Mixed into `Store`; uses its `engine` and `begin()` (one transaction per method)."""

    engine: DbEngine

    def begin(self) -> contextlib.AbstractAsyncContextManager[DbConnection]:
        raise NotImplementedError  # Store's

    # --- viewer keys -----------------------------------------------------------------------------

    async def create_viewer_key(self, name: str) -> dict[str, Any]:
        """A new viewer key: `{id, key, name, created_at}`. The key is returned here only; the store keeps its hash."""
        key = "rw-viewer-" + secrets.token_urlsafe(32)
        row = {"id": f"vk_{secrets.token_hex(16)}", "name": name, "created_at": time.time()}
        async with self.begin() as conn:
            await conn.execute(VK.insert().values(key_hash=_hash(key), revoked_at=None, **row))
        return {"id": row["id"], "key": key, "name": name, "created_at": row["created_at"]}

    async def list_viewer_keys(self) -> list[dict[str, Any]]:
        """Every viewer key, revoked ones too, oldest first; no key material."""
        q = select(VK.c.id, VK.c.name, VK.c.created_at, VK.c.revoked_at).order_by(VK.c.created_at, VK.c.id)
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(q)).mappings().all()]

    async def revoke_viewer_key(self, key_id: str) -> dict[str, Any]:
        """Revoke a viewer key and end its signed-in cookies, in one transaction (idempotent)."""
        async with self.begin() as conn:
            row = (await conn.execute(select(VK).where(VK.c.id == key_id))).mappings().first()
            if row is None:
                raise NotFound(f"no viewer key {key_id}")
            revoked_at = row["revoked_at"]
            if revoked_at is None:
                revoked_at = time.time()
                await conn.execute(update(VK).where(VK.c.id == key_id).values(revoked_at=revoked_at))
            await conn.execute(delete(UI).where(UI.c.viewer_key_id == key_id))
        return {"id": key_id, "name": row["name"], "created_at": row["created_at"], "revoked_at": revoked_at}

    async def viewer_key_id(self, key: str) -> str | None:
        """The id of the live (not revoked) viewer key `key`, else None."""
        q = select(VK.c.id).where(and_(VK.c.key_hash == _hash(key), VK.c.revoked_at.is_(None)))
        async with self.engine.connect() as conn:
            return cast(str | None, (await conn.execute(q)).scalar())

    # --- /ui cookies -----------------------------------------------------------------------------

    async def create_ui_session(self, *, role: str, credential: str, ttl_s: float, viewer_key_id: str | None = None,
                                session_id: str | None = None) -> str:
        """A new cookie token for a caller who signed in with `credential` (only hashes are stored). Expired
        rows are swept here, so the table stays the size of the live sign-ins."""
        token = secrets.token_urlsafe(32)
        now = time.time()
        async with self.begin() as conn:
            await conn.execute(delete(UI).where(UI.c.expires_at < now))
            await conn.execute(UI.insert().values(
                token_hash=_hash(token), role=role, viewer_key_id=viewer_key_id, session_id=session_id,
                credential_hash=_hash(credential), created_at=now, expires_at=now + ttl_s))
        return token

    async def ui_session(self, token: str) -> dict[str, Any] | None:
        """The live sign-in of a cookie token: `{role, session_id, viewer_key_id, credential_hash, expires_at}`;
        None when unknown, expired, or its viewer key was revoked."""
        q = (select(UI.c.role, UI.c.session_id, UI.c.viewer_key_id, UI.c.credential_hash, UI.c.expires_at)
             .select_from(UI.outerjoin(VK, VK.c.id == UI.c.viewer_key_id))
             .where(and_(UI.c.token_hash == _hash(token), UI.c.expires_at > time.time(),
                         or_(UI.c.viewer_key_id.is_(None), VK.c.revoked_at.is_(None)))))
        async with self.engine.connect() as conn:
            row = (await conn.execute(q)).mappings().first()
        return None if row is None else dict(row)

    async def delete_ui_session(self, token: str) -> None:
        async with self.begin() as conn:
            await conn.execute(delete(UI).where(UI.c.token_hash == _hash(token)))

    # --- trainer reports -------------------------------------------------------------------------

    async def record_training_step(self, *, step: int, version: int, created_at: float, metrics: dict[str, Any],
                                   samples: Iterable[dict[str, Any]]) -> int:
        """Store a step's figures and its trained sessions; a report of the same version replaces the earlier one
        (a retried POST). Returns the number of samples stored."""
        rows = [{**s, "version": version, "step": step} for s in samples]
        async with self.begin() as conn:
            await conn.execute(delete(TR).where(TR.c.version == version))
            await conn.execute(delete(TS).where(TS.c.version == version))
            await conn.execute(TS.insert().values(version=version, step=step, created_at=created_at,
                                                  reported_at=time.time(), metrics=metrics))
            if rows:
                await conn.execute(TR.insert(), rows)
        return len(rows)

    async def training_steps(self, *, after_version: int | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """Reported steps by version, oldest first: `{version, step, created_at, reported_at, metrics}`, with
        `metrics` the trainer's figures by name (docs/viewer-auth.md lists them). `after_version`: only later
        versions (a page that polls passes the last version it has)."""
        if not 1 <= limit <= MAX_STEPS_PAGE:
            raise BadRequest(f"limit must be between 1 and {MAX_STEPS_PAGE}", param="limit")
        q = select(TS).order_by(TS.c.version).limit(limit)
        if after_version is not None:
            q = q.where(TS.c.version > after_version)
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(q)).mappings().all()]

    async def session_advantages(self, session_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Per trained session: `{advantage, version, step, group_id, reward, sequences, loss_tokens}` of the
        latest version it was trained in. Sessions never trained are absent. `advantage` is the token mean of
        the session's advantages over its loss tokens (for an outcome reward, its one advantage)."""
        ids = list(dict.fromkeys(session_ids))
        out: dict[str, dict[str, Any]] = {}
        async with self.engine.connect() as conn:
            for i in range(0, len(ids), ADVANTAGES_CHUNK):
                out.update(await _advantages(conn, TR.c.session_id.in_(ids[i:i + ADVANTAGES_CHUNK])))
        return out

    async def group_advantages(self, group_id: str) -> dict[str, dict[str, Any]]:
        """`session_advantages` of every trained session of a group."""
        async with self.engine.connect() as conn:
            return await _advantages(conn, TR.c.group_id == group_id)

    async def latest_training_step(self) -> dict[str, Any] | None:
        """The step of the highest reported version, or None."""
        async with self.engine.connect() as conn:
            top = (await conn.execute(select(func.max(TS.c.version)))).scalar()
            if top is None:
                return None
            row = (await conn.execute(select(TS).where(TS.c.version == top))).mappings().first()
        return None if row is None else dict(row)


async def _advantages(conn: DbConnection, where: Any) -> dict[str, dict[str, Any]]:
    q = select(TR).where(where).order_by(TR.c.session_id, TR.c.version)
    out: dict[str, dict[str, Any]] = {}
    for r in (await conn.execute(q)).mappings().all():
        row = dict(r)
        out[row.pop("session_id")] = row  # ordered by version: the latest wins
    return out
