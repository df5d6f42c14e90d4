"""`load_like`: a publish's weights copied into the served model's structure (or a retired model), the same model
`from_pretrained` would give; anything else is loaded whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.weights import load_like, load_model
from tests.engine.conftest import perturbed

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


@pytest.fixture(scope="module")
def published(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model moved by a 'training step', saved as the trainer exports it."""
    return perturbed(tiny_model_dir, tmp_path_factory.mktemp("published"), 3)


def test_same_model_as_a_whole_load(tiny_model_dir: Path, published: Path) -> None:
    served = load_model(tiny_model_dir)
    before = logits(served)
    new = load_like(served, published)
    assert new is not served and not new.training
    assert torch.equal(logits(new), logits(load_model(published)))
    assert torch.equal(logits(served), before)  # the served model is untouched while it keeps serving
    if served.config.tie_word_embeddings:
        assert new.lm_head.weight.data_ptr() == new.model.embed_tokens.weight.data_ptr()


def test_into_a_retired_model(tiny_model_dir: Path, published: Path) -> None:
    served, retired = load_model(published), load_model(tiny_model_dir)
    new = load_like(served, tiny_model_dir, into=lambda: retired)
    assert new is retired
    assert torch.equal(logits(new), logits(load_model(tiny_model_dir)))
    back = load_like(new, published, into=lambda: served)  # and back, into the other buffer
    assert back is served and torch.equal(logits(back), logits(load_model(published)))
    # The served model itself is never a buffer: a copy is made instead.
    assert load_like(served, tiny_model_dir, into=lambda: served) is not served


def test_a_trainer_export_takes_the_fast_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer exports with `use_cache` off (and its own transformers version): still the same model."""
    served, retired = load_model(tiny_model_dir), load_model(tiny_model_dir)
    export = tmp_path / "export"
    shutil.copytree(tiny_model_dir, export)
    config = json.loads((export / "config.json").read_text())
    config.update(use_cache=False, transformers_version="0.0.1")
    (export / "config.json").write_text(json.dumps(config))
    assert load_like(served, export, into=lambda: retired) is retired


def test_a_checkpoint_that_does_not_fit_leaves_the_retired_model_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    served = load_model(tiny_model_dir)
    asked: list[int] = []
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (other / "config.json").write_text(json.dumps(config))
    load_like(served, other, into=lambda: asked.append(1) or None)
    assert asked == []  # the retired model was not taken (the caller keeps it for the next update)


def test_the_index_names_the_files(tiny_model_dir: Path, tmp_path: Path, published: Path) -> None:
    """A stray safetensors file beside the checkpoint is not read: `from_pretrained` reads model.safetensors (or
    the index's shards), and so does the fast path."""
    served = load_model(tiny_model_dir)
    folder = tmp_path / "stray"
    shutil.copytree(tiny_model_dir, folder)
    shutil.copy(published / "model.safetensors", folder / "model-old.safetensors")
    assert torch.equal(logits(load_like(served, folder)), logits(load_model(tiny_model_dir)))


def test_another_model_is_loaded_whole(tiny_model_dir: Path, tmp_path: Path) -> None:
    served = load_model(tiny_model_dir)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # changes what the model computes, and no tensor's shape
    (other / "config.json").write_text(json.dumps(config))
    new = load_like(served, other)
    assert new.config.rms_norm_eps == 0.5
    assert torch.equal(logits(new), logits(load_model(other)))
    assert not torch.equal(logits(new), logits(served))


def test_a_missing_untied_tensor_is_not_kept_from_the_served_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    served = load_model(tiny_model_dir)
    part = tmp_path / "part"
    shutil.copytree(tiny_model_dir, part)
    (shard,) = part.glob("*.safetensors")
    tensors = load_file(str(shard))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    new = load_like(served, part)
    # Whatever a whole load makes of it (its own initialisation), not the served model's values passed off as
    # the checkpoint's.
    assert not torch.equal(new.get_parameter(name), served.get_parameter(name))
