"""LoRA training: a PEFT adapter injected into the HF model before FSDP2 wraps it (the base frozen), and its
publish as a PEFT adapter folder only (adapter_config.json + adapter_model.safetensors: a few MB).

`rollway train --lora-rank R [--lora-alpha A --lora-targets q_proj,v_proj]`. The model keeps its HF class
(`peft.inject_adapter_in_model`), so the decoder-layer wrap, the fused LM-head logprobs and the checkpoints work
as for full weights; checkpoints hold only the trainable (adapter) parameters and their optimizer state. The
gateway loads each published folder on every server under a versioned name (gateway/adapters.py); the publish
names it `lora:<folder>`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from trainer.checkpoint import _fsync_dir, _fsync_tree
from trainer.config import TrainConfig

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
LORA = "lora:"
"""Publish `model_path` prefix of an adapter (gateway/adapters.py)."""


def targets(cfg: TrainConfig) -> list[str]:
    return [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]


def lora_config(cfg: TrainConfig, base_model: str = "") -> Any:
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, lora_dropout=0.0,
                      target_modules=targets(cfg), bias="none", base_model_name_or_path=base_model or None)


def inject(model: nn.Module, cfg: TrainConfig, base_model: str = "") -> nn.Module:
    """Add the adapter (B = 0: the model starts as the base) and freeze everything else. In place."""
    from peft import inject_adapter_in_model

    torch.manual_seed(cfg.seed)  # A's init: the same on every rank
    model = inject_adapter_in_model(lora_config(cfg, base_model), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file keys (`base_model.model.<module>.lora_A.weight`), full on rank 0.
    Collective: every rank gathers the same sharded parameters in the same order."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a DTensor shard
        if _rank() == 0:
            out["base_model.model." + name.replace(".default.", ".")] = full.detach().to("cpu", torch.float32).clone()
    return out


def export_adapter(model: nn.Module, cfg: TrainConfig, base_model: str, dest: str | Path, *, fsync: bool = True) -> Path:
    """Write the PEFT adapter folder at `dest` atomically (rank 0). Collective; returns dest."""
    dest = Path(dest).resolve()
    state = adapter_state(model)
    if _rank() == 0:
        tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        config = lora_config(cfg, base_model).to_dict()
        config["target_modules"] = sorted(config["target_modules"])  # a set in PEFT's dict: JSON has no sets
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        if fsync:
            _fsync_tree(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        if fsync:
            _fsync_dir(dest.parent)
    if dist.is_initialized():
        dist.barrier()
    return dest


def publish_path(path: str | Path) -> str:
    """What the publish names: `lora:<folder>` for an adapter folder, the folder itself for full weights."""
    p = Path(path)
    return f"{LORA}{p}" if (p / "adapter_config.json").is_file() else str(p)


def load_adapter(model: nn.Module, folder: str | Path) -> None:
    """Set the adapter's weights from a published folder (every rank reads it): a run restarted without its
    checkpoints goes on from the adapter the servers have."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    names = {n.replace(".default.", "."): n for n, _ in model.named_parameters() if "lora_" in n}
    state: dict[str, Any] = {names[k.removeprefix("base_model.model.")]: v for k, v in tensors.items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
