"""The config: a file, then overrides; a wrong option fails at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config, parse_overrides


def test_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "train.toml"
    f.write_text('[train]\ngateway = "http://x"\nmodel = "m"\nlr = 1e-5\nloss_agg = "seq_mean"\n')
    cfg = load_config(f, parse_overrides(["--lr=3e-6", "--groups-per-step", "4", "--adv-std-norm"]))
    assert cfg.lr == 3e-6 and cfg.groups_per_step == 4 and cfg.adv_std_norm is True
    assert cfg.loss_agg == "seq_mean" and cfg.gateway == "http://x"
    assert "admin_key" not in cfg.to_json()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"learning_rate": "1"}, "unknown option --learning-rate"),
        ({"loss_agg": "mean"}, "not one of"),
        ({"groups_per_step": "many"}, "groups_per_step: expected an int, got 'many'"),
        ({"dynamic_filter": "maybe"}, "expected a bool"),
        ({"groups_per_step": "0"}, "groups_per_step must be >= 1"),
    ],
)
def test_wrong_options_fail_at_load(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, {"gateway": "http://x", "model": "m", **overrides})


def test_json_file_unknown_key(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text('{"gateway": "http://x", "model": "m", "clip": 0.2}')
    with pytest.raises(ValueError, match="unknown option 'clip'"):
        load_config(f)


def test_rl_needs_a_gateway() -> None:
    with pytest.raises(ValueError, match="needs --gateway"):
        load_config(None, {"model": "m"})
    assert load_config(None, {"model": "m", "mode": "sft", "sft_data": "x.jsonl"}).mode == "sft"
    assert load_config(None, {"gateway": "g", "model": "m", "sft_min_reward": "none"}).sft_min_reward is None
