"""Liveness during a long publish, against fakes whose /health behaves as SGLang 0.5.23's: a one-token generation
that waits out a pause or a weight load for SGLANG_HEALTH_CHECK_TIMEOUT, then answers 503 and marks the server
unhealthy (`/ping` and `/ready` then answer 503 too). The gateway probes such a server with `/ping` while it has
it paused (`SGLangClient.probe`), so a publish longer than that timeout takes nobody out of rotation, and a
backend that dies during it still leaves rotation within `LEAVE_BOUND_S`.

The fakes' /health waits SGLang's 20 s; the gateway's probe gives up after 5 s, so the old probe (/health on a
paused server) missed every round and took both backends out 3 rounds (~16 s here) into a publish, for good. The
publish lasts `ROLLWAY_LIVENESS_PUBLISH_S` seconds (default 20, past that point); the issue's case is 40 s:

    ROLLWAY_LIVENESS_PUBLISH_S=40 pytest -s tests/gateway/test_liveness.py
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway

PUBLISH_S = float(os.environ.get("ROLLWAY_LIVENESS_PUBLISH_S", "20"))
HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
INTERVAL_S = 0.5
LEAVE_BOUND_S = 3 * INTERVAL_S + 5.0 + 1.0
"""health_misses (3) rounds of health_interval_s, plus one probe's timeout (5 s: a host that does not answer),
plus a second of slack for this busy machine. With the defaults (5 s, 3 misses): 15 s, 20 s for a silent host."""


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    from gateway.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'rollway.db'}"
    upgrade(url)
    return url


def _backends(gw: LiveGateway) -> dict[str, dict[str, Any]]:
    return {b["url"]: b for b in gw.admin.get("/v1/backends").json()["data"]}


class Agents:
    """Agents calling chat completions in a loop until stopped (a 120 s client timeout, no retries)."""

    def __init__(self, gw: LiveGateway, n: int) -> None:
        self.gw, self.ok, self.errors = gw, 0, []  # type: ignore[var-annotated]
        self.creds = [gw.group(1)["sessions"][0] for _ in range(n)]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(c,)) for c in self.creds]

    def _run(self, cred: dict[str, Any]) -> None:
        client = self.gw.openai(cred, timeout=120)
        while not self.stop.is_set():
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=8)
                self.ok += 1
            except Exception as e:  # an agent-visible error: what the tests count
                self.errors.append(f"{type(e).__name__}: {e}"[:200])

    def __enter__(self) -> Agents:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def _publish(gw: LiveGateway, version: int, path: Path, out: list[Any]) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        r = gw.admin.post("/v1/weights", json={"version": version, "model_path": str(path)}, timeout=PUBLISH_S + 120)
        out.append((r, time.monotonic() - t0))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_publish_longer_than_the_health_timeout_keeps_every_backend(tiny_model_dir: Path, sqlite_url: str,
                                                                       tmp_path: Path) -> None:
    fakes = [FakeSGLang(token_delay=0.002, load_delay=PUBLISH_S, health_check_timeout=HEALTH_TIMEOUT_S)
             for _ in range(2)]
    with fakes[0], fakes[1], LiveGateway(backends=[f.url for f in fakes], tokenizer=str(tiny_model_dir),
                                         db=sqlite_url, health_interval_s=INTERVAL_S) as gw:
        with Agents(gw, 8) as agents:
            time.sleep(1.0)
            out: list[Any] = []
            publish = _publish(gw, 1, tmp_path, out)
            in_rotation: list[int] = []
            while publish.is_alive():
                in_rotation.append(sum(b["healthy"] for b in _backends(gw).values()))
                time.sleep(0.5)
            publish.join()
            done_at_publish = agents.ok
            time.sleep(2.0)  # the agents go on after it
        r, seconds = out[0]
        assert r.status_code == 200 and r.json()["failed_backends"] == {}, r.text
        after = _backends(gw)
        print(f"\npublish of {seconds:.1f} s (load {PUBLISH_S:.0f} s, health timeout {HEALTH_TIMEOUT_S:.1f} s): "
              f"backends in rotation during it min {min(in_rotation)}/2, after it "
              f"{sum(b['healthy'] for b in after.values())}/2; agent calls ok {agents.ok} ({agents.ok - done_at_publish}"
              f" after the publish), agent-visible errors {len(agents.errors)}")
        assert seconds >= PUBLISH_S
        assert min(in_rotation) == 2 and all(b["healthy"] for b in after.values()), (in_rotation, after)
        assert agents.errors == [] and agents.ok > done_at_publish
        for f in fakes:
            assert f.paused is None and f.weight_version == "1" and not f.unhealthy
            # /health never reached a server while it was paused or loading (it blocks, then marks it unhealthy)
            assert f.health_while_busy == 0 and "/ping" in f.health_probes


@pytest.mark.parametrize("n_agents", [8, 0], ids=["agents", "idle"])
def test_a_backend_killed_during_a_long_publish_leaves_rotation(tiny_model_dir: Path, sqlite_url: str,
                                                                tmp_path: Path, n_agents: int) -> None:
    """With agents, a request waiting on the dead backend takes it out at once; idle, the liveness probe (/ping: it
    is paused) does, within LEAVE_BOUND_S."""
    fakes = [FakeSGLang(token_delay=0.002, load_delay=PUBLISH_S, health_check_timeout=HEALTH_TIMEOUT_S)
             for _ in range(2)]
    a, b = fakes
    with a, b, LiveGateway(backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url,
                           health_interval_s=INTERVAL_S) as gw:
        with Agents(gw, n_agents) as agents:
            time.sleep(1.0)
            out: list[Any] = []
            publish = _publish(gw, 1, tmp_path, out)
            deadline = time.monotonic() + 10
            while b.loading == 0:
                assert time.monotonic() < deadline, "b never started loading"
                time.sleep(0.05)
            killed = time.monotonic()
            b.stop()  # killed: it stops listening at once (and returns once its open requests are cut)
            while _backends(gw)[b.url]["healthy"]:
                assert time.monotonic() - killed < 2 * LEAVE_BOUND_S, "the dead backend stayed in rotation"
                time.sleep(0.1)
            left_after = time.monotonic() - killed
            why = _backends(gw)[b.url]["last_error"]
            a_in = _backends(gw)[a.url]["healthy"]
            publish.join()
            time.sleep(2.0)
        r, seconds = out[0]
        print(f"\nbackend killed during a {PUBLISH_S:.0f} s publish, {n_agents} agents: out of rotation {left_after:.1f} s later (bound "
              f"{LEAVE_BOUND_S:.1f} s), the other in rotation meanwhile: {a_in} ({why}); publish {seconds:.1f} s, answered "
              f"{r.status_code}; agent calls ok {agents.ok}, agent-visible errors {len(agents.errors)}")
        assert left_after <= LEAVE_BOUND_S and a_in
        assert r.status_code == 200 and list(r.json()["failed_backends"]) == [_backends(gw)[b.url]["id"]], r.text
        assert _backends(gw)[a.url]["healthy"] and a.paused is None and a.weight_version == "1"
        assert agents.errors == [], agents.errors[:3]
