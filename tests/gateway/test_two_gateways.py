"""Two gateway processes on one PostgreSQL: sessions spread across both (a session's turns too), a
trainer leasing from either; no group lost or duplicated, and chains stay whole across processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.embedded import free_port, stop, wait_healthy
from tests.conftest import _fresh_db
from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _fresh_db("postgres", tmp_path_factory.mktemp("pg"))


@pytest.fixture(scope="module")
def gateways(pg_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    env = {**os.environ, "ROLLWAY_ADMIN_KEY": ADMIN_KEY, "ROLLWAY_HEALTH_INTERVAL_S": "0.5"}
    with FakeSGLang() as fake:
        procs, urls = [], []
        try:
            for _ in range(2):
                port = free_port()
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "rollway.cli", "serve", "--backend", fake.url, "--tokenizer",
                     str(tiny_model_dir), "--db", pg_url, "--port", str(port),
                     "--data-dir", str(tmp_path_factory.mktemp("data"))],
                    env=env, stdout=subprocess.DEVNULL,
                ))
                urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(urls, procs, strict=True):
                wait_healthy(url, proc, timeout=60)
            yield urls
        finally:
            for proc in procs:
                stop(proc)


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)


def chat(url: str, cred: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {cred['api_key']}"},
                   json={"model": "m", "messages": messages, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_two_gateways_share_sessions_and_leases(gateways: list[str], tmp_path: Path) -> None:
    a, b = (admin(u) for u in gateways)
    groups = []
    for i in range(6):
        r = (a if i % 2 else b).post("/v1/groups", json={"task": {"i": i}, "n_samples": 2})
        assert r.status_code == 201
        groups.append(r.json())
    for i, g in enumerate(groups):
        for j, cred in enumerate(g["sessions"]):
            first, second = gateways[(i + j) % 2], gateways[(i + j + 1) % 2]
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"task {i}"}]
            r1 = chat(first, cred, msgs)
            msgs += [r1["choices"][0]["message"], {"role": "user", "content": "more"}]
            chat(second, cred, msgs)  # the other process must see turn 1 and extend it
            sid = cred["session_id"]
            assert (b if j else a).post(f"/v1/sessions/{sid}/reward", json={"reward": float(j)}).status_code == 200
            assert (a if j else b).post(f"/v1/sessions/{sid}/finish").status_code == 200
            turns = a.get(f"/v1/sessions/{sid}").json()["turns"]
            assert [t["continuity"] for t in turns] == ["new-chain", "extends"]
    # A trainer leases from either gateway: disjoint batches, every group exactly once.
    l1 = a.post("/v1/batches", json={"max_groups": 3}).json()
    l2 = b.post("/v1/batches", json={"max_groups": 10}).json()
    ids1 = {g["group_id"] for g in l1["groups"]}
    ids2 = {g["group_id"] for g in l2["groups"]}
    assert len(ids1) == 3 and len(ids2) == 3 and not ids1 & ids2
    assert ids1 | ids2 == {g["group_id"] for g in groups}
    # Publish through one gateway, acking batches leased through both.
    v = a.get("/v1/weights").json()["version"] + 1
    r = b.post("/v1/weights", json={"version": v, "model_path": str(tmp_path),
                                    "batch_ids": [l1["batch_id"], l2["batch_id"]]})
    assert r.status_code == 200, r.text
    assert a.get("/v1/weights").json()["version"] == v
    assert all(a.get(f"/v1/groups/{g['group_id']}").json()["state"] == "trained" for g in groups)
    assert b.post("/v1/batches", json={"max_groups": 10}).json()["groups"] == []


def _wait(condition: Any, what: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_backend_added_through_one_gateway_gets_a_publish_through_the_other(gateways: list[str],
                                                                              tmp_path: Path) -> None:
    """The registry is the store's: B sees a backend added through A, so B's publish reaches it (it once kept
    serving the old weights); and a backend removed through A leaves B too."""
    a, b = (admin(u) for u in gateways)
    with FakeSGLang() as c:
        assert a.post("/v1/backends", json={"url": c.url}).status_code == 201
        v = a.get("/v1/weights").json()["version"] + 1
        assert b.post("/v1/weights", json={"version": v, "model_path": str(tmp_path)}).status_code == 200
        _wait(lambda: c.weight_version == str(v), f"the new backend never loaded version {v}")
        assert ("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": str(v)}) in [
            (p, {k: body.get(k) for k in ("model_path", "weight_version")}) for p, body in c.calls]
        _wait(lambda: any(x["url"] == c.url and x["healthy"] for x in b.get("/v1/backends").json()["data"]),
              "gateway B never put the new backend in rotation")
        c_on_a = next(x["id"] for x in a.get("/v1/backends").json()["data"] if x["url"] == c.url)
        assert a.delete(f"/v1/backends/{c_on_a}").status_code == 200
        _wait(lambda: all(x["url"] != c.url for x in b.get("/v1/backends").json()["data"]),
              "gateway B kept a backend removed through A")
