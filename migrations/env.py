"""Alembic environment: runs revisions on the async engine for the configured URL.

Alembic's own INFO lines are turned down by `gateway.store.db` (they repeat at every start of `rollway
serve`); the one line worth keeping, which revision was applied, is logged here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.store.models import Base

config = context.config
target_metadata = Base.metadata
log = logging.getLogger("rollway.store")


def _applied(*, step: Any, **_: Any) -> None:
    """Alembic's on_version_apply hook: one INFO line per revision applied."""
    source = ", ".join(step.source_revision_ids) or "empty"
    target = ", ".join(step.destination_revision_ids) or "empty"
    doc = f" ({step.up_revision.doc})" if step.is_upgrade and step.up_revision is not None else ""
    log.info("store %s: %s -> %s%s", "upgrade" if step.is_upgrade else "downgrade", source, target, doc)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        on_version_apply=_applied,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _online() -> None:
    engine = create_async_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_online())
