"""The reward curve of a run, from its `metrics.jsonl`, as a PNG (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_rewards(jsonl_path: str | Path, png_path: str | Path) -> Path | None:
    """Reward mean per step with a +/- std band; None when the log has no reward yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, means, stds = [], [], []
    for line in Path(jsonl_path).read_text().splitlines():
        rec = json.loads(line)
        if "reward_mean" in rec:
            steps.append(rec["step"])
            means.append(rec["reward_mean"])
            stds.append(rec.get("reward_std", 0.0))
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, means, marker="o", ms=3, label="reward mean")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(means, stds, strict=True)],
        [m + s for m, s in zip(means, stds, strict=True)],
        alpha=0.2,
        label="± std",
    )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("session reward")
    ax.set_title("rollway: reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
