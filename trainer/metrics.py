"""Where a step's numbers go: a tqdm bar, `metrics.jsonl` (one JSON object per step), TensorBoard, and the
optional trackers (W&B, MLflow: trainer/tracking.py).

Only rank 0 logs; other ranks get a sink that does nothing (`enabled=False`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from trainer.tracking import Tracker

BAR_KEYS = ("reward_mean", "loss", "groups_accepted", "groups_filtered", "step_time_s")


@dataclass(frozen=True)
class BarTarget:
    """A run that stops when a measured metric reaches a value: its bar shows that metric against the value
    (`match 0.085/0.120`), because the step total is only a ceiling such a run usually stops well short of."""

    key: str
    """The metric, as logged (e.g. "probe_match"); measured only on some steps."""
    value: float
    """Reaching it stops the run; the bar's total."""
    label: str
    """What the bar calls it."""

    def describe(self, latest: float | None) -> str:
        # "-" until the first measurement: a 0.000 would read as a measured zero
        shown = "-" if latest is None else f"{latest:.3f}"
        return f"{self.label} {shown}/{self.value:.3f}"


class MetricsSink:
    def __init__(
        self,
        out_dir: str | Path,
        enabled: bool = True,
        total_steps: int | None = None,
        tensorboard: bool = True,
        target: BarTarget | None = None,
        tracking: Sequence[Tracker] = (),
    ) -> None:
        self.enabled = enabled
        self.trackers = list(tracking) if enabled else []
        self.total_steps = total_steps
        self.target = target
        self._latest: float | None = None
        self._refreshed = 0.0
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
        if target is None:
            self._bar = tqdm(total=total_steps or None, desc="train", unit="step", dynamic_ncols=True)
        else:
            # No rate or ETA: "match per second" means nothing; the step count goes in the postfix.
            self._bar = tqdm(
                total=target.value,
                desc=target.describe(None),
                bar_format="{desc} |{bar}| {elapsed}{postfix}",
                dynamic_ncols=True,
            )

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        for tracker in self.trackers:
            tracker.log(step, metrics)
        if self._bar is not None:
            shown = {k: f"{metrics[k]:.4g}" for k in BAR_KEYS if k in metrics}
            if self.target is None:
                self._bar.set_postfix(shown, refresh=False)
                if self._bar.n == 0 and step > 1:
                    # a run resumed from a checkpoint: its bar starts at that step, and the steps done before
                    # the restart do not count toward the rate
                    self._bar.n = self._bar.last_print_n = self._bar.initial = step - 1
                self._bar.update(step - self._bar.n)
            else:
                self._log_target(step, metrics, shown)

    def _log_target(self, step: int, metrics: dict[str, float | int], shown: dict[str, str]) -> None:
        assert self.target is not None and self._bar is not None
        measured = self.target.key in metrics
        if measured:
            self._latest = float(metrics[self.target.key])
            # n is clamped to the total: tqdm warns on a fraction above 1; the description keeps the true value
            self._bar.n = min(max(self._latest, 0.0), self.target.value)
            self._bar.set_description_str(self.target.describe(self._latest), refresh=False)
        steps = f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")
        self._bar.set_postfix_str(", ".join([steps, *(f"{k}={v}" for k, v in shown.items())]), refresh=False)
        # n no longer counts steps, so tqdm's own update() throttling does not apply: redraw on a new
        # measurement, else at most every mininterval seconds
        now = time.monotonic()
        if measured or now - self._refreshed >= self._bar.mininterval:
            self._refreshed = now
            self._bar.refresh()

    def bar_text(self) -> str:
        """The bar's line as it would be drawn now ("" on a disabled sink)."""
        return str(self._bar) if self._bar is not None else ""

    def note(self, message: str) -> None:
        """A line above the bar (waiting for groups, a renew that failed, ...)."""
        if self.enabled:
            tqdm.write(message)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
