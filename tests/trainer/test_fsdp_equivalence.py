"""FSDP2 at world size 2 (gloo, two processes from torch.multiprocessing) against world size 1 on the same
batch: the same loss and metrics, and the same weights after two optimizer steps (proximal pass included).

Tolerance: float32 sums taken in another order (the ranks' shares, then the all-reduce), through two AdamW
steps: |loss_2 - loss_1| <= 1e-5 relative and every weight within 1e-6 absolute (the update is lr = 1e-4 per
step, so a sharding bug, which moves weights by ~1e-4, cannot hide under it).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.trainer.trainer_fakes import make_group
from trainer.advantages import score_group
from trainer.batching import plan_step, rows_of
from trainer.checkpoint import full_state_dict
from trainer.client import parse_group
from trainer.fsdp import free_port, init_distributed, load_sharded_model, shutdown
from trainer.loss import PPOParams
from trainer.step import rl_step

LR = 1e-4


def fixed_groups() -> list:
    rng = random.Random(7)
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0], [1.0, 0.0], [0.2, 0.9, 0.4]]
    groups = [
        parse_group(make_group(f"g{i}", r, rng, samples_per_session=1 + i % 2, temperature=0.8))
        for i, r in enumerate(rewards)
    ]
    return [score_group(g, std_norm=True) for g in groups]


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=120, force_cpu=True)
    try:
        model = load_sharded_model(model_dir, info)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        plan = plan_step(
            [rows_of(g) for g in fixed_groups()],
            world_size=world,
            rank=rank,
            optimizer_steps=2,
            micro_batch_tokens=48,
            loss_agg="token_mean",
        )
        metrics = rl_step(model, opt, plan, PPOParams(), max_grad_norm=1.0, device=info.device)
        state = full_state_dict(model)
        if rank == 0:
            torch.save({"metrics": metrics, "state": state, "passes": len(plan[0].micro)}, out)
        # Both ranks leave together, as trainer/train.py's main() does: a rank that tore gloo down while its
        # peer was still in a collective aborted at exit ("terminate called without an active exception").
        dist.barrier()
    finally:
        shutdown()


def run(world: int, model_dir: Path, out: Path) -> dict:
    mp.spawn(_worker, args=(world, free_port(), str(model_dir), str(out)), nprocs=world, join=True)
    return torch.load(out)


def test_world_size_2_matches_world_size_1(tiny_model: Path, tmp_path: Path) -> None:
    one = run(1, tiny_model, tmp_path / "w1.pt")
    two = run(2, tiny_model, tmp_path / "w2.pt")
    m1, m2 = one["metrics"], two["metrics"]
    assert m1["minibatches"] == 2 and m1["loss_tokens"] == m2["loss_tokens"] > 0
    assert abs(m1["loss"] - m2["loss"]) <= 1e-5 * abs(m1["loss"]) + 1e-7
    for k in ("clip_frac", "entropy", "pg_loss", "ratio", "behaviour_capped_frac", "grad_norm"):
        assert abs(m1[k] - m2[k]) <= 1e-5 * abs(m1[k]) + 1e-7, k
    assert m1["ratio"] != 1.0  # the second minibatch is scored against the recomputed proximal policy
    start = load_sharded_state(tiny_model)
    moved = max((one["state"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 5e-5  # the step really changed the weights
    assert one["state"].keys() == two["state"].keys()
    worst = max((one["state"][k] - two["state"][k]).abs().max().item() for k in one["state"])
    assert worst <= 1e-6, worst


def load_sharded_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
