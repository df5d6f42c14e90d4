"""The reward plot: steps from metrics.jsonl, held-out evals per weight version from an eval log."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.plot import plot_rewards, read_eval


def test_plot_draws_rewards_and_the_eval_log(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "reward_mean": i / 10, "reward_std": 0.1}) + "\n"
                               for i in range(1, 6)))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"version": 0, "eval_mean_reward": 0.1, "pass@4": 0.3, "n_tasks": 9}) + "\n"
                     + json.dumps({"version": 5, "eval_mean_reward": 0.4, "pass@4": 0.7, "n_tasks": 9}) + "\n")
    assert read_eval(evals) == [(0, 0.1, 0.3, "pass@4"), (5, 0.4, 0.7, "pass@4")]
    assert read_eval(tmp_path / "missing.jsonl") == []
    png = plot_rewards(metrics, tmp_path / "r.png", evals)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_rewards(metrics, tmp_path / "s.png") is not None  # without an eval log


def test_no_reward_yet_gives_no_plot(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    assert plot_rewards(metrics, tmp_path / "r.png") is None
