"""Experiment trackers besides `metrics.jsonl` and TensorBoard: Weights & Biases and MLflow, each optional
(`pip install 'rollway[wandb]'`, `'rollway[mlflow]'`) and off unless configured:

- `wandb_project = "..."` logs every step's metrics to that W&B project; `wandb_mode = "offline"` (or
  WANDB_MODE=offline) writes the run under OUT/wandb with no network (`wandb sync OUT/wandb/offline-run-*`
  uploads it later).
- `mlflow_tracking_uri = "..."` logs them to MLflow: a folder (a local store, no server: DIR/mlflow.db, which
  `mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db` reads), any MLflow tracking URI (sqlite:///FILE,
  http(s)://host of a tracking server, ...); `mlflow_experiment` names the experiment.

Each run's config (the admin key never in it) goes with it as parameters. Only rank 0 logs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

from trainer.config import TrainConfig


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float | int]) -> None: ...

    def close(self) -> None: ...


def _missing(extra: str, option: str, e: ImportError) -> RuntimeError:
    return RuntimeError(f"{option} is set but {extra} is not installed ({e}): pip install 'rollway[{extra}]', "
                        f"or unset {option}")


def _params(cfg: TrainConfig) -> dict[str, Any]:
    return {k: v for k, v in json.loads(cfg.to_json()).items() if v not in (None, "")}


def _finite(metrics: dict[str, float | int]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))}


class WandbTracker:
    def __init__(self, cfg: TrainConfig) -> None:
        try:
            import wandb
        except ImportError as e:
            raise _missing("wandb", "wandb_project", e) from e
        out = Path(cfg.out)
        self._run = wandb.init(project=cfg.wandb_project, name=cfg.run_name or out.name, dir=str(out),
                               mode=cfg.wandb_mode or None, config=_params(cfg))

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        self._run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    def __init__(self, cfg: TrainConfig) -> None:
        try:
            import mlflow
        except ImportError as e:
            raise _missing("mlflow", "mlflow_tracking_uri", e) from e
        uri = cfg.mlflow_tracking_uri
        if "://" not in uri:  # a folder: a SQLite store in it (MLflow 3 refuses its older ./mlruns file store)
            folder = Path(uri).resolve()
            folder.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{folder / 'mlflow.db'}"
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        exp = self._client.get_experiment_by_name(cfg.mlflow_experiment)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(cfg.mlflow_experiment)
        self._run_id = self._client.create_run(exp_id, run_name=cfg.run_name or Path(cfg.out).name).info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in _params(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self._client.log_batch(self._run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in _finite(metrics).items()])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def check_installed(cfg: TrainConfig) -> None:
    """Raise (before any process starts: `rollway train`) when a tracker is asked for but not installed."""
    import importlib.util

    for option, module, extra in (("wandb_project", "wandb", "wandb"), ("mlflow_tracking_uri", "mlflow", "mlflow")):
        if getattr(cfg, option) and importlib.util.find_spec(module) is None:
            raise _missing(extra, option, ImportError(f"no module named {module!r}"))


def tracking_for(cfg: TrainConfig, enabled: bool = True) -> list[Tracker]:
    """The trackers `cfg` asks for (none by default; none on a rank other than 0: `enabled` False)."""
    if not enabled:
        return []
    trackers: list[Tracker] = []
    if cfg.wandb_project:
        trackers.append(WandbTracker(cfg))
    if cfg.mlflow_tracking_uri:
        trackers.append(MlflowTracker(cfg))
    return trackers
