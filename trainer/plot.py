"""The reward curve of a run, from its `metrics.jsonl`, as a PNG (matplotlib, Agg: no display needed).

What is drawn, and why:
- each step's mean session reward as a faint point: with 64 sessions a step it is noisy, so the line is a
  centred rolling mean pooled over the sessions of the steps around it;
- a 95% confidence band of that smoothed mean, not mean +/- std: for 0/1 rewards the std is ~0.5 and the
  band would cover values a reward can never take. For rewards within [0, 1] the band is Wilson's interval
  (inside [0, 1] by construction); for other rewards the normal interval of the pooled mean. Sessions are
  counted as independent draws; the sessions of one group share a prompt, so the true interval is somewhat
  wider. Without per-step session counts (`reward_n`, older logs) no band is drawn rather than a made-up one;
- held-out evals as markers only: each is one measurement of one weight version, and a line between two of
  them would claim values nobody measured;
- the x axis: trainer step, wall-clock time since the run started, or both (two panels): the steps of an
  asynchronous run are not evenly spaced in time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

XAxis = Literal["step", "time", "both"]
Z95 = 1.959963984540054  # the two-sided 95% normal quantile


@dataclass(frozen=True)
class EvalPoint:
    """One line of an eval log (`rollway rollout --eval-log`, the demo's eval.jsonl)."""

    version: int
    mean_reward: float
    pass_k: float | None
    k_key: str
    """e.g. "pass@4"; "" when the line has none."""
    time: float | None
    """Wall clock (Unix seconds) when it was measured; None in logs written before it was recorded."""


@dataclass(frozen=True)
class StepPoint:
    """The reward figures of one trainer step, from metrics.jsonl."""

    step: int
    mean: float
    std: float | None
    n: int | None
    """Session rewards behind the mean."""
    time: float | None
    """Wall clock (Unix seconds) when the step was logged."""
    version: int | None


@dataclass(frozen=True)
class Smoothed:
    mean: list[float]
    lo: list[float] | None
    hi: list[float] | None
    """The 95% band; None when the session counts are unknown."""
    window: int
    band: str
    """How the band was computed ("Wilson", "normal"), for the legend."""


def read_eval(path: str | Path | None) -> list[EvalPoint]:
    """The eval log's lines in order; [] when there is no log."""
    if not path or not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        key = next((k for k in rec if k.startswith("pass@")), "")
        t = rec.get("time")
        out.append(
            EvalPoint(
                int(rec["version"]),
                float(rec["eval_mean_reward"]),
                rec.get(key),
                key,
                float(t) if t is not None else None,
            )
        )
    return out


def read_steps(path: str | Path) -> list[StepPoint]:
    """Steps that carry a reward, in step order. A step logged twice (a run resumed from a checkpoint older
    than its last logged step redoes the steps after it) keeps its last record: the one the run went on from."""
    by_step: dict[int, StepPoint] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "reward_mean" not in rec:
            continue
        std, n, t, v = (rec.get(k) for k in ("reward_std", "reward_n", "time", "version"))
        by_step[int(rec["step"])] = StepPoint(
            int(rec["step"]),
            float(rec["reward_mean"]),
            float(std) if std is not None else None,
            int(n) if n is not None else None,
            float(t) if t is not None else None,
            int(v) if v is not None else None,
        )
    return [by_step[s] for s in sorted(by_step)]


def wilson(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion p observed over n trials (within [0, 1] for any p in it)."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def within_unit_interval(points: list[StepPoint]) -> bool:
    """Whether the rewards look bounded by [0, 1]: every mean is, and no step's std exceeds what such rewards
    allow (at most sqrt(m (1 - m)) for mean m, reached by 0/1 rewards)."""
    eps = 1e-9
    for p in points:
        if not -eps <= p.mean <= 1 + eps:
            return False
        if p.std is not None and p.std * p.std > p.mean * (1 - p.mean) + 1e-6:
            return False
    return True


def default_window(n_steps: int) -> int:
    """An odd window of about a tenth of the run: smooth enough to read, short enough to follow a trend."""
    return 2 * max(1, round(n_steps / 20)) + 1 if n_steps >= 5 else 1


def smooth(points: list[StepPoint], window: int) -> Smoothed:
    """Centred rolling mean over `window` steps (fewer at the ends), each step weighted by its session count
    (equal weights when unknown), with its 95% band."""
    half = max(0, window - 1) // 2
    counted = all(p.n is not None and p.n > 0 for p in points)
    bounded = within_unit_interval(points)
    means, los, his = [], [], []
    for i in range(len(points)):
        win = points[max(0, i - half) : i + half + 1]
        weights = [float(p.n) if counted and p.n is not None else 1.0 for p in win]
        total = sum(weights)
        m = sum(w * p.mean for w, p in zip(weights, win, strict=True)) / total
        means.append(m)
        if not counted:
            continue
        if bounded:
            lo, hi = wilson(min(max(m, 0.0), 1.0), total)
        else:
            # law of total variance over the window's steps; a step without a std adds only its mean's spread
            pairs = zip(weights, win, strict=True)
            var = sum(w * ((p.std or 0.0) ** 2 + (p.mean - m) ** 2) for w, p in pairs)
            half_width = Z95 * math.sqrt(var / total / total)
            lo, hi = m - half_width, m + half_width
        los.append(lo)
        his.append(hi)
    return Smoothed(
        means,
        los if counted else None,
        his if counted else None,
        2 * half + 1,
        "Wilson" if bounded else "normal",
    )


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot is imported: no display needed, none picked up
    import matplotlib.pyplot as plt

    return plt


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s <= 180:
        return 1.0, "seconds"
    if span_s <= 180 * 60:
        return 60.0, "minutes"
    return 3600.0, "hours"


def draw_rewards(
    points: list[StepPoint], evals: list[EvalPoint], x: XAxis = "both", window: int | None = None
) -> Figure:
    """The figure plot_rewards saves. x="time" needs wall-clock times in the metrics (every MetricsSink row
    has one); with x="both" a log without them gets the step panel only."""
    plt = _pyplot()
    if not points:
        raise ValueError("no step with a reward to plot")
    has_time = all(p.time is not None for p in points)
    if x == "time" and not has_time:
        raise ValueError("x='time': the metrics rows carry no wall-clock 'time'")
    axes_wanted: list[Literal["step", "time"]] = (
        ["step", "time"] if x == "both" and has_time else ["time"] if x == "time" else ["step"]
    )
    sm = smooth(points, window if window is not None else default_window(len(points)))
    fig, axs = plt.subplots(
        len(axes_wanted), 1, figsize=(8, 1 + 3.3 * len(axes_wanted)), sharey=True, squeeze=False,
        layout="constrained",
    )  # fmt: skip
    for ax, kind in zip(axs[:, 0], axes_wanted, strict=True):
        _panel(ax, kind, points, evals, sm)
    axs[0, 0].set_title("rollway: session reward")
    # one legend above the panels: inside them it would cover points wherever the curve goes
    handles, labels = axs[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=2, fontsize=8, frameon=False)
    return fig


def _panel(
    ax: Axes, kind: Literal["step", "time"], points: list[StepPoint], evals: list[EvalPoint], sm: Smoothed
) -> None:
    if kind == "step":
        xs = [float(p.step) for p in points]
        # version v is the weights after step v - (version - step), the offset the run started at
        offset = next((p.version - p.step for p in points if p.version is not None), 0)
        ex = [(float(e.version - offset), e) for e in evals]
        ax.set_xlabel("trainer step (eval: at the weight version it measured)")
    else:
        times = [p.time for p in points if p.time is not None] + [e.time for e in evals if e.time is not None]
        t0 = min(times)
        scale, unit = _time_unit(max(times) - t0)
        xs = [((p.time or t0) - t0) / scale for p in points]
        ex = [((e.time - t0) / scale, e) for e in evals if e.time is not None]
        ax.set_xlabel(f"wall-clock {unit} since the run started")

    n_note = ""
    if all(p.n is not None for p in points):
        ns = sorted({p.n or 0 for p in points})
        n_note = f", {ns[0]} sessions" if len(ns) == 1 else f", {ns[0]}-{ns[-1]} sessions"
    ax.plot(xs, [p.mean for p in points], "o", ms=2.5, color="tab:blue", alpha=0.35,
            label=f"mean reward of a step{n_note}")  # fmt: skip
    if sm.lo is not None and sm.hi is not None:
        ax.fill_between(xs, sm.lo, sm.hi, color="tab:blue", alpha=0.18, lw=0,
                        label=f"95% CI of the smoothed mean ({sm.band})")  # fmt: skip
    ax.plot(xs, sm.mean, "-", lw=2, color="tab:blue", label=f"smoothed: mean over {sm.window} steps")

    if ex:
        greedy = " (greedy)" if all(e.k_key == "pass@1" for _, e in ex) else ""  # run_eval: k = 1 is greedy
        ax.plot([x for x, _ in ex], [e.mean_reward for _, e in ex], marker="s", linestyle="None", ms=7,
                color="tab:green", mec="black", mew=0.6, label=f"held-out mean reward{greedy}")  # fmt: skip
        # pass@1 is the mean itself (one sample a task)
        with_pass = [(x, e) for x, e in ex if e.pass_k is not None and e.k_key not in ("", "pass@1")]
        if with_pass:
            ax.plot([x for x, _ in with_pass], [float(e.pass_k or 0.0) for _, e in with_pass], marker="^",
                    linestyle="None", ms=7, color="tab:red", mec="black", mew=0.6,
                    label=f"held-out {with_pass[0][1].k_key}")  # fmt: skip
        if len(ex) <= 12:  # few measurements: their values are worth reading off
            for x, e in ex:
                ax.annotate(f"{e.mean_reward:.2f}", (x, e.mean_reward), textcoords="offset points",
                            xytext=(0, 8), ha="center", fontsize=8, color="tab:green",
                            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})  # fmt: skip
    if within_unit_interval(points) and all(0 <= e.mean_reward <= 1 for e in evals):
        ax.set_ylim(-0.03, 1.05)  # the whole range a reward can take, so runs compare at a glance
    ax.set_ylabel("session reward")
    ax.grid(alpha=0.3)


def plot_rewards(
    jsonl_path: str | Path,
    png_path: str | Path,
    eval_path: str | Path | None = None,
    x: XAxis = "both",
    window: int | None = None,
) -> Path | None:
    """The reward plot of a run (see the module docstring) as a PNG; None when the log has no reward yet.
    x: "step", "time" (wall clock since the run started) or "both" (two panels, the default)."""
    points = read_steps(jsonl_path)
    if not points:
        return None
    fig = draw_rewards(points, read_eval(eval_path), x=x, window=window)
    png = Path(png_path)
    fig.savefig(png, dpi=120)
    _pyplot().close(fig)
    return png
