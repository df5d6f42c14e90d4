"""Durable training checkpoints (DCP: model + optimizer, sharded) and the HF export that gets published.

Both are written under a temporary name and renamed into place once complete and fsynced, so a crash
never leaves a half-written folder under a name that is read (a checkpoint) or published (weights):

    out/checkpoints/step_00000012/   DCP shards + trainer_state.json {step, version}
    out/weights/v000007/             model.safetensors, config.json, tokenizer files

All functions are collective (every rank calls them); only rank 0 writes the HF folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rollway_common import paths

TOKENIZER_FILES = (*paths.TOKENIZER_FILES, "generation_config.json")
"""Copied verbatim from the model folder training started from: exactly what the gateway templated with."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU tensors on rank 0 (empty elsewhere). Collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=opts))


def save_dtype(config: object) -> torch.dtype:
    """The dtype the source checkpoint declares (config `dtype` / `torch_dtype`), else float32."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export_hf(model: nn.Module, source_dir: str | Path, dest: str | Path, *, fsync: bool = True) -> Path:
    """Write an HF folder (safetensors, config, tokenizer) at `dest` atomically. Collective; returns dest.
    `fsync=False` (benchmarks/trainer.py --publish) leaves the flush to the OS.

    Tied embeddings: the tied `lm_head.weight` is left out (HF re-ties it on load from
    `tie_word_embeddings`), as `save_pretrained` does.
    """
    dest = Path(dest).resolve()
    state = full_state_dict(model)
    if _rank() == 0:
        config: Any = model.config
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        dtype = save_dtype(config)
        state = {k: v.to(dtype).contiguous() for k, v in state.items()}
        tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.to_json_file(str(tmp / "config.json"))
        for name in TOKENIZER_FILES:
            src = Path(source_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
        if fsync:
            _fsync_tree(tmp)
        # A leftover here is from a crashed run, never published: a published version is never reused.
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        if fsync:
            _fsync_dir(dest.parent)
    _barrier()
    return dest


def save_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    root: str | Path,
    *,
    step: int,
    version: int,
    keep: int,
    trainable_only: bool = False,
) -> Path:
    """DCP save of model + optimizer, then {step, version}; renamed into place by rank 0. Collective.
    `trainable_only`: leave out frozen parameters (a LoRA run saves the adapter, not the base)."""
    root = Path(root).resolve()
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=trainable_only))
    model_sd = _trainable(model, model_sd) if trainable_only else model_sd
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "version": version}))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _trainable(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Only the trainable parameters' entries (ignore_frozen_params keeps a tied, frozen lm_head: a vocabulary-sized
    tensor a LoRA checkpoint must not carry)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def latest_checkpoint(root: str | Path) -> Path | None:
    done = sorted(p for p in Path(root).glob("step_*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path,
                    trainable_only: bool = False) -> tuple[int, int]:
    """Restore model + optimizer in place (any world size: DCP reshards); returns (step, version)."""
    opts = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    model_sd = _trainable(model, model_sd) if trainable_only else model_sd
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))  # fills both in place
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts)
    meta = json.loads((Path(path) / "trainer_state.json").read_text())
    return int(meta["step"]), int(meta["version"])


def prune_weights(root: str | Path, keep: int) -> None:
    dirs = sorted(p for p in Path(root).glob("v*") if p.is_dir())
    for old in dirs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
