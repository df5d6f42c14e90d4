"""The reward plot: steps from metrics.jsonl, held-out evals per weight version from an eval log. The tests
look at what is drawn (matplotlib's artists), not only that a PNG is written."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.lines import Line2D

from trainer.plot import (
    EvalPoint,
    StepPoint,
    draw_rewards,
    plot_rewards,
    read_eval,
    read_steps,
    smooth,
    wilson,
)

T0 = 1_700_000_000.0


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _binary_run(tmp_path: Path, n_steps: int = 30, n: int = 16) -> Path:
    """0/1 rewards: step means swinging between 0 and 1 with their std (sqrt(m (1 - m))), so mean +/- std
    leaves [0, 1] on almost every step. Steps are 10 s apart after a 60 s start."""
    rows = []
    for s in range(1, n_steps + 1):
        m = [0.0, 0.0625, 0.5, 0.9375, 1.0][s % 5]
        rows.append({"step": s, "time": T0 + 60 + 10 * s, "reward_mean": m, "reward_std": math.sqrt(m * (1 - m)),
                     "reward_n": n, "version": s, "loss": 0.1})  # fmt: skip
    return _write(tmp_path / "metrics.jsonl", rows)


def _evals(tmp_path: Path) -> Path:
    return _write(tmp_path / "eval.jsonl", [
        {"version": 0, "eval_mean_reward": 0.1, "pass@4": 0.3, "n_tasks": 9, "time": T0},
        {"version": 30, "eval_mean_reward": 0.4, "pass@4": 0.7, "n_tasks": 9, "time": T0 + 400},
    ])  # fmt: skip


def _line(ax: Axes, label_start: str) -> Line2D:
    found = [ln for ln in ax.get_lines() if str(ln.get_label()).startswith(label_start)]
    assert len(found) == 1, [ln.get_label() for ln in ax.get_lines()]
    return found[0]


def _band(ax: Axes) -> PolyCollection:
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1, ax.collections
    return bands[0]


def test_read_eval_and_steps(tmp_path: Path) -> None:
    assert read_eval(_evals(tmp_path)) == [
        EvalPoint(0, 0.1, 0.3, "pass@4", T0),
        EvalPoint(30, 0.4, 0.7, "pass@4", T0 + 400),
    ]
    assert read_eval(tmp_path / "missing.jsonl") == []
    # a resumed run logs steps 2-3 again: the later records are the ones the run went on from
    _write(tmp_path / "m.jsonl", [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2},
                                  {"step": 3, "reward_mean": 0.3}, {"step": 1, "loss": 1.0},
                                  {"step": 2, "reward_mean": 0.5, "reward_n": 8}, {"step": 3, "reward_mean": 0.6}])  # fmt: skip
    got = read_steps(tmp_path / "m.jsonl")
    assert [(p.step, p.mean, p.n) for p in got] == [(1, 0.1, None), (2, 0.5, 8), (3, 0.6, None)]


def test_wilson_interval_matches_the_formula() -> None:
    # 0 successes in 10: the upper end is z^2 / (n + z^2)
    lo, hi = wilson(0.0, 10)
    assert lo == 0.0 and hi == pytest.approx(1.959964**2 / (10 + 1.959964**2), rel=1e-5)
    assert wilson(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson(1.0, 5)[1] == 1.0


def test_smoothing_pools_the_sessions_of_neighbouring_steps() -> None:
    pts = [StepPoint(1, 0.0, 0.0, 10, None, None), StepPoint(2, 1.0, 0.0, 30, None, None),
           StepPoint(3, 0.5, 0.5, 20, None, None)]  # fmt: skip
    sm = smooth(pts, 3)
    # step 1: steps 1-2 (40 sessions, 30 rewarded); step 2: all three (60 sessions, 40 rewarded)
    assert sm.mean == pytest.approx([30 / 40, 40 / 60, 40 / 50])
    assert sm.band == "Wilson" and sm.lo is not None and sm.hi is not None
    assert (sm.lo[1], sm.hi[1]) == pytest.approx(wilson(40 / 60, 60))
    # without session counts: equal weights and no band (none is better than a made-up one)
    bare = smooth([StepPoint(p.step, p.mean, None, None, None, None) for p in pts], 3)
    assert bare.mean == pytest.approx([0.5, 0.5, 0.75]) and bare.lo is None and bare.hi is None
    # rewards outside [0, 1]: the normal interval of the pooled mean, not Wilson's
    wide = smooth([StepPoint(1, 3.0, 2.0, 100, None, None)], 1)
    assert wide.band == "normal" and wide.lo is not None and wide.hi is not None
    assert (wide.lo[0], wide.hi[0]) == pytest.approx((3 - 1.959964 * 0.2, 3 + 1.959964 * 0.2), rel=1e-5)


def test_band_stays_within_the_rewards_range_for_binary_rewards(tmp_path: Path) -> None:
    fig = draw_rewards(read_steps(_binary_run(tmp_path)), [], x="step")
    ax = fig.axes[0]
    ys = _band(ax).get_paths()[0].vertices[:, 1]
    assert ys.min() >= 0.0 and ys.max() <= 1.0
    assert ys.max() - ys.min() < 0.6  # a CI of a mean over ~5 x 16 sessions, not the +/- 0.5 std band
    raw = _line(ax, "mean reward of a step")
    assert raw.get_linestyle() == "None"
    assert list(raw.get_ydata()) == [p.mean for p in read_steps(tmp_path / "metrics.jsonl")]
    smoothed = _line(ax, "smoothed")
    assert smoothed.get_linestyle() == "-"
    assert max(smoothed.get_ydata()) - min(smoothed.get_ydata()) < 0.2  # the 0..1 swings average out


def test_evals_are_markers_at_their_weight_version(tmp_path: Path) -> None:
    fig = draw_rewards(read_steps(_binary_run(tmp_path)), read_eval(_evals(tmp_path)), x="step")
    ax = fig.axes[0]
    ev = _line(ax, "held-out mean reward")
    assert ev.get_linestyle() == "None" and ev.get_marker() == "s"  # measured points, nothing in between
    assert list(ev.get_xdata()) == [0.0, 30.0] and list(ev.get_ydata()) == [0.1, 0.4]
    pass_k = _line(ax, "held-out pass@4")
    assert pass_k.get_linestyle() == "None" and list(pass_k.get_ydata()) == [0.3, 0.7]


def test_eval_x_follows_a_run_that_started_at_a_later_version(tmp_path: Path) -> None:
    rows = [{"step": s, "reward_mean": 0.5, "version": 100 + s} for s in range(1, 4)]
    _write(tmp_path / "m.jsonl", rows)
    evals = [EvalPoint(100, 0.2, None, "", None), EvalPoint(103, 0.3, None, "", None)]
    ax = draw_rewards(read_steps(tmp_path / "m.jsonl"), evals, x="step").axes[0]
    assert list(_line(ax, "held-out").get_xdata()) == [0.0, 3.0]


def test_time_axis_puts_steps_and_evals_at_their_wall_clock(tmp_path: Path) -> None:
    steps, evals = read_steps(_binary_run(tmp_path)), read_eval(_evals(tmp_path))
    ax = draw_rewards(steps, evals, x="time").axes[0]
    # 400 s in all: minutes, counted from the first thing that happened (the eval before training)
    assert "minutes" in ax.get_xlabel()
    step_x = list(_line(ax, "mean reward of a step").get_xdata())
    assert step_x == pytest.approx([(70 + 10 * i) / 60 for i in range(30)])
    assert list(_line(ax, "held-out mean reward").get_xdata()) == pytest.approx([0.0, 400 / 60])
    # both: the step panel over the time panel, sharing the reward axis
    both = draw_rewards(steps, evals)
    assert [a.get_xlabel().split()[0] for a in both.axes] == ["trainer", "wall-clock"]
    # a log without wall-clock times cannot have a time axis; "both" falls back to the step panel
    no_time = [StepPoint(p.step, p.mean, p.std, p.n, None, p.version) for p in steps]
    with pytest.raises(ValueError, match="wall-clock"):
        draw_rewards(no_time, evals, x="time")
    assert len(draw_rewards(no_time, evals).axes) == 1


def test_plot_writes_a_png_and_none_without_rewards(tmp_path: Path) -> None:
    png = plot_rewards(_binary_run(tmp_path), tmp_path / "r.png", _evals(tmp_path))
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "s.png", x="time") is not None  # no eval log
    _write(tmp_path / "loss.jsonl", [{"step": 1, "loss": 0.5}])
    assert plot_rewards(tmp_path / "loss.jsonl", tmp_path / "n.png") is None
