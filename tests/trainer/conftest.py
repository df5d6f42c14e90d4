"""Fixtures for the trainer tests (fakes in trainer_fakes.py). Run: pytest tests/trainer -q"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer.trainer_fakes import make_tiny_model
from trainer.fsdp import free_port, shutdown


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def dist_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A world of one in this process (torchrun's variables); the process group is destroyed after."""
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    shutdown()
