"""The RL loop end to end at world size 1 against a fake gateway (http.server in a thread): leasing with
refill after the dynamic filter, acks only after a durable checkpoint, publishing a loadable HF folder,
metrics and the reward plot, and a restart that resumes from the checkpoint and numbers versions from
max(checkpoint, gateway)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.trainer.trainer_fakes import FakeGateway, make_group
from trainer.config import load_config
from trainer.fsdp import free_port, init_distributed
from trainer.train import run_rl


def train(gw: FakeGateway, model: Path, out: Path, **overrides: object) -> None:
    cfg = load_config(
        None,
        {
            "gateway": gw.url,
            "model": str(model),
            "out": str(out),
            "wait_seconds": 0,
            "lr": 1e-3,
            "micro_batch_tokens": 64,
            **overrides,
        },
    )
    run_rl(cfg, init_distributed(timeout_s=60, force_cpu=True))


def weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_rl_loop_publishes_and_acks_after_checkpoint(
    dist_env: None, tiny_model: Path, tmp_path: Path
) -> None:
    rng = random.Random(1)
    groups = [
        make_group("g0", [1.0, 0.0], rng),
        make_group("g1", [1.0, 1.0], rng),
        make_group("g2", [0.0, 1.0, 0.5], rng, samples_per_session=2),
        make_group("g3", [0.3, 0.7], rng),
        make_group("g4", [1.0, 0.0], rng, temperature=0.7),
    ]
    gw = FakeGateway(groups)
    out = tmp_path / "run"
    try:
        train(gw, tiny_model, out, steps=2, groups_per_step=2)
    finally:
        gw.close()
    # Step 1: lease b0 = [g0, g1]; g1's rewards are all equal -> acked "filtered" at once; refill b1 = [g2].
    # Step 2: b2 = [g3, g4]. Each step durable (checkpoint_every = 1): publish v1 acks b0 and b1 in the
    # same transaction as the version bump; publish v2 acks b2.
    acks = gw.calls_to("/v1/batches/b")
    assert [a["results"] for a in acks if "results" in a] == [{"g1": "filtered"}]
    pubs = gw.calls_to("/v1/weights")
    assert [(p["version"], p["batch_ids"], p["results"]) for p in pubs] == [
        (1, ["b0", "b1"], {"g0": 1, "g2": 1}),
        (2, ["b2"], {"g3": 2, "g4": 2}),
    ]
    assert [b["trainer_version"] for b in gw.calls_to("/v1/batches") if "trainer_version" in b] == [0, 0, 1]
    # the published folder loads, holds moved weights, and carries the tokenizer
    published = Path(pubs[-1]["model_path"])
    assert published == out / "weights" / "v000002" and (out / "checkpoints" / "step_00000002").is_dir()
    start, end = weights(tiny_model), weights(published)
    assert max((start[k] - end[k]).abs().max().item() for k in start) > 1e-4
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(published).chat_template
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["groups_accepted"] == 2 and records[0]["groups_filtered"] == 1
    # rewards of every scored group, the filtered one too: [1, 0] + [1, 1] + [0, 1, 0.5] -> mean 4.5 / 7
    assert records[0]["reward_mean"] == pytest.approx(4.5 / 7)
    for key in (
        "loss",
        "clip_frac",
        "kl",
        "entropy",
        "staleness_mean",
        "step_time_s",
        "publish_time_s",
        "tokens",
    ):
        assert key in records[0], key
    assert (out / "rewards.png").stat().st_size > 0 and any((out / "tb").iterdir())

    # Restart: the gateway is at version 5 serving our v2 folder; resume at step 2, publish version 6.
    gw2 = FakeGateway([make_group("g5", [0.0, 1.0], rng)], version=5, model_path=str(published))
    try:
        train(gw2, tiny_model, out, steps=3, groups_per_step=1)
    finally:
        gw2.close()
    (pub,) = gw2.calls_to("/v1/weights")
    assert pub["version"] == 6 and pub["model_path"].endswith("v000006")
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_checkpoint_every_k_holds_leases_until_durable(
    dist_env: None, tiny_model: Path, tmp_path: Path
) -> None:
    rng = random.Random(2)
    gw = FakeGateway([make_group(f"g{i}", [1.0, 0.0], rng) for i in range(2)])
    gw.lease_delays = [0.0, 0.6]  # b0 is held through the second lease: 0.6 s, past two renew periods
    try:
        train(
            gw,
            tiny_model,
            tmp_path / "run",
            steps=2,
            groups_per_step=1,
            checkpoint_every=2,
            lease_seconds=0.3,
            kl_coef=0.05,  # loads the reference model too
            loss_agg="seq_mean",
        )
    finally:
        gw.close()
    # Step 1 is not durable: v1 is published with no batch, and b0 stays leased (renewed) until step 2,
    # whose publish acks b0 and b1 together, each group with the version its update went into (g0's is 1, not
    # the checkpoint's 2: the viewer's "by trained version").
    pubs = gw.calls_to("/v1/weights")
    assert [(p["version"], p["batch_ids"], p["results"]) for p in pubs] == [
        (1, [], {}),
        (2, ["b0", "b1"], {"g0": 1, "g1": 2}),
    ]
    assert not gw.calls_to("/v1/batches/b0/ack")
    assert gw.calls_to("/v1/batches/b0/renew")  # renewed in the background while held
    assert not (tmp_path / "run" / "checkpoints" / "step_00000001").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl"] == 0.0 < records[1]["kl"]  # step 2 is scored against the moved weights


def test_unreachable_gateway_fails_with_the_url(dist_env: None, tiny_model: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    cfg = load_config(
        None, {"gateway": url, "model": str(tiny_model), "out": str(tmp_path), "http_timeout": 2}
    )
    with pytest.raises(RuntimeError, match=f"GatewayUnreachable: gateway {url} unreachable"):
        run_rl(cfg, init_distributed(timeout_s=60, force_cpu=True))


def test_a_trainer_with_nothing_to_train_says_why_and_what_to_change(tmp_path: Path) -> None:
    """Issue 28: the README's walk-through on the untrained model waited forever under "no trainable group
    within 30s (filtered 100)". Through the real lease path (collect, against the fake gateway): every group
    scored 0 in every session -> filtered, and the note says so and what to serve instead."""
    from trainer.client import GatewayClient, LeaseRenewer
    from trainer.train import StepBatch, collect, idle_note

    rng = random.Random(2)
    gw = FakeGateway([make_group(f"g{i}", [0.0, 0.0, 0.0], rng) for i in range(5)])
    cfg = load_config(None, {"gateway": gw.url, "model": "m", "out": str(tmp_path), "wait_seconds": 0,
                             "groups_per_step": 2})
    client = GatewayClient(gw.url, "key", 10.0)
    renewer = LeaseRenewer(client, cfg.lease_seconds)
    try:
        batch = collect(client, renewer, cfg, 0)
    finally:
        renewer.close()
        client.close()
        gw.close()
    assert batch.groups == [] and batch.filtered == 5 and batch.filtered_rewards == [0.0] * 5
    note = idle_note(batch, cfg)
    assert note.startswith("no trainable group within 0s: all 5 of 5 filtered group(s) had equal rewards in every "
                           "session (0): GRPO learns nothing"), note
    assert "never earns a reward" in note and "sft-final" in note
    assert "give harder tasks" in idle_note(StepBatch(filtered=2, filtered_rewards=[1.0, 1.0]), cfg)
    assert "dropped as stale" in idle_note(StepBatch(stale=3), cfg)
    assert "no complete group arrived" in idle_note(StepBatch(), cfg)
