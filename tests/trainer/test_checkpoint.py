"""HF export (tied and untied embeddings) and the DCP checkpoint round trip, at world size 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.trainer_fakes import make_tiny_model
from trainer.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.fsdp import init_distributed, load_sharded_model


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's (FSDP2 over several ranks) or a plain one (one CPU rank is not wrapped)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t

def hf_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("tie", [True, False])
def test_export_round_trips(dist_env: None, tmp_path: Path, tie: bool) -> None:
    src = make_tiny_model(tmp_path / "src", seed=3, tie=tie)
    info = init_distributed(force_cpu=True)
    model = load_sharded_model(str(src), info)
    dest = export_hf(model, src, tmp_path / "weights" / "v000001")
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000001"]  # no temp dir left
    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tie  # tied: stored once, as the embedding
    a, b = hf_state(src), hf_state(dest)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (dest / "tokenizer.json").is_file() and (dest / "config.json").is_file()


def test_checkpoint_restores_model_optimizer_step_version(
    dist_env: None, tiny_model: Path, tmp_path: Path
) -> None:
    info = init_distributed(force_cpu=True)
    model = load_sharded_model(str(tiny_model), info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    for step in (1, 2, 3):
        save_checkpoint(model, opt, tmp_path / "ck", step=step, version=10 + step, keep=2)
    assert [p.name for p in sorted((tmp_path / "ck").iterdir())] == ["step_00000002", "step_00000003"]
    fresh = load_sharded_model(str(tiny_model), info)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt = latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None
    assert load_checkpoint(fresh, fresh_opt, ckpt) == (3, 13)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(_full(p), _full(q))
    s1, s2 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(_full(s1[i]["exp_avg"]), _full(s2[i]["exp_avg"])) for i in s1)
