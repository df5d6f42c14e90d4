"""The reward curve of a run, from its `metrics.jsonl`, as a PNG (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def read_eval(path: str | Path | None) -> list[tuple[int, float, float | None, str]]:
    """(version, mean reward, pass@k, "pass@k") per line of an eval log (`rollway rollout --eval-log`)."""
    if not path or not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        key = next((k for k in rec if k.startswith("pass@")), "")
        out.append((int(rec["version"]), float(rec["eval_mean_reward"]), rec.get(key), key))
    return out


def plot_rewards(
    jsonl_path: str | Path, png_path: str | Path, eval_path: str | Path | None = None
) -> Path | None:
    """Reward mean per step with a +/- std band, and the held-out eval per weight version when an eval log
    is given (version v is the weights after step v); None when the log has no reward yet."""
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
    evals = read_eval(eval_path)
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "s--", color="tab:green", label="held-out mean reward")
        with_pass = [e for e in evals if e[2] is not None and e[3] != "pass@1"]  # pass@1 = the mean for k = 1
        if with_pass:
            ax.plot([e[0] for e in with_pass], [float(e[2] or 0.0) for e in with_pass], "^:", color="tab:red",
                    label=f"held-out {with_pass[0][3]}")
    ax.set_xlabel("trainer step (= weight version)")
    ax.set_ylabel("session reward")
    ax.set_title("rollway: reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
