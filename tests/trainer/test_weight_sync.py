"""The trainer's side of a process-group publish, apart from the network: buckets, the payload, the disk fallback
(the network is in tests/engine/test_weight_sync.py and tests/e2e/test_weight_sync.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trainer.client import GatewayHTTPError
from trainer.weight_sync import SyncOptions, SyncPayload, plan_buckets, write_hf


def test_buckets_keep_order_one_dtype_each_and_the_size() -> None:
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(100), "d": torch.zeros(4, dtype=torch.bfloat16),
             "e": torch.zeros(4, dtype=torch.bfloat16), "f": torch.zeros(3)}
    assert plan_buckets(state, 80) == [["a", "b"], ["c"], ["d", "e"], ["f"]]  # c (400 bytes) goes alone
    assert plan_buckets(state, 10**6) == [["a", "b", "c"], ["d", "e"], ["f"]]


def test_the_payload_is_what_the_export_writes(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(bucket_bytes=50_000))
    names = [n for b in payload.buckets for n in b.names]
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in names  # as the HF export: re-tied on load
    assert set(names) == set(state) - {"lm_head.weight"} or set(names) == set(state)
    assert len(payload.buckets) > 1 and payload.nbytes == sum(state[n].numel() * 4 for n in names)
    for b in payload.buckets:
        m = b.manifest()
        assert len(m["names"]) == len(m["dtypes"]) == len(m["shapes"]) and set(m["dtypes"]) == {"float32"}
        for n, t in b.tensors().items():
            assert torch.equal(t, state[n])
    # The disk fallback writes the same tensors as an HF folder a server can load.
    folder = write_hf(payload, tmp_path / "weights" / "v000003")
    written = load_file(str(folder / "model.safetensors"))
    assert set(written) == set(names) and all(torch.equal(written[n], state[n]) for n in names)
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert torch.equal(reloaded.state_dict()["model.norm.weight"], state["model.norm.weight"])


class _Refusing:
    """A gateway client whose process-group publish is refused (503), and that records a disk publish."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.published: list[tuple[Any, ...]] = []

    def sync_init(self, *args: Any, **kwargs: Any) -> Any:
        raise GatewayHTTPError("POST", "/v1/weights/sync/init", self.status, {"error": {"message": "no backend"}})

    def publish(self, version: int, path: str, batch_ids: Any, results: Any) -> int:
        self.published.append((version, path, batch_ids, results))
        return version


def test_falls_back_to_the_disk_path_only_when_no_server_took_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    payload = SyncPayload.gather(model, tiny_model_dir, SyncOptions(fallback_dir=tmp_path / "weights"))
    client = _Refusing(503)
    assert payload.publish(client, 4, ["b1"], {"g": "trained"}) == 4  # type: ignore[arg-type]
    assert client.published == [(4, str((tmp_path / "weights" / "v000004").resolve()), ["b1"], {"g": "trained"})]
    assert (tmp_path / "weights" / "v000004" / "config.json").is_file()
    with pytest.raises(GatewayHTTPError):  # a conflict is the trainer's problem, not the transport's
        payload.publish(_Refusing(409), 5, [], {})  # type: ignore[arg-type]


def test_config_takes_the_distributed_path_and_refuses_it_with_lora() -> None:
    from trainer.config import load_config

    base = {"gateway": "http://gw", "model": "m"}
    assert load_config(None, base).weight_sync == "disk"  # the default stays the disk path
    cfg = load_config(None, {**base, "weight-sync": "distributed", "weight-sync-bucket-mb": "0.5"})
    assert (cfg.weight_sync, cfg.weight_sync_bucket_mb) == ("distributed", 0.5)
    with pytest.raises(ValueError, match="weight_sync"):
        load_config(None, {**base, "weight-sync": "ftp"})
    with pytest.raises(ValueError, match="LoRA"):
        load_config(None, {**base, "weight-sync": "distributed", "lora-rank": "4"})


class _Status:
    """A gateway client that lists one backend lacking `version` and records the catch-ups asked for."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.inits: list[tuple[Any, ...]] = []

    def sync_status(self) -> dict[str, Any]:
        return {"version": self.version, "awaiting_backends": ["b"], "sync": None}

    def sync_init(self, *args: Any, catch_up: bool = False, host_id: str | None = None) -> dict[str, Any]:
        self.inits.append((*args, catch_up))
        return {"sync_id": None, "version": args[0], "catch_up": True, "groups": []}


def test_a_catch_up_sends_only_the_current_version_from_buffers_no_gather_took(tiny_model_dir: Path) -> None:
    from trainer.weight_sync import CatchUp

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    gather = lambda: SyncPayload.gather(model, tiny_model_dir, SyncOptions(bucket_bytes=50_000))  # noqa: E731
    client = _Status(1)
    watch = CatchUp(client, 60)  # type: ignore[arg-type]
    assert watch.check() == 0 and client.inits == []  # nothing published yet
    first = gather()
    watch.published(first, 1)
    assert watch.check() == 0 and [i[0] for i in client.inits] == [1] and client.inits[0][-1] is True
    client.version = 2  # a newer version is out: its own publish reaches the backends
    assert watch.check() == 0 and len(client.inits) == 1
    client.version = 1
    gather()  # the other buffer set
    assert watch.check() == 0 and len(client.inits) == 2  # still the first payload's data: asked for
    gather()  # the first payload's buffers again: its data is gone, so it is never sent
    assert first.buffers is not None and first.buffers.generation != first.generation
    assert watch.check() == 0 and len(client.inits) == 2


def test_catch_up_period_is_a_setting() -> None:
    from trainer.config import load_config

    base = {"gateway": "http://gw", "model": "m", "weight-sync": "distributed"}
    assert load_config(None, base).weight_sync_catch_up_s == 5.0
    assert load_config(None, {**base, "weight-sync-catch-up-s": "0"}).weight_sync_catch_up_s == 0
    with pytest.raises(ValueError, match="catch_up"):
        load_config(None, {**base, "weight-sync-catch-up-s": "-1"})
