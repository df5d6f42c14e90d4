"""The trainer reports each step to the gateway (POST /v1/training/steps): a real trainer step against a real
gateway (in front of a fake SGLang) ends with the step's figures and each trained session's advantage in the
store; a report never slows or breaks training (sent on its own thread, retried, then skipped)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.store.db import create_engine
from gateway.store.store import Store
from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway
from trainer.client import GatewayClient, StepReporter, step_report
from trainer.config import load_config
from trainer.fsdp import free_port, init_distributed
from trainer.train import run_rl


def read_store(url: str, fn: Any) -> Any:
    async def run() -> Any:
        store = Store(create_engine(url))
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def play(gw: LiveGateway, rewards: list[float]) -> list[str]:
    """A group whose sessions each take one chat turn, then get their reward and finish."""
    sessions = gw.group(len(rewards))["sessions"]
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        for cred, reward in zip(sessions, rewards, strict=True):
            r = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {cred['api_key']}"},
                       json={"messages": [{"role": "user", "content": "add 2 and 3"}], "max_tokens": 6})
            assert r.status_code == 200, r.text
            r = c.post(f"/v1/sessions/{cred['session_id']}/reward", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                       json={"reward": reward, "finish": True})
            assert r.status_code == 200, r.text
    return [s["session_id"] for s in sessions]


@pytest.fixture
def live(tiny_model: Path, sqlite_url: str) -> Iterator[LiveGateway]:
    with FakeSGLang(vocab=range(100, 250)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model), db=sqlite_url) as gw:
        yield gw


def test_a_trainer_step_ends_with_its_figures_and_advantages_in_the_store(
    dist_env: None, tiny_model: Path, tmp_path: Path, live: LiveGateway, sqlite_url: str
) -> None:
    winners = play(live, [1.0, 0.0])
    zeros = play(live, [0.0, 0.0])  # no signal: filtered, so never trained nor reported as a sample
    out = tmp_path / "run"
    cfg = load_config(None, {"gateway": live.url, "admin_key": ADMIN_KEY, "model": str(tiny_model),
                             "out": str(out), "steps": 1, "groups_per_step": 1, "wait_seconds": 0, "lr": 1e-3,
                             "micro_batch_tokens": 256})
    run_rl(cfg, init_distributed(timeout_s=60, force_cpu=True))

    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    (step,) = read_store(sqlite_url, lambda s: s.training_steps())
    assert (step["step"], step["version"]) == (1, 1)
    for key in ("loss", "kl", "entropy", "clip_frac", "grad_norm", "lr", "reward_mean", "reward_std", "tokens",
                "step_time_s", "export_time_s", "publish_wait_s", "lease_wait_s", "groups_accepted"):
        assert step["metrics"][key] == pytest.approx(logged[key]), key
    assert step["metrics"]["lr"] == pytest.approx(1e-3) and step["metrics"]["groups_accepted"] == 1
    adv = read_store(sqlite_url, lambda s: s.session_advantages([*winners, *zeros]))
    # Dr. GRPO: advantage = reward - the group's mean (0.5), the same on every loss token of an outcome reward
    assert set(adv) == set(winners)
    assert adv[winners[0]]["advantage"] == pytest.approx(0.5) and adv[winners[1]]["advantage"] == pytest.approx(-0.5)
    assert {a["version"] for a in adv.values()} == {1} and {a["step"] for a in adv.values()} == {1}
    assert all(a["loss_tokens"] > 0 and a["sequences"] == 1 for a in adv.values())
    assert adv[winners[0]]["reward"] == 1.0
    group = read_store(sqlite_url, lambda s: s.group_advantages(adv[winners[0]]["group_id"]))
    assert group == adv


class SlowThenUp:
    """A gateway stand-in whose /v1/training/steps answers 503 `failures` times, each after `delay` seconds."""

    def __init__(self, failures: int, delay: float = 0.0, status: int = 503) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.tries = 0
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                time.sleep(delay)
                me.tries += 1
                code = status if me.tries <= failures else 200
                if code == 200:
                    me.bodies.append(body)
                data = json.dumps({"error": {"message": "busy", "type": "server_error"}} if code >= 400 else {})
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_report_is_sent_off_the_training_thread_and_retried() -> None:
    gw = SlowThenUp(failures=2, delay=0.3)
    reporter = StepReporter(GatewayClient(gw.url, "k"), retries=3, backoff_s=0.05)
    try:
        t0 = time.perf_counter()
        reporter.report(3, 7, {"loss": 0.5, "kl": float("nan")}, [])
        assert time.perf_counter() - t0 < 0.1  # the step goes on while the gateway takes its time
        deadline = time.monotonic() + 10
        while not gw.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        reporter.close()
        gw.close()
    (body,) = gw.bodies
    assert gw.tries == 3 and reporter.sent == 1 and reporter.failed == 0
    assert (body["step"], body["version"]) == (3, 7) and body["metrics"] == {"loss": 0.5, "kl": None}


def test_a_report_that_cannot_be_sent_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    reporter = StepReporter(GatewayClient(f"http://127.0.0.1:{free_port()}", "k", timeout=2), retries=2,
                            backoff_s=0.01)
    reporter.report(1, 1, {"loss": 1.0}, [])
    reporter.close()  # returns: nothing raises into the training loop
    assert reporter.failed == 1 and reporter.sent == 0
    assert "reporting it to the gateway failed (skipped)" in caplog.text
    old = SlowThenUp(failures=10, status=404)  # a gateway older than the route: one warning, then off
    reporter = StepReporter(GatewayClient(old.url, "k"), retries=3, backoff_s=0.01)
    try:
        for step in (1, 2, 3):
            reporter.report(step, step, {}, [])
        reporter.close()
    finally:
        old.close()
    assert old.tries == 1 and "has no POST /v1/training/steps" in caplog.text


def test_step_report_averages_advantages_over_loss_tokens() -> None:
    from trainer.advantages import score_group
    from trainer.client import Group, Sample, SessionInfo

    def sample(sid: str, returns: list[float], mask: list[int]) -> Sample:
        n = len(mask)
        return Sample("g", sid, None, 1.0, list(range(n)), mask, [0.0] * n, [0] * n, returns)

    # per-turn rewards: a's two sequences have returns 2 then 1 on their loss tokens; b's reward is 0
    group = Group("g", None, [SessionInfo("a", 3.0, "finished"), SessionInfo("b", 0.0, "finished")],
                  [sample("a", [2.0, 2.0, 2.0], [0, 1, 1]), sample("a", [1.0, 1.0], [0, 1]),
                   sample("b", [0.0, 0.0], [0, 1])])
    body = step_report(1, 2, {"loss": 1.0, "note": "text", "flag": True}, [score_group(group, False)])
    assert body["metrics"] == {"loss": 1.0}
    rows = {s["session_id"]: s for s in body["samples"]}
    # baseline 1.5: a's loss tokens 0.5, 0.5, -0.5 -> mean 1/6; b's one token -1.5
    assert rows["a"]["advantage"] == pytest.approx(1 / 6) and rows["a"]["sequences"] == 2
    assert rows["a"]["loss_tokens"] == 3 and rows["b"]["advantage"] == pytest.approx(-1.5)
