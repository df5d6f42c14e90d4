"""Process group, device mesh and FSDP2 wrapping.

CPU: gloo, with an explicit CPU mesh (`init_device_mesh("cpu", ...)`: left to itself the mesh may pick
CUDA when a CUDA build sees no GPU, and crash). GPU: NCCL, one device per local rank, bf16 compute with
float32 master weights and float32 gradient reduction (MixedPrecisionPolicy).
`fully_shard` goes on each decoder layer, then on the root (which then holds the embeddings, the final norm
and the LM head, so tied embeddings stay one parameter).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rollway_common.procs import free_port
from trainer import recompute as recompute_mod


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 1800.0, force_cpu: bool = False) -> DistInfo:
    """Join the process group torchrun describes in the environment; alone (world size 1) without one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and not force_cpu
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world
        )
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistInfo(rank, world, local_rank, device, mesh)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The HF decoder stack: `model.model.layers` (Llama, Qwen, Mistral, ...), else `transformer.h`."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    for name in ("layers", "h"):
        layers = getattr(inner, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def shard_model(model: nn.Module, info: DistInfo, *, wrap_one_cpu_rank: bool = False) -> nn.Module:
    """fully_shard each decoder layer, then the root; parameters move to `info.device`.

    One CPU rank is left unwrapped: there is nothing to shard or reduce, and FSDP2's hooks and DTensor
    parameters cost ~10% of each step of the demo's model (benchmarks/loop.py: 0.36 -> 0.31 s of forward/backward
    + AdamW a step, 64 sequences). Everything downstream (DCP checkpoints, the HF export, gradient clipping)
    takes a plain module as well. On CUDA the wrap stays even for one rank: it carries the bf16 mixed precision.
    `wrap_one_cpu_rank` wraps it anyway (tests of the FSDP2 code paths on one process)."""
    if info.world_size == 1 and info.device.type == "cpu" and not wrap_one_cpu_rank:
        return model
    if info.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=info.mesh, mp_policy=mp)
    fully_shard(model, mesh=info.mesh, mp_policy=mp)
    return model


def load_sharded_model(source: str, info: DistInfo, trainable: bool = True,
                       prepare: Callable[[nn.Module], nn.Module] | None = None,
                       recompute: recompute_mod.Mode = "off", recompute_min_tokens: int = 0) -> nn.Module:
    """HF causal LM from `source` in float32 (master weights), FSDP2-sharded over the mesh.
    Every rank reads the full checkpoint before sharding: fine up to a few billion parameters.
    `recompute`: activation checkpointing per decoder layer (trainer/recompute.py), installed before the wrap."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.use_cache = False
    if trainable:
        model.train()
    else:
        model.eval().requires_grad_(False)
    if prepare is not None:  # e.g. a LoRA adapter injected before the wrap (trainer/lora.py)
        model = prepare(model)  # type: ignore[assignment]
    if trainable:
        recompute_mod.install(model, decoder_layers(model), recompute, recompute_min_tokens)
    return shard_model(model, info)


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (pickled; a step's batches are token lists, small next to a model)."""
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
