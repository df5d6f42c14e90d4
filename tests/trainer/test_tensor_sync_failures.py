"""The tensor path when the publish's answer goes wrong (docs/scaling.md "Ways to publish", the failure row): real
HTTP, a real gateway (tests.harness), real engines (engine/server.py, in this process) reading the trainer's
parameters straight out of its memory (`LiveWeights`), a real optimizer step waiting on them.

- The trainer's call to the gateway fails (timed out, connection dropped) while the gateway still drives the servers'
  reads: the optimizer step waits until the gateway says the publish is over, so the servers hold exactly the
  published weights, and the trainer learns the publish's answer from the gateway.
- The gateway gives up on a server still reading (its deadline): the server never claims the version (it stays
  "<v>-partial", out of rotation, listed as awaiting), whatever its read still does, until a whole version is sent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.server import create_app
from tests.engine.conftest import LiveServer
from tests.harness import ADMIN_KEY, LiveGateway
from trainer.client import GatewayClient, GatewayUnreachable
from trainer.tensor_sync import LiveWeights
from trainer.weight_sync import SyncOptions, SyncPayload


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    from gateway.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'rollway.db'}"
    upgrade(url)
    return url


class SlowReads:
    """ASGI wrapper of an engine: each `/update_weights_from_tensor` waits `delay` seconds before the engine reads
    (a server busy, a large model); `ended` is when the last such call answered."""

    def __init__(self, app: Any, delay: float = 0.0) -> None:
        self.app, self.delay, self.ended, self.calls = app, delay, 0.0, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/update_weights_from_tensor":
            return await self.app(scope, receive, send)
        self.calls += 1
        await asyncio.sleep(self.delay)
        try:
            await self.app(scope, receive, send)
        finally:
            self.ended = time.monotonic()


class CutSync(httpx.HTTPTransport):
    """The trainer's connection to the gateway: `POST /v1/weights/sync` reaches the gateway, but the trainer's side
    gives up after `cut` seconds (its timeout ran out, or the connection dropped), as the gateway goes on."""

    def __init__(self, cut: float) -> None:
        super().__init__()
        self.cut, self.cuts = cut, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != "/v1/weights/sync":
            return super().handle_request(request)
        request.read()
        threading.Thread(target=lambda: super(CutSync, self).handle_request(request).read(), daemon=True).start()
        time.sleep(self.cut)
        self.cuts += 1
        raise httpx.ReadTimeout("timed out (cut by the test)", request=request)


def engine(model_dir: Path, delay: float = 0.0) -> tuple[SlowReads, Any]:
    app = create_app(model_dir, max_batch_size=4)
    return SlowReads(app, delay), app.state.engine


def served(eng: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.scheduler.model.named_parameters()}


def version_of(url: str) -> str:
    return str(httpx.get(url + "/model_info", timeout=30).json()["weight_version"])


def run_step(model: Any, live: LiveWeights) -> tuple[Callable[[], None], list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(live.before_step)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    stepped: list[float] = []

    def step() -> None:
        optimizer.step()  # every parameter changes
        stepped.append(time.monotonic())

    return step, stepped


def test_a_failed_answer_keeps_the_weights_until_the_gateway_says_the_reads_are_over(tiny_model_dir: Path,
                                                                                      sqlite_url: str) -> None:
    slow, eng = engine(tiny_model_dir, delay=0.6)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with LiveServer(cast(Any, slow)) as server, LiveGateway(backends=[server.url], tokenizer=str(tiny_model_dir),
                                                 db=sqlite_url) as gw:
        cut = CutSync(cut=0.3)
        client = GatewayClient(gw.url, ADMIN_KEY, timeout=30, transport=cut)
        live = LiveWeights()
        payload = SyncPayload.gather(model, tiny_model_dir,
                                     SyncOptions(backend="tensor", bucket_bytes=400_000, timeout=5, live=live))
        assert payload.live is live and len(payload.buckets) > 2  # the reads take > 1.8 s, the answer is cut at 0.3 s
        published = {n: p.detach().clone() for n, p in model.named_parameters()}
        step, stepped = run_step(model, live)
        outcome: list[Any] = []

        def publish() -> None:
            try:
                outcome.append(payload.publish(client, 1, [], {}))
            except Exception as e:  # what the trainer's publish thread would raise at the next step
                outcome.append(e)

        publisher = threading.Thread(target=publish)
        stepper = threading.Thread(target=step)
        publisher.start()
        stepper.start()
        publisher.join(120)
        stepper.join(120)
        deadline = time.monotonic() + 120
        while gw.admin.get("/v1/weights/sync").json()["sync"] is not None:  # the gateway done with the servers
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert cut.cuts == 1 and slow.calls == len(payload.buckets)
        assert version_of(server.url) == "1"
        got = served(eng)
        assert all(torch.equal(got[n], published[n]) for n in published if n in got)  # the version, not a mix
        assert stepped and stepped[0] >= slow.ended  # the weights changed only after the last read answered
        assert outcome == [1], outcome  # the gateway's answer, asked for once the call failed
        assert any(not torch.equal(p.detach(), published[n]) for n, p in model.named_parameters())  # it stepped
        assert gw.admin.get("/v1/weights/sync").json()["finished"]["answer"]["version"] == 1
        client.close()


def test_a_server_given_up_on_mid_read_never_claims_the_version(tiny_model_dir: Path, sqlite_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.weight_sync.server_deadline", lambda timeout_s, n_buckets: 1.5, raising=False)
    fast_app, fast = engine(tiny_model_dir)
    slow_app, slow = engine(tiny_model_dir, delay=3.0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with LiveServer(cast(Any, fast_app)) as a, LiveServer(cast(Any, slow_app)) as b, LiveGateway(
        backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url
    ) as gw:
        client = GatewayClient(gw.url, ADMIN_KEY, timeout=30)
        live = LiveWeights()
        opts = SyncOptions(backend="tensor", bucket_bytes=1 << 30, timeout=5, live=live)
        payload = SyncPayload.gather(model, tiny_model_dir, opts)
        assert len(payload.buckets) == 1  # the only read is the last: it once named the version itself
        published = {n: p.detach().clone() for n, p in model.named_parameters()}
        step, _ = run_step(model, live)
        assert payload.publish(client, 1, [], {}) == 1
        answer = payload.last["answer"]
        bid = next(x["id"] for x in gw.admin.get("/v1/backends").json()["data"] if x["url"] == b.url)
        assert list(answer["failed_backends"]) == [bid] and "given up" in answer["failed_backends"][bid]
        step()  # the gateway answered: the weights change while b may still be reading them
        deadline = time.monotonic() + 30
        while slow_app.calls < 1 or slow_app.ended == 0.0:  # b's read ends after the step
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert version_of(a.url) == "1" and all(torch.equal(served(fast)[n], published[n]) for n in published
                                                if n in served(fast))
        assert version_of(b.url) == "1-partial"  # whatever it read, it does not claim version 1
        time.sleep(1.5)  # health rounds: b answers, but is not taken back
        backends = {x["url"]: x for x in gw.admin.get("/v1/backends").json()["data"]}
        assert backends[b.url]["healthy"] is False and backends[a.url]["healthy"] is True
        assert gw.admin.get("/v1/weights/sync").json()["awaiting_backends"] == [bid]

        slow_app.delay = 0.0  # the next publish sends b the whole version and it is back
        payload = SyncPayload.gather(model, tiny_model_dir, opts)
        now = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert payload.publish(client, 2, [], {}) == 2 and payload.last["answer"]["failed_backends"] == {}
        assert version_of(b.url) == "2" and all(torch.equal(served(slow)[n], now[n]) for n in now if n in served(slow))
        backends = {x["url"]: x for x in gw.admin.get("/v1/backends").json()["data"]}
        assert backends[b.url]["healthy"] is True
        client.close()


def test_a_gateway_that_never_says_keeps_the_weights_for_ever(tiny_model_dir: Path) -> None:
    """No gateway to ask at all: the publish raises, and the next optimizer step raises instead of changing weights
    a server may still be reading."""
    import trainer.tensor_sync as ts

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    live = LiveWeights()
    payload = SyncPayload.gather(model, tiny_model_dir,
                                 SyncOptions(backend="tensor", bucket_bytes=50_000, timeout=5, live=live))
    published = {n: p.detach().clone() for n, p in model.named_parameters()}

    class Gone:
        def sync_init(self, version: int, *args: Any, **kw: Any) -> dict[str, Any]:
            return {"sync_id": "s", "version": version, "groups": [{"group_name": "g0", "world_size": 2}]}

        def sync(self, *args: Any, **kw: Any) -> Any:
            raise GatewayUnreachable("connection dropped")

        def sync_status(self) -> Any:
            raise GatewayUnreachable("gateway down")

    real = ts.wait_sync_over
    with pytest.MonkeyPatch.context() as mp:  # a short limit: it would otherwise ask for minutes
        mp.setattr("trainer.tensor_sync.wait_sync_over", lambda c, s, limit, e: real(c, s, 0.5, e))
        with pytest.raises(ts.WeightsStillRead):
            payload.publish(Gone(), 1, [], {})  # type: ignore[arg-type]
    step, stepped = run_step(model, live)
    with pytest.raises(ts.WeightsStillRead):
        step()
    assert not stepped and all(torch.equal(p.detach(), published[n]) for n, p in model.named_parameters())
