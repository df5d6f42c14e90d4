"""The trainer's optional trackers (trainer/tracking.py): W&B offline writes its run files with no network, and
MLflow with a local file store holds every logged step; both off by default. With the real packages when
installed (`pip install 'rollway[wandb]' 'rollway[mlflow]'`), skipped otherwise; the message for a tracker
asked for but not installed needs neither."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainer.config import TrainConfig
from trainer.metrics import MetricsSink
from trainer.tracking import tracking_for

STEPS = [{"loss": 0.5, "reward_mean": 0.1, "tokens_per_s": 900.0},
         {"loss": 0.25, "reward_mean": 0.3, "tokens_per_s": 950.0, "nan_metric": float("nan")},
         {"loss": 0.125, "reward_mean": 0.6, "tokens_per_s": 1000.0}]


def _cfg(tmp_path: Path, **kw: object) -> TrainConfig:
    return TrainConfig(gateway="http://127.0.0.1:9", model="m", out=str(tmp_path / "run1"), **kw)  # type: ignore[arg-type]


def _log(cfg: TrainConfig) -> None:
    sink = MetricsSink(cfg.out, tensorboard=False, tracking=tracking_for(cfg))
    for step, m in enumerate(STEPS, 1):
        sink.log(step, m)
    sink.close()


def test_off_by_default_and_only_on_rank_0(tmp_path: Path) -> None:
    assert tracking_for(_cfg(tmp_path)) == []
    assert tracking_for(_cfg(tmp_path, mlflow_tracking_uri=str(tmp_path / "ml")), enabled=False) == []


def test_a_tracker_not_installed_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(RuntimeError, match=r"pip install 'rollway\[wandb\]'"):
        tracking_for(_cfg(tmp_path, wandb_project="p"))
    with pytest.raises(RuntimeError, match=r"pip install 'rollway\[mlflow\]'"):
        tracking_for(_cfg(tmp_path, mlflow_tracking_uri=str(tmp_path / "ml")))
    from trainer.launch import main

    # `rollway train` refuses before torchrun starts, with the same words
    assert main(["--gateway", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "o"),
                 "--wandb-project", "p"]) == 2
    assert "wandb_project is set but wandb is not installed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="wandb_mode"):
        _cfg(tmp_path, wandb_mode="sometimes").validate()


def test_wandb_offline_writes_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, wandb_project="rollway-test", wandb_mode="offline")
    _log(cfg)
    [run] = (Path(cfg.out) / "wandb").glob("offline-run-*")
    [data] = run.glob("run-*.wandb")
    # W&B's transaction log (what `wandb sync` uploads): each history row's keys and JSON values in protobuf
    raw = data.read_bytes()
    assert raw.startswith(b":W&B")
    for key, value in (("loss", "0.125"), ("reward_mean", "0.6"), ("tokens_per_s", "950"), ("_step", "3")):
        assert key.encode() in raw and value.encode() in raw, (key, value)
    assert b"rollway-test" in raw and b"admin_key" not in raw and b"nan_metric" not in raw

def test_mlflow_local_store_holds_every_step(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    cfg = _cfg(tmp_path, mlflow_tracking_uri=str(store), mlflow_experiment="exp", run_name="seed0")
    _log(cfg)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store.resolve() / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "seed0" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (1, 0.5), (2, 0.25), (3, 0.125)]
    assert len(client.get_metric_history(run.info.run_id, "nan_metric")) == 0  # not finite: not logged
    assert run.data.params["groups_per_step"] == str(cfg.groups_per_step) and "admin_key" not in run.data.params
