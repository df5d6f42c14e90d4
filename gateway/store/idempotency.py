"""Idempotent group creation: `POST /v1/groups` with an `Idempotency-Key` header can be sent again.

A runner whose connection drops after sending a group creation cannot tell whether the gateway created the
group. Retrying without a key could leave an orphan group (its sessions never run, its group never completes, and
it holds a place in the staleness budget); giving up ends the run. With a key, the group's id, its sessions' ids
and their API keys are derived from the key with HMAC-SHA256 under a secret of the store (created once, kept in
`settings`, never sent out), so a retry that finds the group already there answers with the same ids and keys,
and one that does not creates it. The store keeps only hashes of API keys, so deriving them is what lets a retry
give them back; without the secret nobody can derive them from a key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any, cast

from sqlalchemy import Table, select

from gateway.errors import BadRequest
from gateway.store.db import DbEngine
from gateway.store.models import Setting

SECRET_KEY = "idempotency_secret"
"""The `settings` row holding the store's secret (hex)."""
MAX_KEY_LENGTH = 255
KV = cast(Table, Setting.__table__)


def check_key(key: str) -> str:
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable() or not key.isascii():
        raise BadRequest(f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
                         param="Idempotency-Key")
    return key


def _mac(secret: bytes, *parts: str) -> bytes:
    return hmac.new(secret, "\0".join(parts).encode(), hashlib.sha256).digest()


def derive(secret: bytes, key: str, n_samples: int) -> tuple[str, list[tuple[str, str]]]:
    """(group id, [(session id, API key)]) for an idempotency key: the same for the same key and secret, shaped as
    the random ones (`new_id`: a prefix and 128 bits in hex; an API key of 256 bits, URL-safe base64)."""
    gid = "grp_" + _mac(secret, "group", key)[:16].hex()
    creds = []
    for i in range(n_samples):
        sid = "sess_" + _mac(secret, "session", str(i), key)[:16].hex()
        api_key = "rw-" + base64.urlsafe_b64encode(_mac(secret, "api-key", str(i), key)).rstrip(b"=").decode()
        creds.append((sid, api_key))
    return gid, creds


class Secret:
    """The store's secret, read (or created) on first use and kept. Two gateways on one store creating it at once:
    one insert wins, the other reads the winner's."""

    def __init__(self, engine: DbEngine) -> None:
        self.engine = engine
        self._value: bytes | None = None

    async def get(self, begin: Any) -> bytes:
        if self._value is None:
            stored = await self._read()
            if stored is None:
                try:
                    async with begin() as conn:
                        await conn.execute(KV.insert().values(key=SECRET_KEY, value=secrets.token_hex(32)))
                except Exception:  # another writer's insert won (a unique violation): read it
                    pass
                stored = await self._read()
            if stored is None:
                raise RuntimeError("the store's idempotency secret could not be created")
            self._value = bytes.fromhex(stored)
        return self._value

    async def _read(self) -> str | None:
        async with self.engine.connect() as conn:
            value = (await conn.execute(select(KV.c.value).where(KV.c.key == SECRET_KEY))).scalar()
        return value if isinstance(value, str) else None
