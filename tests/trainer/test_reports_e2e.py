"""`rollway train` (torchrun, a subprocess) against a live gateway: every step's report lands in the store, and
each trained session's reported version is the version its group was trained in (the gateway's own record)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.store.db import create_engine
from gateway.store.store import Store
from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway

pytestmark = pytest.mark.slow


def read(url: str, fn: Any) -> Any:
    async def run() -> Any:
        store = Store(create_engine(url))
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


@pytest.mark.timeout(600)
def test_rollway_train_reports_every_step(tiny_model_dir: Path, sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with FakeSGLang() as fake, LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        groups = []
        for i in range(4):
            g = gw.group(2, task={"i": i})
            for j, cred in enumerate(g["sessions"]):
                gw.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}"}],
                                                        max_tokens=4)
                gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": float(j), "finish": True})
            groups.append(g)
        log = tmp_path / "train.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollway.cli", "train", "--gateway", gw.url, "--model", str(tiny_model_dir),
                 "--out", str(out), "--nproc", "1", "--groups-per-step", "2", "--steps", "2", "--lr", "1e-4",
                 "--wait-seconds", "2", "--max-head-offpolicyness", "100"],  # the groups are all made at v0
                env={**os.environ, "ROLLWAY_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=f,
                start_new_session=True)
            try:
                rc = proc.wait(500)  # torchrun, imports, two model loads: minutes on a loaded machine
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                raise AssertionError(f"rollway train did not end: {log.read_text()[-3000:]}") from None
        text = log.read_text()
        assert rc == 0, text[-3000:]
        assert "reporting it to the gateway failed" not in text
        info = {g["group_id"]: gw.admin.get(f"/v1/groups/{g['group_id']}").json() for g in groups}
    steps = read(sqlite_url, lambda s: s.training_steps())
    assert [(s["step"], s["version"]) for s in steps] == [(1, 1), (2, 2)]
    assert all(s["metrics"]["groups_accepted"] == 2 and s["metrics"]["loss_tokens"] > 0 for s in steps)
    sessions = [s["session_id"] for g in groups for s in g["sessions"]]
    adv = read(sqlite_url, lambda s: s.session_advantages(sessions))
    assert set(adv) == set(sessions)  # every session of the four trained groups
    for gid, g in info.items():
        assert g["state"] == "trained"
        for s in g["sessions"]:  # GET /v1/groups/{id}: each session as {"id", "reward", ...}
            assert adv[s["id"]]["version"] == g["trained_version"]
            assert adv[s["id"]]["group_id"] == gid
            # rewards 0 and 1, no std division: advantages -0.5 and +0.5
            assert adv[s["id"]]["advantage"] == pytest.approx(s["reward"] - 0.5)
