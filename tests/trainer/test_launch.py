"""`rollway train` through trainer.launch.main: config checks before any process starts, and a real
torchrun run with two gloo ranks against the fake gateway."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.trainer.trainer_fakes import FakeGateway, make_group
from trainer.fsdp import free_port
from trainer.launch import main, prepare


def test_prepare_writes_the_config_and_the_command(tmp_path: Path) -> None:
    cfg, nproc, cmd, env = prepare(
        [
            "--gateway",
            "http://gw",
            "--model",
            "m",
            "--out",
            str(tmp_path / "o"),
            "--nproc=2",
            "--admin-key",
            "secret",
            "--lr",
            "2e-6",
        ]
    )
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    assert (
        cfg.out == str(tmp_path / "o") and nproc == 2 and written["lr"] == 2e-6 and "admin_key" not in written
    )
    assert env["ROLLWAY_ADMIN_KEY"] == "secret"
    assert cmd[1:] == [
        "-m",
        "trainer.torchrun",  # torch.distributed.run without the traceback of a stop
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "trainer.train",
        "--config",
        str(tmp_path / "o" / "config.json"),
    ]


def test_bad_option_or_gateway_fails_before_torchrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--gateway", "http://gw", "--model", "m", "--out", str(tmp_path), "--lr-max", "1"]) == 2
    assert "unknown option --lr-max" in capsys.readouterr().err
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--gateway", url, "--model", "m", "--out", str(tmp_path)]) == 2
    assert f"gateway {url} unreachable" in capsys.readouterr().err


def test_torchrun_two_ranks(tiny_model: Path, tmp_path: Path) -> None:
    rng = random.Random(3)
    gw = FakeGateway([make_group(f"g{i}", [1.0, 0.0, float(i % 2)], rng) for i in range(6)])
    try:
        rc = main(
            [
                "--gateway",
                gw.url,
                "--model",
                str(tiny_model),
                "--out",
                str(tmp_path / "o"),
                "--nproc",
                "2",
                "--steps",
                "2",
                "--groups-per-step",
                "3",
                "--wait-seconds",
                "0",
                "--micro-batch-tokens",
                "32",
            ]
        )
    finally:
        gw.close()
    assert rc == 0
    assert [p["version"] for p in gw.calls_to("/v1/weights")] == [1, 2]
    records = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_accepted"] for r in records] == [3, 3]
    assert Path(gw.model_path or "").joinpath("model.safetensors").is_file()
