"""Fixtures for the trainer tests (fakes in trainer_fakes.py). Run: pytest tests/trainer -q"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.trainer_fakes import make_tiny_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
