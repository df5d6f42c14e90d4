"""Loading a model's weights for the engine: at start (`load_model`) and on a weight update (`load_like`, which copies
a publish's tensors into a model the engine no longer serves when the checkpoint is the same model)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel


def load_model(path: str | Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


_CONFIG_NOISE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "use_cache"})
"""config.json keys that say where or how a checkpoint was written, not what model it is (the trainer exports with
`use_cache` off; the engine passes its own)."""


def _identity(config: Any) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}


def _weight_files(folder: Path) -> list[Path] | None:
    """The safetensors files `from_pretrained` would read: the index's shards, else model.safetensors; None when
    the folder has neither (or its index names a file it lacks): the whole load then decides."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return files if files and all(f.is_file() for f in files) else None
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


def load_like(
    model: PreTrainedModel, path: str | Path, into: Callable[[], PreTrainedModel | None] | None = None
) -> PreTrainedModel:
    """The checkpoint at `path` as a model other than `model`: when it is the same model as `model` (same config,
    tensor names and shapes), `model`'s structure with the checkpoint's tensors copied in, else loaded whole
    (`load_model`). The tensors go into the model `into()` gives, when it gives one (a model no step uses any more,
    of `model`'s config: the one the last weight swap retired, `Scheduler.take_retired`), else into a copy of
    `model`. `into` is called only once the checkpoint is known to fit, so a checkpoint that does not fit leaves the
    retired model where it was.

    A trainer's publish is the first case: new values for the served model's tensors. Copying them into a retired
    model takes a couple of milliseconds, a copy of the model ten, and `from_pretrained` twenty or more (it builds
    the model from its config and resolves every loader option again); a weight update holds generation while the
    load runs. The served model's tied tensors stay tied; a tensor the file lacks is allowed only when it is tied
    to one the file has (an untied lm_head must be in the file)."""
    folder = Path(path)
    files = _weight_files(folder)
    if files is None:
        return load_model(path)
    served = _identity(model.config)
    if served != _identity(AutoConfig.from_pretrained(str(folder))):
        return load_model(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    ref = model.state_dict()  # references only: the served model is read, never written
    if set(tensors) - set(ref) or any(tensors[k].shape != ref[k].shape for k in tensors):
        return load_model(path)
    filled = {ref[k].data_ptr() for k in tensors}
    if any(ref[k].data_ptr() not in filled for k in set(ref) - set(tensors)):
        return load_model(path)  # a tensor the file lacks and no tie fills: the whole load decides what it gets
    target = into() if into is not None else None
    if target is None or target is model or _identity(target.config) != served:
        target = copy.deepcopy(model)
    own = target.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)
    return target.eval()
