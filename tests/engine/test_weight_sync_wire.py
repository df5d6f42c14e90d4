"""`flattened_bucket` on the wire as SGLang 0.5.23 has it (issue 27 item 8): one `uint8` buffer holding the
tensors' bytes back to back, each at a multiple of its dtype's size (`srt/weight_sync/tensor_bucket.py`
`FlattenedTensorBucket`: the sender's `__init__` views every tensor as bytes and concatenates them; the server's
`empty` allocates the byte buffer it broadcasts into and refuses an unaligned offset). Real gloo groups; the
sending side in a child process, as in tests/engine/test_weight_sync.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from engine.weight_sync import init_custom_process_group
from tests.engine.conftest import LiveServer
from tests.engine.test_weight_sync import buckets_of, post, served, start_trainer, trained_state
from trainer.fsdp import free_port

__all__ = ["served"]  # the module fixture, shared


def sglang_flattened(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """What `FlattenedTensorBucket(named_tensors=...)` sends (its `__init__`, verbatim in effect)."""
    return torch.cat([t.flatten().view(torch.uint8) for _, t in named], dim=0)


def sglang_receive(pg: Any, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """What `FlattenedTensorBucket.empty` + `_receive_bucketed_weights_from_distributed` do on the server."""
    offsets, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        assert offset % dtype.itemsize == 0, "unaligned"
        size = torch.Size(shape).numel() * dtype.itemsize
        offsets.append((offset, offset + size))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8)
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([flat], opts).wait()
    return [flat[a:b].view(d).reshape(s) for (a, b), d, s in zip(offsets, dtypes, shapes, strict=True)]


def _init(server: LiveServer, port: int, group: str) -> None:
    r = post(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                         "rank_offset": 1, "world_size": 2, "group_name": group,
                                                         "backend": "gloo"})
    assert r.status_code == 200 and r.json()["success"], r.text
    # SGLang 0.5.21+: the bucket calls run inside a weight-update session
    r = post(server.url, "/begin_weight_update", {})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_the_engine_reads_sglangs_mixed_dtype_bucket(served: tuple[LiveServer, Any], tiny_model_dir: Path) -> None:
    server, engine = served
    state = trained_state(tiny_model_dir, 0.03)
    names = [n for n, t in state.items() if t.numel() % 2 == 0][:3]
    # float32, bfloat16, float32: the second float32 starts 4-aligned because the bf16 one has an even numel.
    named = [(names[0], state[names[0]]), (names[1], state[names[1]].to(torch.bfloat16)), (names[2], state[names[2]])]
    port = free_port()
    proc, out = start_trainer(port, "g-wire", tensors=[sglang_flattened(named)])
    _init(server, port, "g-wire")
    body = {"names": names, "dtypes": ["float32", "bfloat16", "float32"],
            "shapes": [list(t.shape) for _, t in named], "group_name": "g-wire", "load_format": "flattened_bucket"}
    r = post(server.url, "/update_weights_from_distributed", body)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert out.get(timeout=60) == {"sent": 1}
    proc.join(30)
    served_state = engine.scheduler.model.state_dict()
    for name, t in named:
        assert torch.equal(served_state[name], t.to(torch.float32)), name
    post(server.url, "/end_weight_update", {})
    post(server.url, "/destroy_weights_update_group", {"group_name": "g-wire"})


def test_an_unaligned_bucket_is_refused(served: tuple[LiveServer, Any]) -> None:
    """A bf16 tensor of odd size followed by a float32 one: SGLang's `empty` raises `Unaligned received tensor`."""
    server, _ = served
    port = free_port()
    proc, _ = start_trainer(port, "g-unaligned")  # joins and stays silent
    _init(server, port, "g-unaligned")
    body = {"names": ["model.norm.weight", "model.norm.weight"], "dtypes": ["bfloat16", "float32"],
            "shapes": [[3], [2]], "group_name": "g-unaligned", "load_format": "flattened_bucket"}
    r = post(server.url, "/update_weights_from_distributed", body)
    assert r.status_code == 400 and "Unaligned received tensor 1: byte offset 6" in r.json()["message"]
    post(server.url, "/end_weight_update", {})
    post(server.url, "/destroy_weights_update_group", {"group_name": "g-unaligned"})
    proc.kill()
    proc.join(10)


def test_the_trainer_sends_what_sglang_receives(tiny_model_dir: Path) -> None:
    """The trainer's `Sender` against SGLang's receiving code (in this process, rank 1)."""
    state = trained_state(tiny_model_dir, 0.05)
    buckets = buckets_of(state, 200_000)
    port = free_port()
    proc, out = start_trainer(port, "g-sglang-rx", buckets=buckets)
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "g-sglang-rx", timedelta(seconds=30))
    try:
        for b in buckets:
            manifest = b.manifest()
            got = sglang_receive(pg, [getattr(torch, d) for d in manifest["dtypes"]], manifest["shapes"])
            for name, t in zip(b.names, got, strict=True):
                assert torch.equal(t, state[name]), name
    finally:
        torch.distributed.destroy_process_group(pg)
    assert out.get(timeout=60) == {"sent": len(buckets), "error": None}
    proc.join(30)


def test_the_sender_broadcasts_uint8(monkeypatch: Any) -> None:
    """NCCL, unlike gloo, needs both ends to name one dtype and count: the sender's tensor is SGLang's uint8 buffer."""
    import trainer.weight_sync as ws

    sent: list[torch.Tensor] = []

    class Group:
        def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
            sent.append(tensors[0])
            return self

        def wait(self) -> None:
            pass

    monkeypatch.setattr(ws, "init_custom_process_group", lambda *a, **k: Group())
    state = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float32)}
    buckets = buckets_of(state, 1 << 20)
    sender = ws.Sender({"group_name": "g", "world_size": 2}, "127.0.0.1", 1, "gloo", 5.0, buckets).start()
    sender.join(30)
    assert sender.error is None and len(sent) == 1
    assert sent[0].dtype == torch.uint8 and sent[0].numel() == 9 * 4
    assert torch.equal(sent[0], sglang_flattened(list(state.items())))
