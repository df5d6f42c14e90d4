"""Kill -9 the trainer mid-run and start it again, against a live gateway: it resumes at its checkpointed
version, no group is lost, and each group is trained in exactly one published version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway

pytestmark = pytest.mark.slow
N_GROUPS = 8


def make_groups(gw: LiveGateway) -> list[str]:
    ids = []
    for i in range(N_GROUPS):
        g = gw.group(4, task={"i": i})
        for j, cred in enumerate(g["sessions"]):
            gw.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}"}],
                                                    max_tokens=4)
            gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": float(j % 2)})
            gw.admin.post(f"/v1/sessions/{cred['session_id']}/finish")
        ids.append(g["group_id"])
    return ids


def train(gw: LiveGateway, model: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "train", "--gateway", gw.url, "--model", str(model), "--out", str(out),
         "--nproc", "1", "--groups-per-step", "2", "--lr", "1e-4", "--wait-seconds", "1", "--lease-seconds", "4",
         "--max-head-offpolicyness", "100"],
        env={**os.environ, "ROLLWAY_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=open(out.parent / f"{out.name}.log", "ab"), start_new_session=True,
    )


def steps(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_trainer_kill_9_and_resume(tiny_model_dir: Path, sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with FakeSGLang() as fake, LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        groups = make_groups(gw)
        proc = train(gw, tiny_model_dir, out)
        try:
            wait(lambda: len(steps(out)) >= 2, 240, "two trainer steps")
            os.killpg(proc.pid, signal.SIGKILL)  # mid-run, whatever it is doing
            proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        v_killed = gw.admin.get("/v1/weights").json()["version"]
        assert v_killed >= 2
        proc = train(gw, tiny_model_dir, out)
        try:
            def all_done() -> bool:
                states = [gw.admin.get(f"/v1/groups/{g}").json()["state"] for g in groups]
                return all(s in ("trained", "dropped") for s in states)

            wait(all_done, 300, "every group trained")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        info = [gw.admin.get(f"/v1/groups/{g}").json() for g in groups]
        assert all(g["state"] == "trained" for g in info), [(g["state"], g["drop_reason"]) for g in info]
        # Each group went into exactly one published version, two groups per step, and the restarted
        # trainer numbered its versions on from the checkpoint/gateway (no version reused).
        per_version: dict[int, int] = {}
        for g in info:
            per_version[g["trained_version"]] = per_version.get(g["trained_version"], 0) + 1
        assert sorted(per_version) == list(range(1, N_GROUPS // 2 + 1))
        assert set(per_version.values()) == {2}
        assert gw.admin.get("/v1/weights").json()["version"] == N_GROUPS // 2
        # The restarted trainer went on from its checkpoint: no step or version number repeats.
        rows = steps(out)
        assert [r["version"] for r in rows] == sorted({r["version"] for r in rows})
        assert [r["step"] for r in rows] == [r["version"] for r in rows]
