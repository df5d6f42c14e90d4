"""POST /v1/training/steps over real HTTP, on SQLite and PostgreSQL: what is stored and read back by the viewer's
store functions, a retried report replacing the earlier one, bad reports refused with clear 400s, and who may
send one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.store.db import create_engine
from gateway.store.store import Store
from tests.harness import LiveGateway


def read(url: str, fn: Any) -> Any:
    async def run() -> Any:
        store = Store(create_engine(url))
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def report(version: int, step: int | None = None, **kw: Any) -> dict[str, Any]:
    return {"step": version if step is None else step, "version": version, "time": 1_700_000_000.0 + version,
            "metrics": {"loss": 0.1 * version, "kl": 0.0, "entropy": 2.5, "tokens": 1000 * version}, **kw}


def test_reports_are_stored_and_read_by_version(gateway: LiveGateway, db_url: str) -> None:
    for v in (1, 2, 3):
        samples = [{"session_id": f"sess_a{v}", "group_id": "grp_1", "advantage": 0.5, "reward": 1.0,
                    "loss_tokens": 12},
                   {"session_id": "sess_b", "group_id": "grp_1", "advantage": -0.25 * v, "reward": None,
                    "sequences": 2, "loss_tokens": 30}]
        r = gateway.admin.post("/v1/training/steps", json=report(v, samples=samples))
        assert r.status_code == 200 and r.json() == {"step": v, "version": v, "samples": 2}, r.text
    steps = read(db_url, lambda s: s.training_steps())
    assert [(s["version"], s["step"], s["created_at"]) for s in steps] == [(v, v, 1_700_000_000.0 + v) for v in (1, 2, 3)]
    assert steps[1]["metrics"] == {"loss": pytest.approx(0.2), "kl": 0.0, "entropy": 2.5, "tokens": 2000}
    assert [s["version"] for s in read(db_url, lambda s: s.training_steps(after_version=1, limit=1))] == [2]
    assert read(db_url, lambda s: s.latest_training_step())["version"] == 3
    adv = read(db_url, lambda s: s.session_advantages(["sess_b", "sess_a1", "sess_never"]))
    assert set(adv) == {"sess_b", "sess_a1"}
    # sess_b was trained in versions 1, 2 and 3: the latest counts
    assert adv["sess_b"] == {"version": 3, "group_id": "grp_1", "step": 3, "advantage": -0.75, "reward": None,
                             "sequences": 2, "loss_tokens": 30}
    assert len(read(db_url, lambda s: s.group_advantages("grp_1"))) == 4  # sess_a1..a3, sess_b
    many = read(db_url, lambda s: s.session_advantages([f"sess_x{i}" for i in range(1200)] + ["sess_a2"]))
    assert list(many) == ["sess_a2"]  # more ids than one IN (...) takes: asked in chunks


def test_a_retried_report_replaces_the_first(gateway: LiveGateway, db_url: str) -> None:
    first = [{"session_id": "sess_r1", "group_id": "grp_r", "advantage": 1.0}]
    again = [{"session_id": "sess_r2", "group_id": "grp_r", "advantage": -1.0}]
    assert gateway.admin.post("/v1/training/steps", json=report(50, samples=first)).status_code == 200
    assert gateway.admin.post("/v1/training/steps", json=report(50, step=9, samples=again)).status_code == 200
    (step,) = read(db_url, lambda s: s.training_steps(after_version=49, limit=1))
    assert step["step"] == 9
    assert set(read(db_url, lambda s: s.group_advantages("grp_r"))) == {"sess_r2"}


@pytest.mark.parametrize(("body", "param"), [
    ({"version": 1}, "step"),
    ({"step": 1, "version": -1}, "version"),
    ({"step": "1", "version": 1}, "step"),
    ({"step": 1, "version": 2**31}, "version"),
    ({"step": 1, "version": 1, "metrics": {"loss": "high"}}, "metrics.loss"),
    ({"step": 1, "version": 1, "metrics": {"": 1.0}}, "metrics"),
    ({"step": 1, "version": 1, "metrics": {f"m{i}": 1 for i in range(300)}}, "metrics"),
    ({"step": 1, "version": 1, "samples": [{"session_id": "s", "group_id": "g"}]}, "samples.0.advantage"),
    ({"step": 1, "version": 1, "samples": [{"session_id": "s", "group_id": "g", "advantage": 1.0}] * 2}, "samples"),
    ({"step": 1, "version": 1, "samples": [{"session_id": "s" * 65, "group_id": "g", "advantage": 1.0}]},
     "samples.0.session_id"),
    ({"step": 1, "version": 1, "extra": True}, "extra"),
])
def test_bad_reports_are_clear_400s(gateway: LiveGateway, body: dict[str, Any], param: str) -> None:
    r = gateway.admin.post("/v1/training/steps", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_non_finite_numbers_are_refused(gateway: LiveGateway) -> None:
    r = gateway.admin.post("/v1/training/steps", content=b'{"step": 1, "version": 1, "metrics": {"loss": NaN}}')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_only_the_admin_reports(gateway: LiveGateway) -> None:
    session = gateway.group(2)["sessions"][0]
    viewer = gateway.admin.post("/v1/viewer_keys", json={"name": "v"}).json()["key"]
    for key, status in ((session["api_key"], 403), (viewer, 403), ("rw-nobody", 401)):
        r = gateway.admin.post("/v1/training/steps", json=report(1), headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status, r.text



def test_migration_0003_builds_the_models_tables(db_url: str) -> None:
    """Alembic finds nothing to change between the migrated store and the models, for this revision's tables."""
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from gateway.store.models import Base

    ours = ("viewer_keys", "ui_sessions", "training_steps", "trained_samples")

    def compare(conn: Any) -> tuple[list[Any], list[str]]:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata), sa.inspect(conn).get_table_names()

    async def run() -> tuple[list[Any], list[str]]:
        engine = create_engine(db_url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(compare)  # type: ignore[no-any-return]
        finally:
            await engine.dispose()

    diff, tables = asyncio.run(run())
    assert set(ours) <= set(tables)
    assert [d for d in diff if any(f"'{name}'" in repr(d) or f"Table('{name}'" in repr(d) for name in ours)] == []
