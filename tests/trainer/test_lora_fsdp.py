"""LoRA under FSDP2 at world size 2 (gloo, two processes) against world size 1 on the same batch: the same
published adapter after two optimizer steps, and a checkpoint that holds only the adapter, written and read
back by both ranks (DCP reshards it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.trainer.test_fsdp_equivalence import fixed_groups
from trainer.batching import plan_step, rows_of
from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import TrainConfig
from trainer.fsdp import free_port, init_distributed, load_sharded_model, shutdown
from trainer.lora import export_adapter, inject
from trainer.loss import PPOParams
from trainer.step import make_optimizer, rl_step

CFG = TrainConfig(gateway="x", model="x", lr=1e-3, lora_rank=4, lora_targets="q_proj,v_proj")


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=120, force_cpu=True)
    try:
        model = load_sharded_model(model_dir, info, prepare=lambda m: inject(m, CFG, model_dir))
        opt = make_optimizer(model, CFG)
        plan = plan_step([rows_of(g) for g in fixed_groups()], world_size=world, rank=rank, optimizer_steps=2,
                         micro_batch_tokens=48, loss_agg="token_mean")
        rl_step(model, opt, plan, PPOParams(), max_grad_norm=1.0, device=info.device)
        export_adapter(model, CFG, model_dir, Path(out) / "adapter")
        save_checkpoint(model, opt, Path(out) / "ck", step=1, version=1, keep=1, trainable_only=True)
        fresh = load_sharded_model(model_dir, info, prepare=lambda m: inject(m, CFG, model_dir))
        fresh_opt = make_optimizer(fresh, CFG)
        ckpt = latest_checkpoint(Path(out) / "ck")
        assert ckpt is not None and load_checkpoint(fresh, fresh_opt, ckpt, trainable_only=True) == (1, 1)
        export_adapter(fresh, CFG, model_dir, Path(out) / "restored")
        dist.barrier()
    finally:
        shutdown()


def run(world: int, model_dir: Path, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    mp.spawn(_worker, args=(world, free_port(), str(model_dir), str(out)), nprocs=world, join=True)
    return (load_file(str(out / "adapter" / "adapter_model.safetensors")),
            load_file(str(out / "restored" / "adapter_model.safetensors")))


@pytest.mark.slow  # ~70 s on a busy 2-core machine (four processes start torch)
def test_lora_at_world_size_2_matches_world_size_1(tiny_model: Path, tmp_path: Path) -> None:
    one, one_restored = run(1, tiny_model, tmp_path / "w1")
    two, two_restored = run(2, tiny_model, tmp_path / "w2")
    assert one.keys() == two.keys() and any(".lora_B.weight" in k for k in one)
    assert any(two[k].abs().max() > 1e-4 for k in two if "lora_B" in k)  # the adapter was trained
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6), k
        assert torch.equal(one[k], one_restored[k]) and torch.equal(two[k], two_restored[k]), k
