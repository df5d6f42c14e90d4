"""Static checks of docker-compose.yml, its CPU override, docker/ and .env.example. No Docker engine needed.

The files are read with PyYAML (plus compose's `!reset`/`!override` tags), `${VAR}` is interpolated with
compose's rules from .env.example, the override is merged with compose's merge rules, and every `rollway`
command is parsed by the real CLI parser. `docker compose config -q` runs as well where a Compose v2 client
is installed (the test is skipped otherwise).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

from tests.compose_model import (
    BASE,
    CONFIGS,
    CPU,
    ENV_EXAMPLE,
    NO_HEALTHCHECK,
    ONE_GPU,
    ROOT,
    SECRETS,
    SUBCOMMAND,
    argv_of,
    covering_mount,
    env_example,
    flag,
    interpolate,
    load,
    model_users,
    mount,
    project,
    references,
    rollway_argv,
    stack_env,
)


@pytest.fixture(params=list(CONFIGS), scope="module")
def config(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, project(CONFIGS[request.param])


@pytest.fixture(scope="module")
def parser() -> Any:
    from rollway.cli import build_parser  # a failure here means the CLI itself does not import

    return build_parser()


# ---------------------------------------------------------------- the tests


def test_files_exist_and_parse() -> None:
    for path in (BASE, CPU, ENV_EXAMPLE, ROOT / "docker" / "Dockerfile"):
        assert path.is_file(), path
    assert set(load(BASE)["services"]) == {"postgres", "migrate", "sglang", "gateway", "trainer", "runner"}
    assert set(load(CPU)["services"]) <= {"init-model", "sglang", "gateway", "trainer", "runner", "migrate"}


def test_every_service_has_an_image_or_a_build(config: tuple[str, dict[str, Any]]) -> None:
    name, doc = config
    ours = stack_env()["ROLLWAY_IMAGE"] + ":"
    for svc_name, svc in doc["services"].items():
        assert svc.get("image") or svc.get("build"), f"{name}: {svc_name} has neither image nor build"
        if str(svc.get("image", "")).startswith(ours):  # never pulled: each service can build it
            assert svc.get("build"), f"{name}: {svc_name} uses our image {svc['image']} without a build"


def test_build_contexts_and_dockerfiles_exist(config: tuple[str, dict[str, Any]]) -> None:
    _, doc = config
    builds = [s["build"] for s in doc["services"].values() if "build" in s]
    assert builds
    for build in builds:
        context = ROOT / build["context"]
        assert context.is_dir(), context
        assert (context / build["dockerfile"]).is_file(), build["dockerfile"]
        assert set(build.get("args", {})) <= {"TORCH", "TORCH_VERSION", "EXTRAS", "USER_UID", "BASE_IMAGE",
                                               "TORCH_WHEEL", "CA_BUNDLE"}
        assert build["args"]["TORCH"] in ("cpu", "cuda")


def test_dockerfile() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    # The official base by default; BASE_IMAGE for a stand-in (docker/local-images.sh). No `# syntax=` line:
    # it makes BuildKit pull a frontend image, which an offline build cannot.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert not re.search(r"^#\s*syntax=", text, re.M)
    # docker/local/ (a torch wheel, a CA bundle) is bind-mounted, never copied into the image.
    assert "--mount=type=bind,source=docker/local,target=/local" in text
    assert "rm -rf /app/docker/local" in text
    assert not re.search(r"^COPY \. ", text, re.M)
    assert re.search(r"^ARG TORCH=cpu$", text, re.M)
    for torch in ("cpu)", "cuda)", "torch==${TORCH_VERSION}", "https://download.pytorch.org/whl/cpu"):
        assert torch in text
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    assert re.search(r'^ENTRYPOINT \["rollway"\]$', text, re.M)
    # What the image needs must survive docker/Dockerfile.dockerignore.
    ignore = ROOT / "docker" / "Dockerfile.dockerignore"
    patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
    needed = [
        "pyproject.toml",
        "README.md",
        "rollway",
        "gateway",
        "engine",
        "trainer",
        "migrations",
        "agents",
        "agents/arithmetic.py",
        "agents/tasks/arithmetic.jsonl",
    ]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not any(fnmatch(path, p) or fnmatch(path, p + "/*") for p in patterns), f"{path} is ignored"


def test_every_service_has_a_healthcheck_or_an_exemption(config: tuple[str, dict[str, Any]]) -> None:
    name, doc = config
    for svc_name, svc in doc["services"].items():
        if svc_name in NO_HEALTHCHECK:
            assert "healthcheck" not in svc
            assert svc.get("restart") == "no", f"{name}: exempt {svc_name} must be one-shot"
            continue
        check = svc.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), (
            f"{name}: {svc_name} has no healthcheck"
        )
        assert check["test"][0] in ("CMD", "CMD-SHELL"), check["test"]


def test_healthchecks_probe_the_ports_served(config: tuple[str, dict[str, Any]]) -> None:
    _, doc = config
    svcs = doc["services"]
    sglang_port = flag(argv_of(svcs["sglang"]), "--port")
    gateway_port = flag(argv_of(svcs["gateway"]), "--port")
    # Liveness, one policy with the gateway's pool (docs/architecture.md "Liveness"): /ping answers 200 while a
    # publish pauses the server; SGLang's /health blocks then, and its 503 would mark the server unhealthy.
    assert f"127.0.0.1:{sglang_port}/ping" in " ".join(svcs["sglang"]["healthcheck"]["test"])
    assert "/health" not in " ".join(svcs["sglang"]["healthcheck"]["test"])
    # Services that wait for a healthy gateway need one that can serve agents: readiness, not liveness.
    assert [s for s, svc in svcs.items() if svc.get("depends_on", {}).get("gateway")] == ["trainer", "runner"]
    assert f"127.0.0.1:{gateway_port}/ready" in " ".join(svcs["gateway"]["healthcheck"]["test"])
    assert "pg_isready" in svcs["postgres"]["healthcheck"]["test"]


def test_gateway_healthcheck_passes_only_while_ready(config: tuple[str, dict[str, Any]], tiny_model_dir: Path,
                                                      sqlite_url: str) -> None:
    """The gateway's healthcheck command itself, run against a real gateway on another port: it fails while
    no backend answers (GET /ready is 503) and passes once one does."""
    from tests.fakes.sglang import FakeSGLang
    from tests.harness import LiveGateway

    _, doc = config
    gateway = doc["services"]["gateway"]
    test, port = gateway["healthcheck"]["test"], flag(argv_of(gateway), "--port")
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, test
    code = test[3]
    assert f"127.0.0.1:{port}/" in code
    with FakeSGLang() as fake, LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url,
                                           health_interval_s=0.2) as gw:

        def probe() -> int:
            here = code.replace(f"127.0.0.1:{port}", f"127.0.0.1:{gw.port}")
            return subprocess.run([sys.executable, "-c", here], capture_output=True, timeout=30).returncode

        assert probe() == 0
        fake.healthy = False
        deadline = time.monotonic() + 10
        while gw.admin.get("/ready").status_code != 503:
            assert time.monotonic() < deadline, "the backend never left rotation"
            time.sleep(0.1)
        assert probe() != 0


def test_named_volumes_are_declared_and_used(config: tuple[str, dict[str, Any]]) -> None:
    name, doc = config
    declared = set(doc.get("volumes") or {})
    used = {
        m["source"] for s in doc["services"].values() for m in map(mount, s.get("volumes", [])) if m["named"]
    }
    assert used <= declared, f"{name}: undeclared volumes {used - declared}"
    assert declared <= used, f"{name}: declared but unused volumes {declared - used}"
    assert "pgdata" in {mount(v)["source"] for v in doc["services"]["postgres"]["volumes"]}


def test_variables_are_documented_and_secrets_required() -> None:
    documented = set(env_example())
    refs = references(load(BASE)) + references(load(CPU)) + references(load(ONE_GPU))
    names = {name for name, _, _ in refs}
    assert names <= documented, f"undocumented in .env.example: {sorted(names - documented)}"
    assert documented <= names, f"documented but never used: {sorted(documented - names)}"
    for name, op, arg in refs:
        if name in SECRETS:
            assert op == ":?" and arg.strip(), f"${{{name}}} must be written ${{{name}:?message}}"
    assert SECRETS <= names
    for secret in SECRETS:  # no real secret in the example file
        assert env_example()[secret] == ""
    # Each variable sits in a paragraph that says what it is.
    for para in ENV_EXAMPLE.read_text().split("\n\n"):
        lines = para.strip().splitlines()
        if any(re.match(r"[A-Z_]+=", ln) for ln in lines):
            assert any(ln.startswith("# ") for ln in lines), f"undocumented: {para!r}"


def test_a_missing_secret_stops_interpolation() -> None:
    for secret in SECRETS:
        env = {k: v for k, v in stack_env().items() if k != secret}
        with pytest.raises(LookupError, match=secret):
            interpolate(load(BASE), env)


def test_depends_on_conditions(config: tuple[str, dict[str, Any]]) -> None:
    name, doc = config
    svcs = doc["services"]

    def deps(svc: str) -> dict[str, str]:
        return {k: v["condition"] for k, v in svcs[svc].get("depends_on", {}).items()}

    assert deps("migrate") == {"postgres": "service_healthy"}
    assert deps("gateway") == {
        "postgres": "service_healthy",
        "sglang": "service_healthy",
        "migrate": "service_completed_successfully",
    }
    assert deps("trainer") == {"gateway": "service_healthy"}
    assert deps("runner") == {"gateway": "service_healthy"}
    if name == "cpu":
        assert deps("sglang") == {"init-model": "service_completed_successfully"}
    for svc in svcs:
        for dep, cond in deps(svc).items():
            assert dep in svcs, f"{svc} depends on unknown {dep}"
            if cond == "service_healthy":
                assert "healthcheck" in svcs[dep], f"{svc} waits for {dep} to be healthy, it has no check"


def test_one_shot_services_are_awaited_to_completion(config: tuple[str, dict[str, Any]]) -> None:
    _, doc = config
    svcs = doc["services"]
    for one_shot in set(NO_HEALTHCHECK) & set(svcs):
        waiters = [s for s in svcs.values() if s.get("depends_on", {}).get(one_shot)]
        assert waiters, f"nothing waits for {one_shot}"
        assert all(
            s["depends_on"][one_shot]["condition"] == "service_completed_successfully" for s in waiters
        )


def parse_cli(argv: list[str]) -> Any:
    from rollway.cli import parse_args

    return parse_args(argv)


def test_rollway_commands_parse_with_the_cli(config: tuple[str, dict[str, Any]], parser: Any) -> None:
    name, doc = config
    seen = set()
    for svc_name, svc in doc["services"].items():
        argv = rollway_argv(svc)
        if argv is None:
            continue
        try:
            args = parse_cli(argv)  # exactly as `rollway` parses (train forwards its options)
        except SystemExit as e:
            pytest.fail(f"{name}: {svc_name}: `rollway {shlex.join(argv)}` does not parse (exit {e.code})")
        seen.add(svc_name)
        expected = "engine" if svc_name == "sglang" else SUBCOMMAND[svc_name]
        assert args.command == expected, f"{svc_name} runs `rollway {args.command}`"
    assert {"migrate", "gateway", "trainer", "runner"} <= seen
    if name == "cpu":
        assert {"sglang", "init-model"} <= seen


def test_trainer_options_are_train_config_fields(config: tuple[str, dict[str, Any]]) -> None:
    from trainer.config import load_config, parse_overrides

    _, doc = config
    argv = rollway_argv(doc["services"]["trainer"])
    assert argv and argv[0] == "train"
    rest = argv[1:]
    nproc = flag(rest, "--nproc")
    assert int(nproc) >= 1
    del rest[rest.index("--nproc") : rest.index("--nproc") + 2]  # torchrun's, not a TrainConfig field
    cfg = load_config(None, parse_overrides(rest))  # an unknown key or a bad value raises here
    assert cfg.gateway and cfg.model and cfg.out


def test_services_point_at_each_other(config: tuple[str, dict[str, Any]], parser: Any) -> None:
    name, doc = config
    svcs = doc["services"]
    env = stack_env()
    sg = argv_of(svcs["sglang"])
    gw = parser.parse_args(rollway_argv(svcs["gateway"]))
    one_gpu = name == "one-gpu"  # the gateway and the trainer in SGLang's network namespace (the tensor path)
    assert gw.backends == [f"http://{'127.0.0.1' if one_gpu else 'sglang'}:{flag(sg, '--port')}"]
    assert gw.host == "0.0.0.0"
    assert gw.tokenizer == env["MODEL_PATH"]
    assert gw.db.startswith("postgresql://rollway:") and "@postgres:5432/rollway" in gw.db
    assert env["POSTGRES_PASSWORD"] in gw.db
    migrate = parser.parse_args(rollway_argv(svcs["migrate"]))
    assert (migrate.action, migrate.db) == ("upgrade", gw.db)
    published = svcs["sglang" if one_gpu else "gateway"]["ports"]
    assert published == [f"{env['GATEWAY_BIND']}:{env['GATEWAY_PORT']}:{gw.port}"]
    gateway_url = f"http://gateway:{gw.port}"
    assert flag(argv_of(svcs["trainer"]), "--gateway") == (f"http://127.0.0.1:{gw.port}" if one_gpu else gateway_url)
    runner = parser.parse_args(rollway_argv(svcs["runner"]))
    assert runner.gateway == (f"http://sglang:{gw.port}" if one_gpu else gateway_url)
    for path in (runner.agent, runner.tasks):  # /app is the repository in the image (COPY . /app)
        assert path.startswith("/app/") and (ROOT / path.removeprefix("/app/")).is_file(), path
    for svc in ("gateway", "trainer", "runner"):
        assert svcs[svc]["environment"]["ROLLWAY_ADMIN_KEY"] == env["ROLLWAY_ADMIN_KEY"]
    assert svcs["postgres"]["environment"]["POSTGRES_PASSWORD"] == env["POSTGRES_PASSWORD"]
    if name in ("gpu", "one-gpu"):
        assert svcs["sglang"]["image"] == f"lmsysorg/sglang:{env['SGLANG_TAG']}"
        assert svcs["sglang"]["entrypoint"] == ["python3", "-m", "sglang.launch_server"]
        assert flag(sg, "--host") == "0.0.0.0"
    else:
        engine = parser.parse_args(rollway_argv(svcs["sglang"]))
        assert (engine.command, engine.host) == ("engine", "0.0.0.0")


def test_sglang_image_tag_is_a_variable() -> None:
    image = load(BASE)["services"]["sglang"]["image"]
    assert re.fullmatch(r"lmsysorg/sglang:\$\{SGLANG_TAG:-v[\w.\-]+\}", image), image


def test_model_is_mounted_read_only_at_one_path(config: tuple[str, dict[str, Any]]) -> None:
    name, doc = config
    svcs = doc["services"]
    users = model_users(svcs)
    assert set(users.values()) == {stack_env()["MODEL_PATH"]}
    mounts = {svc: covering_mount(svcs[svc], path) for svc, path in users.items()}
    assert len({(m["source"], m["target"]) for m in mounts.values()}) == 1, mounts
    assert all(m["read_only"] for m in mounts.values()), mounts
    if name == "cpu":  # the tiny model is written by the one-shot service into that same volume
        init = svcs["init-model"]
        out = flag(argv_of(init), "--out")
        written = covering_mount(init, out)
        assert out == users["sglang"] and not written["read_only"]
        assert (written["source"], written["target"]) == (
            mounts["sglang"]["source"],
            mounts["sglang"]["target"],
        )
        assert written["named"]


def test_checkpoints_are_shared_at_the_same_path(config: tuple[str, dict[str, Any]]) -> None:
    _, doc = config
    svcs = doc["services"]
    out = flag(argv_of(svcs["trainer"]), "--out")
    written = covering_mount(svcs["trainer"], out)
    assert written["named"] and not written["read_only"]
    read = covering_mount(svcs["sglang"], out)
    assert (read["source"], read["target"]) == (written["source"], written["target"])


def test_gpu_reservations(config: tuple[str, dict[str, Any]]) -> None:
    name, doc = config
    for svc_name, svc in doc["services"].items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name == "cpu" or svc_name not in ("sglang", "trainer"):
            assert not devices, f"{name}: {svc_name} reserves a GPU"
            continue
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert devices[0].get("device_ids") or devices[0].get("count")
    if name in ("gpu", "one-gpu"):
        assert doc["services"]["trainer"]["build"]["args"]["TORCH"] == "cuda"
    else:
        assert all(
            s.get("build", {}).get("args", {}).get("TORCH", "cpu") == "cpu" for s in doc["services"].values()
        )


# ---------------------------------------------------------------- the real client, where there is one


def _compose() -> tuple[list[str], tuple[int, ...]] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    r = subprocess.run([docker, "compose", "version", "--short"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return None
    version = tuple(int(x) for x in re.findall(r"\d+", r.stdout)[:3])
    return [docker, "compose"], version


def test_docker_compose_config(tmp_path: Path) -> None:
    found = _compose()
    if found is None:
        pytest.skip("no docker compose v2 client here")
    cli, version = found
    env_file = tmp_path / "test.env"
    base_env = {
        k: v for k, v in os.environ.items() if k not in env_example() and not k.startswith("COMPOSE_")
    }

    def run_config(files: list[Path], values: dict[str, str]) -> subprocess.CompletedProcess[str]:
        env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        cmd = [*cli, "--env-file", str(env_file)]
        for f in files:
            cmd += ["-f", str(f)]
        return subprocess.run(
            [*cmd, "config", "-q"], cwd=ROOT, env=base_env, capture_output=True, text=True, timeout=120
        )

    r = run_config([BASE], stack_env())
    assert r.returncode == 0, r.stderr
    if version >= (2, 24):  # `!reset`
        r = run_config([BASE, CPU], stack_env())
        assert r.returncode == 0, r.stderr
    for secret in SECRETS:
        r = run_config([BASE], {k: v for k, v in stack_env().items() if k != secret})
        assert r.returncode != 0 and secret in r.stderr, r.stderr


# ---------------------------------------------------------------- the GPU and CPU profiles kept in step
# The GPU profile (the real SGLang image, NVIDIA devices) cannot start without GPUs; the CPU profile is the one
# tests/e2e/test_compose_stack.py starts. Every difference between the two is listed here, so that a change to
# one profile that the other does not follow (a new env variable, volume, dependency) fails this test.

CPU_ONLY_SERVICES = {"init-model"}
# (service, key): the only attributes that differ between the profiles.
PROFILE_DIFFERENCES = {
    ("sglang", "image"),  # lmsysorg/sglang vs rollway:cpu
    ("sglang", "build"),  # the CPU engine is built from docker/Dockerfile
    ("sglang", "entrypoint"),  # sglang.launch_server vs rollway
    ("sglang", "command"),
    ("sglang", "deploy"),  # GPU reservations
    ("sglang", "ulimits"),  # memlock/stack for pinned GPU memory
    ("sglang", "healthcheck"),  # start_period only (checked below)
    ("sglang", "depends_on"),  # + init-model
    ("trainer", "image"),  # rollway:cuda vs rollway:cpu
    ("trainer", "build"),  # TORCH and its wheel only (checked below)
    ("trainer", "deploy"),
}


def _volume_map(svc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    return {m["target"]: (m["source"], m["read_only"]) for m in map(mount, svc.get("volumes", []))}


def test_gpu_and_cpu_profiles_differ_only_where_listed() -> None:
    # Every variable set (to a value of its own), so that a build argument taken from the wrong one shows.
    env = {name: f"<{name}>" for name in env_example() if not env_example()[name]}
    gpu, cpu = project(False, **env), project(True, **env)
    assert set(cpu["services"]) == set(gpu["services"]) | CPU_ONLY_SERVICES
    assert set(cpu["volumes"]) == set(gpu["volumes"]) | {"tiny-model"}
    found = set()
    for name, g in gpu["services"].items():
        c = cpu["services"][name]
        for key in set(g) | set(c):
            if key == "volumes":
                continue  # below: only /models may differ
            if g.get(key) != c.get(key):
                found.add((name, key))
        gv, cv = _volume_map(g), _volume_map(c)
        assert set(gv) == set(cv), (name, gv, cv)
        for target in gv:
            if target == "/models":  # MODEL_DIR vs the tiny model's volume, each as read-only as the other
                assert cv[target] == ("tiny-model", gv[target][1]), (name, cv[target])
            else:
                assert gv[target] == cv[target], (name, target, gv[target], cv[target])
    assert found == PROFILE_DIFFERENCES, (
        f"differ but not listed: {sorted(found - PROFILE_DIFFERENCES)}; "
        f"listed but equal: {sorted(PROFILE_DIFFERENCES - found)}")
    # The details of the listed differences.
    g_hc, c_hc = gpu["services"]["sglang"]["healthcheck"], cpu["services"]["sglang"]["healthcheck"]
    assert {k: v for k, v in g_hc.items() if k != "start_period"} == {
        k: v for k, v in c_hc.items() if k != "start_period"}
    deps = cpu["services"]["sglang"]["depends_on"]
    assert deps == {**gpu["services"]["sglang"].get("depends_on", {}),
                    "init-model": {"condition": "service_completed_successfully"}}
    g_args, c_args = (p["services"]["trainer"]["build"]["args"] for p in (gpu, cpu))
    assert {k: v for k, v in g_args.items() if k not in ("TORCH", "TORCH_WHEEL")} == {
        k: v for k, v in c_args.items() if k not in ("TORCH", "TORCH_WHEEL")}
    assert (g_args["TORCH"], c_args["TORCH"]) == ("cuda", "cpu")
    # One rollway:cpu image in the CPU profile: every service that builds it builds it the same way.
    builds = {json.dumps(s["build"], sort_keys=True) for s in cpu["services"].values() if "build" in s}
    images = {s["image"] for s in cpu["services"].values() if "build" in s}
    assert len(builds) == 1 and len(images) == 1, (images, builds)


# ---------------------------------------------------------------- the one-GPU profile against the GPU one
# docker-compose.one-gpu.yml (docs/scaling.md "One device"): SGLang and the trainer on one device, the tensor path.
ONE_GPU_DIFFERENCES = {
    ("sglang", "command"),  # --mem-fraction-static, --enable-memory-saver (LoRA off: full weights by tensor)
    ("sglang", "ipc"),  # host: CUDA IPC between the containers
    ("sglang", "ports"),  # the gateway's port, which listens in SGLang's network namespace
    ("gateway", "network_mode"),
    ("gateway", "ports"),
    ("gateway", "command"),  # the backend at 127.0.0.1 (the tensor path's locality check)
    ("trainer", "network_mode"),
    ("trainer", "ipc"),
    ("trainer", "command"),  # --weight-sync tensor --release-kv-cache, 127.0.0.1
    ("trainer", "deploy"),  # SGLang's device
    ("runner", "command"),  # the gateway reached through SGLang's name
}


def test_one_gpu_profile_differs_from_the_gpu_one_only_where_listed() -> None:
    env = {name: f"<{name}>" for name in env_example() if not env_example()[name]}
    gpu, one = project(False, **env), project("one-gpu", **env)
    assert set(one["services"]) == set(gpu["services"]) and one["volumes"] == gpu["volumes"]
    found = {(name, key) for name, g in gpu["services"].items() for key in set(g) | set(one["services"][name])
             if g.get(key) != one["services"][name].get(key)}
    assert found == ONE_GPU_DIFFERENCES, (
        f"differ but not listed: {sorted(found - ONE_GPU_DIFFERENCES)}; "
        f"listed but equal: {sorted(ONE_GPU_DIFFERENCES - found)}")
    svc = one["services"]
    assert svc["gateway"]["network_mode"] == svc["trainer"]["network_mode"] == "service:sglang"
    assert svc["sglang"]["ipc"] == svc["trainer"]["ipc"] == "host"
    assert (svc["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            == svc["sglang"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])  # one device
    sglang = argv_of(svc["sglang"])
    assert "--enable-memory-saver" in sglang and float(sglang[sglang.index("--mem-fraction-static") + 1]) < 1
    # the gateway's command is the GPU profile's but for the backend URL, which is local to it
    g_gw, o_gw = argv_of(gpu["services"]["gateway"]), argv_of(svc["gateway"])
    i = g_gw.index("--backend") + 1
    assert o_gw[:i] + o_gw[i + 1:] == g_gw[:i] + g_gw[i + 1:] and o_gw[i].startswith("http://127.0.0.1:")
    trainer = argv_of(svc["trainer"])
    from trainer.config import load_config, parse_overrides

    assert flag(trainer, "--nproc") == "1"  # one device
    rest = trainer[1:]
    del rest[rest.index("--nproc"): rest.index("--nproc") + 2]
    cfg = load_config(None, parse_overrides([a for a in rest if a != "<TRAINER_ARGS>"]))
    assert (cfg.weight_sync, cfg.release_kv_cache, cfg.gateway) == ("tensor", True, "http://127.0.0.1:8000")
    runner = argv_of(svc["runner"])
    assert runner[runner.index("--gateway") + 1] == "http://sglang:8000"
