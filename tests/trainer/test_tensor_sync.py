"""The tensor path's weights handed out as they are (trainer/tensor_sync.py `LiveWeights`, `SyncPayload.gather` with
`live`), apart from the network: the payload is the model's own parameters in shared memory, and the optimizer step
waits until the servers have read them (the network is in tests/engine/test_tensor_sync.py and
tests/e2e/test_tensor_sync.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollway_common.tensor_payload import deserialize
from trainer.tensor_sync import LiveWeights
from trainer.weight_sync import CatchUp, SyncOptions, SyncPayload


class _Gateway:
    """A gateway client for the tensor path: on `sync` it opens the payloads as a server does (another process
    would map the same shared memory), keeps what it read, and takes `hold` seconds doing it."""

    def __init__(self, hold: float = 0.0) -> None:
        self.hold = hold
        self.read: list[dict[str, torch.Tensor]] = []
        self.calls: list[dict[str, Any]] = []
        self.answered_at = 0.0

    def sync_init(self, version: int, *args: Any, catch_up: bool = False, host_id: str | None = None) -> dict[str, Any]:
        return {"sync_id": "s", "version": version, "groups": [{"group_name": "g0", "world_size": 2,
                                                                "backend_id": "b0"}]}

    def sync(self, sync_id: str, version: int, ports: dict[str, int], buckets: list[dict[str, Any]],
             batch_ids: list[str], results: dict[str, str], timeout: float,
             tensors: dict[str, list[list[str]]] | None = None, load_format: str | None = "flattened_bucket") -> Any:
        assert tensors is not None
        self.calls.append({"load_format": load_format, "buckets": buckets})
        got: dict[str, torch.Tensor] = {}
        for entries in tensors["g0"]:
            assert len(entries) == 1  # one TP rank
            pairs = deserialize(entries[0])
            assert isinstance(pairs, list)
            got.update({name: t.clone() for name, t in pairs})
        time.sleep(self.hold)  # the servers copying
        self.read.append(got)
        self.answered_at = time.monotonic()
        return {"version": version, "backends": ["b0"], "failed_backends": {}, "seconds": self.hold}


def _model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def test_the_payload_is_the_parameters_themselves_in_shared_memory(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    live = LiveWeights()
    opts = SyncOptions(backend="tensor", bucket_bytes=50_000, live=live)
    payload = SyncPayload.gather(model, tiny_model_dir, opts)
    assert payload.live is live and payload.load_format is None and live.readers == 1
    params = dict(model.named_parameters())
    names = [n for b in payload.buckets for n in b.names]
    assert (len(payload.buckets) > 1 and "lm_head.weight" not in names) or not model.config.tie_word_embeddings
    for b in payload.buckets:
        assert b.flat is None and b.views is not None
        for n, t in zip(b.names, b.views, strict=True):
            assert t.data_ptr() == params[n].data_ptr()  # no copy
    gateway = _Gateway()
    assert payload.publish(gateway, 3, [], {}) == 3  # type: ignore[arg-type]
    assert live.readers == 0 and gateway.calls[0]["load_format"] is None
    assert all(params[n].is_shared() for n in names)  # moved into shared memory, in place: still the parameters
    assert set(gateway.read[0]) == set(names)
    assert all(torch.equal(gateway.read[0][n], params[n].detach()) for n in names)
    before = {n: params[n].data_ptr() for n in names}
    SyncPayload.gather(model, tiny_model_dir, opts).publish(gateway, 4, [], {})  # type: ignore[arg-type]
    assert {n: params[n].data_ptr() for n in names} == before  # shared once, not again


def test_the_optimizer_step_waits_until_the_servers_have_read(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    live = LiveWeights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(live.before_step)
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="tensor", bucket_bytes=50_000, live=live))
    published = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    gateway = _Gateway(hold=0.5)
    publisher = threading.Thread(target=payload.publish, args=(gateway, 1, [], {}))
    stepped: list[float] = []

    def step() -> None:
        optimizer.step()
        stepped.append(time.monotonic())

    stepper = threading.Thread(target=step)
    stepper.start()  # the next step's optimizer step, before the publish thread has even begun
    time.sleep(0.2)
    assert not stepped and live.readers == 1  # waiting for the publish
    publisher.start()
    publisher.join(30)
    stepper.join(30)
    assert stepped and stepped[0] >= gateway.answered_at  # the weights changed only after the servers answered
    read = gateway.read[0]
    assert all(torch.equal(read[n], published[n]) for n in read)  # what the servers read is the published version
    assert any(not torch.equal(p.detach(), published[n]) for n, p in model.named_parameters())  # the step happened
    assert live.generation == 1 and live.waited_s > 0.1


def test_a_catch_up_sends_exposed_weights_only_until_the_next_step(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    live = LiveWeights()
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="tensor", bucket_bytes=50_000, live=live))
    payload.publish(_Gateway(), 1, [], {})  # type: ignore[arg-type]

    class _Awaiting(_Gateway):
        catch_ups = 0

        def sync_status(self) -> dict[str, Any]:
            return {"version": 1, "awaiting_backends": ["b0"], "sync": None}

        def sync_init(self, version: int, *args: Any, catch_up: bool = False, host_id: str | None = None) -> Any:
            self.catch_ups += catch_up
            return super().sync_init(version)

    client = _Awaiting()
    watch = CatchUp(client, 60)  # type: ignore[arg-type]
    watch.published(payload, 1)
    assert watch.check() == 1 and client.catch_ups == 1  # the weights are still version 1: sent again
    assert live.readers == 0
    live.before_step()  # an optimizer step: no longer version 1
    assert watch.check() == 0 and client.catch_ups == 1


def test_weights_that_need_a_cast_are_copied_into_buckets(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    model.config.dtype = torch.bfloat16  # the servers load bfloat16: the float32 parameters cannot be handed out
    live = LiveWeights()
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="tensor", bucket_bytes=50_000, live=live))
    assert payload.live is None and payload.load_format == "flattened_bucket" and live.readers == 0
    assert all(b.flat is not None and b.flat.dtype == torch.bfloat16 for b in payload.buckets)
    model.config.dtype = torch.float32
    copied = SyncPayload.gather(model, tiny_model_dir, SyncOptions(backend="tensor", bucket_bytes=50_000))  # no live
    assert copied.live is None and all(b.flat is not None for b in copied.buckets)


def test_the_parameters_move_into_one_shared_memory_file_once(tiny_model_dir: Path) -> None:
    """`share_in_one`: every exposed parameter a slice of one shared-memory buffer (a server opens one file, not one
    per tensor), values and ties kept; an optimizer step changes them where they are, and the next payload hands out
    the new values from the same memory."""
    from trainer.checkpoint import full_state_dict
    from trainer.tensor_sync import plain_state

    model = _model(tiny_model_dir)
    state = plain_state(model)
    assert state is not None
    full = full_state_dict(model)
    assert state.keys() == full.keys() and all(state[k].data_ptr() == full[k].data_ptr() for k in state)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    live = LiveWeights()
    opts = SyncOptions(backend="tensor", bucket_bytes=50_000, live=live)
    payload = SyncPayload.gather(model, tiny_model_dir, opts)
    params = dict(model.named_parameters())
    memory = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(memory) == 1 and all(p.is_shared() for p in model.parameters())
    assert all(torch.equal(p.detach(), before[n]) for n, p in params.items())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for b in payload.buckets:
        assert b.views is not None
        assert all(t.data_ptr() == params[n].data_ptr() for n, t in zip(b.names, b.views, strict=True))
    payload.publish(_Gateway(), 1, [], {})  # type: ignore[arg-type]
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.square().mean().backward()
    live.before_step()
    opt.step()
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == memory  # changed where they are
    gateway = _Gateway()
    payload = SyncPayload.gather(model, tiny_model_dir, opts)
    payload.publish(gateway, 2, [], {})  # type: ignore[arg-type]
    names = [n for b in payload.buckets for n in b.names]
    assert all(torch.equal(gateway.read[0][n], params[n].detach()) for n in names)
    assert any(not torch.equal(gateway.read[0][n], before[n]) for n in names)


def test_share_in_one_leaves_a_model_of_mixed_dtypes_as_it_is() -> None:
    # one shared buffer holds one dtype: a float64 buffer beside float32 weights is not cast into it
    from trainer.tensor_sync import share_in_one

    model = torch.nn.Linear(4, 3)
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    state = model.state_dict()
    got = share_in_one(model, state)
    assert got is state
    assert model.get_buffer("scale").dtype == torch.float64 and model.weight.dtype == torch.float32
