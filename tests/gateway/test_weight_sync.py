"""The gateway's side of a publish over process groups (gateway/weight_sync.py) against scripted SGLang fakes: the
calls each server gets and in what order, a server that fails mid-update (out of rotation, never on a mix, no
agent-visible error, brought back by the next publish or a catch-up), a server added later, nobody taking the
weights, and the catch-up (the current version sent again to the servers that lack it, and to them only)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A store per test: each starts at version 0 with its servers on their starting weights."""
    from gateway.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'rollway.db'}"
    upgrade(url)
    return url


BUCKETS = [{"names": [f"w{i}"], "dtypes": ["float32"], "shapes": [[2, 2]]} for i in range(3)]


def publish(gw: LiveGateway, version: int, **init: Any) -> tuple[dict[str, Any], Any]:
    plan = gw.admin.post("/v1/weights/sync/init", json={"version": version, "master_address": "10.0.0.9",
                                                         "backend": "gloo", "timeout_s": 5, **init})
    assert plan.status_code == 200, plan.text
    p = plan.json()
    ports = {g["group_name"]: 40000 + i for i, g in enumerate(p["groups"])}
    return p, gw.admin.post("/v1/weights/sync", json={"sync_id": p["sync_id"], "version": version, "ports": ports,
                                                       "buckets": BUCKETS})


def wait_for(cond: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.1)


def chat(gw: LiveGateway, cred: dict[str, Any]) -> Any:
    return gw.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                   max_tokens=8)


def health(gw: LiveGateway) -> dict[str, dict[str, Any]]:
    return {b["url"]: b for b in gw.admin.get("/v1/backends").json()["data"]}


@pytest.mark.parametrize("session", [True, False], ids=["0.5.21+", "before-0.5.21"])
def test_each_server_gets_its_own_group_and_the_buckets_in_order(tiny_model_dir: Path, sqlite_url: str,
                                                                 session: bool) -> None:
    """SGLang 0.5.21+ takes the buckets only inside a weight-update session (begin ... end); an older server has
    neither route (its /server_info says 0.5.20) and gets the buckets alone."""
    with FakeSGLang(weight_session=session) as a, FakeSGLang(weight_session=session) as b, LiveGateway(
            backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        plan, r = publish(gw, 1)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["version"] == 1 and out["model_path"] == "distributed:v1" and out["failed_backends"] == {}
        assert len({g["group_name"] for g in plan["groups"]}) == 2 and {g["world_size"] for g in plan["groups"]} == {2}
        for fake in (a, b):
            paths = [p for p, _ in fake.calls]
            begin, end = (["/begin_weight_update"], ["/end_weight_update"]) if session else ([], [])
            assert paths == ["/pause_generation", "/update_weight_version", "/init_weights_update_group", *begin,
                             *["/update_weights_from_distributed"] * 3, *end, "/destroy_weights_update_group",
                             "/continue_generation"]
            assert not fake.session_open
            body = dict(fake.calls)
            assert body["/update_weight_version"] == {"new_version": "1-partial", "abort_all_requests": False}
            init = body["/init_weights_update_group"]
            assert (init["master_address"], init["rank_offset"], init["world_size"], init["backend"]) == \
                ("10.0.0.9", 1, 2, "gloo")
            updates = [c for p, c in fake.calls if p == "/update_weights_from_distributed"]
            assert [u["names"] for u in updates] == [["w0"], ["w1"], ["w2"]]
            assert [u.get("weight_version") for u in updates] == [None, None, "1"]  # named on the last bucket only
            assert {u["group_name"] for u in updates} == {init["group_name"]} and not fake.groups
            assert fake.weight_version == "1"
        assert gw.admin.get("/v1/weights").json() == {"version": 1, "model_path": "distributed:v1"}
        cred = gw.group(2)["sessions"][0]
        chat(gw, cred)
        assert set(gw.session(cred["session_id"])["turns"][0]["versions"]) == {1}
        # Not the planned version, or no pending plan: refused before any server is touched.
        assert gw.admin.post("/v1/weights/sync", json={"sync_id": "nope", "version": 2, "buckets": BUCKETS}
                             ).status_code == 409
        assert gw.admin.post("/v1/weights/sync/init", json={"version": 1, "master_address": "x"}).status_code == 409


def test_a_server_failing_mid_update_leaves_rotation_until_a_later_publish(tiny_model_dir: Path,
                                                                            sqlite_url: str) -> None:
    with FakeSGLang(token_delay=0.003) as a, FakeSGLang(token_delay=0.003) as b, LiveGateway(
        backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url
    ) as gw:
        creds = [c for _ in range(3) for c in gw.group(4)["sessions"]]
        errors: list[Exception] = []
        stop = threading.Event()

        def agent(cred: dict[str, Any]) -> None:
            while not stop.is_set():
                try:
                    chat(gw, cred)
                except Exception as e:  # reported by the assertion below
                    errors.append(e)

        threads = [threading.Thread(target=agent, args=(c,)) for c in creds]
        for t in threads:
            t.start()
        time.sleep(0.5)
        b.fail_sync_at = 1  # the second bucket breaks on b
        _, r = publish(gw, 1)
        assert r.status_code == 200, r.text
        out = r.json()
        bid = next(x["id"] for x in health(gw).values() if x["url"] == b.url)
        assert list(out["failed_backends"]) == [bid] and out["backends"] != [bid]
        assert a.weight_version == "1" and b.weight_version == "1-partial"  # never claims a version it lacks
        b_calls = [p for p, _ in b.calls]
        assert "/abort_request" in b_calls and b_calls[-1] == "/continue_generation"
        time.sleep(1.5)  # three health rounds: b answers /health but is not taken back with a mix
        assert health(gw)[b.url]["healthy"] is False and health(gw)[a.url]["healthy"] is True
        n_b = len(b.requests)
        time.sleep(0.5)
        assert len(b.requests) == n_b  # no traffic to it
        b.fail_sync_at = None
        _, r = publish(gw, 2)  # it takes part, gets every bucket, and is back
        assert r.status_code == 200 and r.json()["failed_backends"] == {}, r.text
        assert a.weight_version == b.weight_version == "2" and health(gw)[b.url]["healthy"] is True
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(60)
        assert errors == []
        versions = {v for c in creds for turn in gw.session(c["session_id"])["turns"] for v in turn["versions"]}
        assert versions <= {0, 1, 2} and 2 in versions


def test_nobody_taking_it_publishes_nothing_and_the_next_one_does(tiny_model_dir: Path, sqlite_url: str) -> None:
    with FakeSGLang() as a, LiveGateway(backends=[a.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        a.fail_sync_at = 0
        _, r = publish(gw, 1)
        assert r.status_code == 503
        assert gw.admin.get("/v1/weights").json()["version"] == 0 and a.weight_version == "1-partial"
        time.sleep(1.5)
        assert health(gw)[a.url]["healthy"] is False  # its version "1-partial" is not the current 0
        a.fail_sync_at = None
        _, r = publish(gw, 1)
        assert r.status_code == 200, r.text
        assert a.weight_version == "1" and health(gw)[a.url]["healthy"] is True


def test_a_server_added_later_waits_for_the_next_publish(tiny_model_dir: Path, sqlite_url: str) -> None:
    with FakeSGLang() as a, FakeSGLang() as c, LiveGateway(backends=[a.url], tokenizer=str(tiny_model_dir),
                                                          db=sqlite_url) as gw:
        assert publish(gw, 1)[1].status_code == 200
        r = gw.admin.post("/v1/backends", json={"url": c.url})
        assert r.status_code == 201, r.text
        assert r.json()["healthy"] is False and "next catch-up or publish" in r.json()["last_error"]
        assert not [p for p, _ in c.calls if p == "/update_weights_from_disk"]  # no folder to load
        for cred in gw.group(4)["sessions"]:
            chat(gw, cred)
        assert not c.requests
        plan, r = publish(gw, 2)
        assert r.status_code == 200 and len(plan["groups"]) == 2
        assert c.weight_version == "2" and health(gw)[c.url]["healthy"] is True


def catch_up(gw: LiveGateway, version: int, **sync: Any) -> tuple[dict[str, Any], Any]:
    plan = gw.admin.post("/v1/weights/sync/init", json={"version": version, "master_address": "10.0.0.9",
                                                         "backend": "gloo", "timeout_s": 5, "catch_up": True})
    if plan.status_code != 200 or not plan.json()["groups"]:
        return plan.json(), plan
    p = plan.json()
    ports = {g["group_name"]: 41000 + i for i, g in enumerate(p["groups"])}
    return p, gw.admin.post("/v1/weights/sync", json={"sync_id": p["sync_id"], "version": version, "ports": ports,
                                                       "buckets": BUCKETS, **sync})


def test_a_catch_up_brings_a_server_added_later_to_the_current_version_alone(tiny_model_dir: Path,
                                                                              sqlite_url: str) -> None:
    with FakeSGLang() as a, FakeSGLang() as c, LiveGateway(backends=[a.url], tokenizer=str(tiny_model_dir),
                                                          db=sqlite_url) as gw:
        # Before any publish over process groups there is nothing to catch up to.
        assert gw.admin.get("/v1/weights/sync").json() == {"version": 0, "awaiting_backends": [], "sync": None}
        assert catch_up(gw, 0)[1].status_code == 400  # versions start at 1
        assert publish(gw, 1)[1].status_code == 200
        assert catch_up(gw, 1)[0] == {"sync_id": None, "version": 1, "catch_up": True, "groups": []}  # none lacks it
        r = gw.admin.post("/v1/backends", json={"url": c.url})
        assert r.status_code == 201 and r.json()["healthy"] is False, r.text
        c_id = r.json()["id"]
        assert gw.admin.get("/v1/weights/sync").json()["awaiting_backends"] == [c_id]
        # Only the current version, and no batches acked with it.
        assert catch_up(gw, 2)[1].status_code == 409
        assert catch_up(gw, 1, batch_ids=["b1"])[1].status_code == 400
        assert gw.admin.get("/v1/weights/sync").json()["sync"] is None  # the refused one let the lock go
        calls_a = len(a.calls)
        plan, r = catch_up(gw, 1)
        assert r.status_code == 200, r.text
        assert [g["backend_id"] for g in plan["groups"]] == [c_id] and plan["catch_up"] is True
        out = r.json()
        assert out["catch_up"] is True and out["backends"] == [c_id] and out["failed_backends"] == {}
        assert len(a.calls) == calls_a  # the server in rotation was not paused or touched
        updates = [b for p, b in c.calls if p == "/update_weights_from_distributed"]
        assert [u.get("weight_version") for u in updates] == [None, None, "1"]
        assert c.weight_version == "1" and health(gw)[c.url]["healthy"] is True
        assert gw.admin.get("/v1/weights").json() == {"version": 1, "model_path": "distributed:v1"}  # no new version
        assert gw.admin.get("/v1/weights/sync").json()["awaiting_backends"] == []


def test_a_server_failing_mid_update_is_caught_up_without_a_new_version(tiny_model_dir: Path, sqlite_url: str) -> None:
    with FakeSGLang() as a, FakeSGLang() as b, LiveGateway(backends=[a.url, b.url], tokenizer=str(tiny_model_dir),
                                                          db=sqlite_url) as gw:
        b.fail_sync_at = 1
        _, r = publish(gw, 1)
        assert r.status_code == 200 and b.weight_version == "1-partial", r.text
        bid = next(iter(r.json()["failed_backends"]))
        listed = lambda: gw.admin.get("/v1/weights/sync").json()["awaiting_backends"]  # noqa: E731
        wait_for(lambda: listed() == [bid], "b listed once it answers a health probe")
        # A catch-up that fails again leaves it out, listed again at its next health probe, and the gateway free.
        _, r = catch_up(gw, 1)
        assert r.status_code == 200 and list(r.json()["failed_backends"]) == [bid], r.text
        assert health(gw)[b.url]["healthy"] is False and b.weight_version == "1-partial"
        wait_for(lambda: listed() == [bid], "b listed again")
        b.fail_sync_at = None
        _, r = catch_up(gw, 1)
        assert r.status_code == 200 and r.json()["backends"] == [bid], r.text
        assert b.weight_version == "1" and health(gw)[b.url]["healthy"] is True
        assert gw.admin.get("/v1/weights").json()["version"] == 1


def test_a_session_left_open_is_ended_and_begun_again(tiny_model_dir: Path, sqlite_url: str) -> None:
    """A publisher that died mid-session left the server's weight-update session open: begin answers "already
    open", the gateway ends it and begins once more; a failed update closes its session too."""
    with FakeSGLang() as a, LiveGateway(backends=[a.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        a.session_open = True
        _, r = publish(gw, 1)
        assert r.status_code == 200 and r.json()["failed_backends"] == {}, r.text
        paths = [p for p, _ in a.calls]
        assert paths[3:7] == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update",
                              "/update_weights_from_distributed"], paths
        assert a.weight_version == "1" and not a.session_open
        a.calls.clear()
        a.fail_sync_at = a.buckets_received + 1  # the second bucket of the next publish breaks
        _, r = publish(gw, 2)
        assert r.status_code == 503, r.text  # nobody took it
        paths = [p for p, _ in a.calls]
        assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") == 1 and not a.session_open


def test_requests_parked_during_a_failed_sync_are_never_served_from_the_mix(tiny_model_dir: Path,
                                                                           sqlite_url: str) -> None:
    """Requests that reach a server while it is paused wait in SGLang's tokenizer manager, where `abort_all` (it
    goes to the scheduler) does not reach them: after a sync that failed on that server they run on a half-updated
    model, which reports "<v>-partial". Their tokens are discarded and the replies finish on a server that took
    the version; nothing is recorded at the parsed version 0."""
    with FakeSGLang(token_delay=0.002) as a, FakeSGLang(token_delay=0.002, load_delay=1.5) as b, LiveGateway(
        backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url
    ) as gw:
        b.fail_sync_at = 2  # b breaks on the third bucket, after ~3 s paused
        creds = [gw.group(1)["sessions"][0] for _ in range(8)]  # one per group: the least-loaded spreads them
        out: dict[str, Any] = {}
        errors: list[Exception] = []

        def agent(cred: dict[str, Any]) -> None:
            try:
                out[cred["session_id"]] = chat(gw, cred)
            except Exception as e:  # reported by the assertion below
                errors.append(e)

        chat(gw, gw.group(1)["sessions"][0])  # warm: a first call in a fresh gateway takes seconds here
        result: list[Any] = []
        sync = threading.Thread(target=lambda: result.append(publish(gw, 1)[1]))
        sync.start()
        wait_for(lambda: a.paused is not None and b.paused is not None, "the publish never paused both")
        threads = [threading.Thread(target=agent, args=(c,)) for c in creds]
        for t in threads:
            t.start()
        wait_for(lambda: len(b._parked) > 0, "no request reached b while it was paused")
        sync.join(30)
        for t in threads:
            t.join(60)
        assert result and result[0].status_code == 200, result
        assert b.weight_version == "1-partial" and a.weight_version == "1"
        assert errors == []
        b_id = next(x["id"] for x in health(gw).values() if x["url"] == b.url)
        for cred in creds:
            turn = gw.session(cred["session_id"])["turns"][0]
            assert set(turn["versions"]) == {1}, turn["versions"]  # every token from a whole version 1
        assert health(gw)[b.url]["healthy"] is False, b_id


def test_the_session_routes_are_found_by_version_or_by_a_404() -> None:
    """`/server_info`'s version says whether a server has the weight-update session (0.5.21+); a server that reports
    no usable version but lacks the routes answers begin with a 404, and is then updated without one."""
    import asyncio

    import aiohttp

    from gateway.sglang import SGLangClient, has_weight_session

    assert [has_weight_session(v) for v in ("0.5.20", "0.5.21", "0.5.23+rollway", "0.6.0", "0.4.10-fake", "dev")] \
        == [False, True, True, True, False, True]

    async def run(fake: FakeSGLang, known: bool | None) -> tuple[bool, bool | None]:
        async with aiohttp.ClientSession() as http:
            client = SGLangClient(http, fake.url)
            client.weight_session = known
            opened = await client.weight_session_open(5.0)
            client.close()
            return opened, client.weight_session

    with FakeSGLang(weight_session=False) as old, FakeSGLang() as new:
        assert asyncio.run(run(old, None)) == (False, False)  # by its version, 0.5.20: begin never sent
        assert "/begin_weight_update" not in [p for p, _ in old.calls]
        assert asyncio.run(run(old, True)) == (False, False)  # told otherwise: the 404 on begin decides
        assert asyncio.run(run(new, None)) == (True, True) and new.session_open


def test_a_release_a_server_cannot_do_leaves_it_generating(tiny_model_dir: Path, sqlite_url: str) -> None:
    """A server without the memory routes (here: a fake that has none) answers the release with an error after the
    gateway paused it: the gateway continues it, so generation goes on, and names it among the failed."""
    with FakeSGLang() as fake, LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        r = gw.admin.post("/v1/weights/memory/release", json={"tags": ["kv_cache"]})
        assert r.status_code == 200, r.text
        assert list(r.json()["failed_backends"]) != [] and r.json()["backends"] == []
        assert fake.paused is None  # continued after the failed release
        assert [p for p, _ in fake.calls if p in ("/pause_generation", "/continue_generation")] == [
            "/pause_generation", "/continue_generation"]
