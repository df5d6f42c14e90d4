"""Two gateway processes on one PostgreSQL: sessions spread across both (a session's turns too), a
trainer leasing from either; no group lost or duplicated, and chains stay whole across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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
    """A follows the store's backend registry (and probes its backends) every 0.5 s; B only every minute, so
    what B knows of a change made through A within a test, it learnt when it needed it (a publish)."""
    with FakeSGLang() as fake:
        procs, urls = [], []
        try:
            for interval in ("0.5", "60"):
                port = free_port()
                env = {**os.environ, "ROLLWAY_ADMIN_KEY": ADMIN_KEY, "ROLLWAY_HEALTH_INTERVAL_S": interval}
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


def _wait(condition: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def listed(gw: httpx.Client) -> dict[str, dict[str, Any]]:
    """The gateway's backends by URL."""
    return {x["url"]: x for x in gw.get("/v1/backends").json()["data"]}


@pytest.fixture
def registry_cleaned(gateways: list[str]) -> Iterator[list[str]]:
    """Backends a test added (and may have left on a failure) are removed, so the next test starts clean."""
    yield gateways
    for gw in (admin(u) for u in gateways):
        for x in gw.get("/v1/backends").json()["data"][1:]:  # the first is the command line's shared fake
            gw.delete(f"/v1/backends/{x['id']}")


def test_a_backend_added_through_one_gateway_gets_a_publish_through_the_other(registry_cleaned: list[str],
                                                                              tmp_path: Path) -> None:
    """B reads the registry when it publishes: a backend added through A is paused and loaded by B's publish
    itself (it once kept serving the old weights, B reading the registry only at start), under the id A gave
    it; one removed through A gets nothing of B's next publish and leaves B's pool."""
    a, b = (admin(u) for u in registry_cleaned)
    with FakeSGLang() as c:
        r = a.post("/v1/backends", json={"url": c.url})
        assert r.status_code == 201, r.text
        c_id = r.json()["id"]
        v = a.get("/v1/weights").json()["version"] + 1
        seen = len(c.calls)
        assert b.post("/v1/weights", json={"version": v, "model_path": str(tmp_path)}).status_code == 200
        assert c.weight_version == str(v)  # when the publish answers, not at some later health round
        paths = [p for p, _ in c.calls[seen:]]
        assert paths.count("/pause_generation") == 1 and paths[-1] == "/continue_generation", paths
        assert ("/update_weights_from_disk", str(v)) in [(p, body.get("weight_version")) for p, body in c.calls[seen:]]
        on_b = listed(b)[c.url]
        assert on_b["id"] == c_id and on_b["healthy"] and on_b["weight_version"] == str(v)

        assert a.delete(f"/v1/backends/{c_id}").status_code == 200
        seen = len(c.calls)
        assert b.post("/v1/weights", json={"version": v + 1, "model_path": str(tmp_path)}).status_code == 200
        assert c.calls[seen:] == [] and c.weight_version == str(v)
        assert c.url not in listed(b)


def test_every_gateway_follows_the_registry_between_publishes(registry_cleaned: list[str]) -> None:
    """A reads the registry on its interval: a backend added through B joins A (under B's id, brought up and
    put in rotation) and leaves it when removed through B; and an id any gateway answered can be removed
    through any other, even one that has not read the registry since (a load balancer picks the gateway)."""
    a, b = (admin(u) for u in registry_cleaned)
    with FakeSGLang() as d, FakeSGLang() as e:
        r = b.post("/v1/backends", json={"url": d.url})
        assert r.status_code == 201, r.text
        d_id = r.json()["id"]
        _wait(lambda: d.url in listed(a) and listed(a)[d.url]["healthy"], "A never took in a backend added through B")
        assert listed(a)[d.url]["id"] == d_id
        assert b.delete(f"/v1/backends/{d_id}").status_code == 200
        _wait(lambda: d.url not in listed(a), "A kept a backend removed through B")

        r = a.post("/v1/backends", json={"url": e.url})
        assert r.status_code == 201, r.text
        assert e.url not in listed(b)  # B's next read is a minute away
        assert b.delete(f"/v1/backends/{r.json()['id']}").status_code == 200, "B refused an id A answered"
        _wait(lambda: e.url not in listed(a), "A kept a backend removed through B")
        assert b.delete(f"/v1/backends/{r.json()['id']}").status_code == 404


def test_a_backend_being_added_is_not_dropped_by_the_registry_read(registry_cleaned: list[str],
                                                                   tmp_path: Path) -> None:
    """While POST /v1/backends loads the current weights into a new server (here 2 s, four of A's registry
    reads), the server is in A's pool but not yet in the store: A's reads must leave it there (they once
    dropped it, and the id the POST answered named nothing)."""
    a, _ = (admin(u) for u in registry_cleaned)
    v = a.get("/v1/weights").json()["version"] + 1
    assert a.post("/v1/weights", json={"version": v, "model_path": str(tmp_path)}).status_code == 200
    with FakeSGLang(load_delay=2.0) as c:
        r = a.post("/v1/backends", json={"url": c.url})
        assert r.status_code == 201, r.text
        assert c.weight_version == str(v)
        assert listed(a)[c.url]["id"] == r.json()["id"] and listed(a)[c.url]["healthy"]
        assert a.delete(f"/v1/backends/{r.json()['id']}").status_code == 200
