"""Where a step's numbers go: a tqdm bar, `metrics.jsonl` (one JSON object per step) and TensorBoard.

Only rank 0 logs; other ranks get a sink that does nothing (`enabled=False`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

BAR_KEYS = ("reward_mean", "loss", "groups_accepted", "groups_filtered", "step_time_s")


class MetricsSink:
    def __init__(
        self,
        out_dir: str | Path,
        enabled: bool = True,
        total_steps: int | None = None,
        tensorboard: bool = True,
    ) -> None:
        self.enabled = enabled
        self.jsonl_path = Path(out_dir) / "metrics.jsonl"
        self._file = None
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.jsonl_path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tb"))
        self._bar = tqdm(total=total_steps or None, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            self._bar.set_postfix({k: f"{metrics[k]:.4g}" for k in BAR_KEYS if k in metrics}, refresh=False)
            self._bar.update(1)

    def note(self, message: str) -> None:
        """A line above the bar (waiting for groups, a renew that failed, ...)."""
        if self.enabled:
            tqdm.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
