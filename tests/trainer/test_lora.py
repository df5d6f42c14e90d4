"""LoRA in the trainer: only the adapter trains (base frozen) under FSDP2, the published folder is PEFT's (it loads
in PEFT and in the CPU engine with the same logits), and a checkpoint holds and restores the adapter only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from engine.lora import LoRAManager, read_adapter
from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import TrainConfig
from trainer.fsdp import DistInfo, init_distributed, shard_model
from trainer.lora import ADAPTER_FILES, export_adapter, inject, publish_path

CFG = TrainConfig(gateway="http://x", model="m", lora_rank=4, lora_targets="q_proj,v_proj,o_proj")
IDS = torch.tensor([[5, 9, 42, 7, 100, 3]])


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _model(src: Path, info: DistInfo, wrap: bool) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.use_cache = False
    return shard_model(inject(model, CFG, str(src)), info, wrap_one_cpu_rank=wrap)


def _step(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=IDS).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("wrap", [True, False])
def test_only_the_adapter_trains_and_its_folder_loads_in_peft_and_the_engine(
    dist_env: None, tiny_model: Path, tmp_path: Path, wrap: bool
) -> None:
    info = init_distributed(force_cpu=True)
    model = _model(tiny_model, info, wrap)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    _step(model)
    after = {n: _full(p).detach() for n, p in model.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)  # base frozen
    assert any(not torch.equal(before[n], after[n]) for n in trainable if "lora_B" in n)

    dest = export_adapter(model, CFG, str(tiny_model), tmp_path / "adapters" / "v000001")
    assert sorted(p.name for p in dest.iterdir()) == sorted(ADAPTER_FILES)
    assert publish_path(dest) == f"lora:{dest}"
    config = json.loads((dest / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    size = sum(p.stat().st_size for p in dest.iterdir())
    base_size = sum(p.stat().st_size for p in tiny_model.glob("*.safetensors"))
    assert size < base_size / 20
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        plain = base(input_ids=IDS).logits
        peft = PeftModel.from_pretrained(base, dest).eval()
        theirs = peft(input_ids=IDS).logits
        assert not torch.allclose(ours, plain, atol=1e-4)  # the adapter changes the model
        assert torch.allclose(ours, theirs, atol=1e-5)
        served = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        manager = LoRAManager(["q_proj", "v_proj", "o_proj"], max_lora_rank=8, max_loaded=None)
        manager.wrap(served)
        manager.select([read_adapter("v1", dest)])
        assert torch.allclose(served(input_ids=IDS).logits, ours, atol=1e-5)


def test_checkpoint_holds_and_restores_the_adapter_only(dist_env: None, tiny_model: Path, tmp_path: Path) -> None:
    info = init_distributed(force_cpu=True)
    model = _model(tiny_model, info, True)
    _step(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=IDS).logits.sum().backward()
    opt.step()
    save_checkpoint(model, opt, tmp_path / "ck", step=4, version=9, keep=2, trainable_only=True)
    ckpt = latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # no base weights
    fresh = _model(tiny_model, info, True)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    assert load_checkpoint(fresh, fresh_opt, ckpt, trainable_only=True) == (4, 9)
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(_full(p), _full(q)), n
    s1, s2 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert s1 and all(torch.equal(_full(s1[i]["exp_avg"]), _full(s2[i]["exp_avg"])) for i in s1)
