"""The command line: one precedence (flag > ROLLWAY_* environment > config file > default), the admin key
found the same way by every command, and --help that shows defaults and names flags as flags."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.settings import Settings
from rollway.cli import main, parse_args
from rollway.embedded import free_port
from rollway.keys import admin_key, find_admin_key
from rollway.serve import settings_from_args
from trainer.config import load_config, parse_overrides

# --- rollway serve: flag > environment > default ---


def _settings(argv: list[str]) -> Settings:
    return Settings(**settings_from_args(parse_args(["serve", *argv])))


@pytest.mark.parametrize("env, argv, field, expected", [
    ({"ROLLWAY_BACKENDS": "http://a:1,http://b:2"}, [], "backends", ["http://a:1", "http://b:2"]),
    ({"ROLLWAY_BACKENDS": "http://a:1"}, ["--backend", "http://c:3"], "backends", ["http://c:3"]),
    ({"ROLLWAY_TOKENIZER": "/m"}, [], "tokenizer", "/m"),
    ({"ROLLWAY_DB": "sqlite:///x.db"}, [], "db", "sqlite:///x.db"),
    ({"ROLLWAY_PORT": "9001"}, [], "port", 9001),
    ({"ROLLWAY_PORT": "9001"}, ["--port", "9002"], "port", 9002),
    ({}, [], "port", 8000),
    ({"ROLLWAY_TOOL_PARSER": "llama3_json"}, [], "tool_parser", "llama3_json"),
    ({}, [], "tool_parser", "auto"),
    ({"ROLLWAY_REASONING_PARSER": "none"}, ["--reasoning-parser", "think"], "reasoning_parser", "think"),
    ({"ROLLWAY_DATA_DIR": "/d"}, [], "data_dir", Path("/d")),
    ({"ROLLWAY_MODEL": "/trained"}, [], "model", "/trained"),
])
def test_serve_precedence(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str], field: str,
                          expected: object) -> None:
    for k in list(os.environ):
        if k.startswith("ROLLWAY_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert getattr(_settings(argv), field) == expected


def test_serve_takes_its_backend_from_the_environment(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A real `rollway serve` with nothing but ROLLWAY_* variables: it binds ROLLWAY_PORT, uses the backend
    of ROLLWAY_BACKENDS (no embedded engine started) and the store of ROLLWAY_DB."""
    from tests.fakes.sglang import FakeSGLang

    fake = FakeSGLang().__enter__()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    env.update(ROLLWAY_BACKENDS=fake.url, ROLLWAY_TOKENIZER=str(tiny_model_dir), ROLLWAY_PORT=str(port),
               ROLLWAY_DB=f"sqlite:///{tmp_path / 'env.db'}", ROLLWAY_DATA_DIR=str(tmp_path / "data"),
               ROLLWAY_ADMIN_KEY="rw-admin-env")
    proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "serve"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "rollway serve did not answer on ROLLWAY_PORT"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/backends", headers={"Authorization": "Bearer rw-admin-env"})
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert [b["url"] for b in r.json()["data"]] == [fake.url]
        assert (tmp_path / "env.db").is_file()
        assert not (tmp_path / "data" / "tiny-model").exists()  # no embedded engine
    finally:
        proc.terminate()
        proc.wait(30)
        fake.__exit__(None, None, None)


# --- rollway train: flag > environment > config file > default ---


def test_train_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "train.toml"
    cfg_file.write_text('[train]\ngateway = "http://file"\nlr = 3e-5\nseed = 7\nsteps = 11\n')
    env = {"ROLLWAY_LR": "2e-5", "ROLLWAY_SEED": "8", "ROLLWAY_UNRELATED_THING": "x"}
    cfg = load_config(cfg_file, parse_overrides(["--lr", "1e-5"]), env)
    assert cfg.lr == 1e-5  # flag beats environment and file
    assert cfg.seed == 8  # environment beats file
    assert cfg.steps == 11  # file beats default
    assert cfg.groups_per_step == 8  # default
    assert cfg.gateway == "http://file"
    # The workers read the written config without the environment: what `rollway train` resolved stands.
    assert load_config(cfg_file, None, None).seed == 7


def test_train_bad_environment_value_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="environment: lr: expected a number"):
        load_config(None, {"gateway": "http://g"}, {"ROLLWAY_LR": "fast"})


def test_unknown_train_option_is_reported_as_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--gateway", "http://127.0.0.1:9", "--model", "m", "--learning-rate", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --learning-rate" in err
    assert "--groups-per-step" in err and "groups_per_step" not in err


def test_train_help_lists_launcher_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--nproc", "--config", "--data-dir", "--lr", "--groups-per-step", "ROLLWAY_"):
        assert flag in text
    assert "(default 1e-06)" in text or "(default 1e-6)" in text


@pytest.mark.parametrize("command", ["serve", "engine", "init-model", "rollout", "demo", "db"])
def test_help_shows_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "(default:" in text
    assert "(default: None)" not in text  # required options and "no default" say nothing instead


def test_serve_help_shows_the_settings_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000; env ROLLWAY_PORT)" in text
    assert "(default: auto; env ROLLWAY_TOOL_PARSER)" in text


# --- the admin key: environment, else DATA_DIR/admin_key, for every command ---


def test_admin_key_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLWAY_ADMIN_KEY", raising=False)
    assert find_admin_key(tmp_path) is None
    key, generated = admin_key(tmp_path / "d")
    assert generated and key.startswith("rw-admin-")
    assert stat.S_IMODE((tmp_path / "d" / "admin_key").stat().st_mode) == 0o600
    assert admin_key(tmp_path / "d") == (key, False)
    assert find_admin_key(tmp_path / "d") == key
    monkeypatch.setenv("ROLLWAY_ADMIN_KEY", "from-env")
    assert find_admin_key(tmp_path / "d") == "from-env"


def test_rollout_and_train_read_the_data_dir_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("ROLLWAY_ADMIN_KEY", raising=False)
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "1+1="}\n')
    agent = tmp_path / "a.py"
    agent.write_text("async def run(task, client):\n    return 0.0\n")
    with pytest.raises(SystemExit, match=r"no admin key.*admin_key"):
        main(["rollout", "--agent", str(agent), "--tasks", str(tasks), "--data-dir", str(tmp_path / "none")])
    key, _ = admin_key(tmp_path / "data")
    # train: the key from the file reaches the environment its workers inherit (the gateway check then fails
    # on the closed port, after the key was found).
    assert main(["train", "--data-dir", str(tmp_path / "data"), "--gateway", "http://127.0.0.1:9",
                 "--model", "m", "--out", str(tmp_path / "out")]) == 2
    assert os.environ["ROLLWAY_ADMIN_KEY"] == key
    assert "127.0.0.1:9" in capsys.readouterr().err


def test_train_reads_the_data_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`rollway train` read ./rollway-data/admin_key with ROLLWAY_DATA_DIR set (serve, rollout and view honour it):
    another gateway's key, and a 401 that did not say where it came from."""
    monkeypatch.delenv("ROLLWAY_ADMIN_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    admin_key(tmp_path / "rollway-data")  # the default folder's key: not the one to take
    key, _ = admin_key(tmp_path / "d2")
    monkeypatch.setenv("ROLLWAY_DATA_DIR", str(tmp_path / "d2"))
    assert main(["train", "--gateway", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "out")]) == 2
    assert os.environ["ROLLWAY_ADMIN_KEY"] == key
    assert f"admin key from {tmp_path / 'd2' / 'admin_key'}" in capsys.readouterr().err


def _published(tmp_path: Path, path: Path) -> str:
    """A SQLite store whose current weights are `path`, as a trainer's publish leaves it."""
    import sqlite3

    from gateway.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    with sqlite3.connect(tmp_path / "store.db") as conn:
        conn.execute("INSERT INTO weight_versions (version, model_path, published_at) VALUES (3, ?, 0)", (str(path),))
    return url


def test_serve_resumes_the_published_version_of_the_same_model(tmp_path: Path, tiny_model_dir: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from rollway.serve import resumed_weights

    resumed_weights(_published(tmp_path, tiny_model_dir), tiny_model_dir)  # a trained copy shares the config
    assert "loads its weights version 3" in capsys.readouterr().err


def test_serve_refuses_published_weights_of_another_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rollway serve --model <a qwen3>` over a data folder whose run published Qwen2 weights swapped them into
    the engine, and answered /ready 200 with Qwen3's context length."""
    import json
    import shutil

    from rollway.serve import resumed_weights

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=r"version 3.*of another model than --model.*architectures.*new --data-dir"):
        resumed_weights(_published(tmp_path, tiny_model_dir), other)


def test_serve_refuses_published_weights_that_are_gone(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The folder of the current version deleted: the gateway retried loading it forever, never ready, saying
    "no healthy backend"."""
    from rollway.serve import resumed_weights

    with pytest.raises(SystemExit, match=r"version 3, published from .*v000003, and that folder is gone"):
        resumed_weights(_published(tmp_path, tmp_path / "runs" / "weights" / "v000003"), tiny_model_dir)


# --- files: the data directory and the store are the user's alone ---


def test_store_and_data_dir_are_private(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    r = subprocess.run([sys.executable, "-m", "rollway.cli", "db", "upgrade", "--data-dir", str(tmp_path / "d")],
                       env=env, capture_output=True, text=True, umask=0o022)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
    for f in (tmp_path / "d").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_serve_makes_an_existing_data_dir_private(tmp_path: Path) -> None:
    """A data dir and store left world-readable (by an older version, or by hand) are closed at start."""
    from rollway.keys import private_data_dir

    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    for name in ("rollway.db", "rollway.db-wal"):
        (data / name).write_bytes(b"")
        (data / name).chmod(0o644)
    private_data_dir(data, f"sqlite:///{data / 'rollway.db'}")
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert {stat.S_IMODE((data / n).stat().st_mode) for n in ("rollway.db", "rollway.db-wal")} == {0o600}
