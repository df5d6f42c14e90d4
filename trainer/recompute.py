"""Activation checkpointing per decoder layer, switched per pass by the pass's size.

Without it, a forward keeps every layer's intermediate activations (attention inputs and outputs, the MLP's
up-projection, norms) until the backward: memory per token grows with the layer count times several hidden
sizes. With it, a layer keeps only its input and recomputes the rest during the backward: memory per token is
one hidden state per layer, for the price of a second forward of each layer (~1.3x the pass's time).

So it pays only for long passes. `install` wraps each decoder layer's `forward` (before FSDP2's `fully_shard`,
so FSDP2's hooks stay outside the checkpoint: the recompute in the backward runs between FSDP2's pre-backward
all-gather and its reduce-scatter, as torchtitan's `checkpoint_wrapper` does); `active(model, n_tokens)` turns it
on for a pass of at least `min_tokens` padded tokens. Short passes (the demo's ~1,000-token micro-batches) run
as if it were not installed. Non-reentrant `torch.utils.checkpoint`: keyword arguments and FSDP2's DTensor
parameters are supported; no-grad passes (the proximal and reference passes) never checkpoint.

Memory and time measured by `python benchmarks/trainer.py --memory` (benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Mode = Literal["auto", "on", "off"]

_ATTR = "_rollway_recompute"


@dataclass
class Recompute:
    min_tokens: int
    """A pass of at least this many padded tokens recomputes its layers' activations (0: every pass)."""
    enabled: bool = False
    """Whether the pass running now checkpoints (set by `active`)."""


def install(model: nn.Module, layers: nn.ModuleList, mode: Mode, min_tokens: int) -> None:
    """Wrap each of `layers`' forward; `mode` off installs nothing, on checkpoints every pass, auto the passes of
    at least `min_tokens` padded tokens."""
    if mode == "off":
        return
    state = Recompute(0 if mode == "on" else min_tokens)
    for layer in layers:
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if state.enabled and torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward  # an instance attribute: nn.Module.__call__ (and FSDP2's hooks) call it
    setattr(model, _ATTR, state)


def installed(model: nn.Module) -> Recompute | None:
    return getattr(model, _ATTR, None)


@contextmanager
def active(model: nn.Module, n_tokens: int) -> Iterator[bool]:
    """Within it, the model's layers checkpoint if recompute is installed and the pass is long enough; yields
    whether they do."""
    state = installed(model)
    on = state is not None and n_tokens >= state.min_tokens
    if state is None:
        yield False
        return
    state.enabled = on
    try:
        yield on
    finally:
        state.enabled = False
