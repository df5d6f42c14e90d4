"""`docker compose up` for real: the CPU stack (docker-compose.yml + docker-compose.cpu.yml) built, started, used by
the example OpenAI-SDK agent through the gateway's published port, trained, stopped, and started again on the
same volumes. Docker, Compose and the base images are installed as needed by .ci/docker_setup.sh (root; on a
machine that cannot reach Docker Hub, stand-ins from Debian's packages).

The whole run prints its figures (build times, time to all-healthy, the agent's rewards, the publish, the resume,
the exit codes on `stop`) and, on any failure, `docker compose ps` and `docker compose logs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from rollway.embedded import free_port

REPO = Path(__file__).resolve().parents[2]
PROJECT = "rollway-e2e"  # its own containers, network and volumes: a user's `rollway` stack is left alone
ADMIN = "rw-admin-compose-e2e-0123456789abcdef"
LONG_RUNNING = {"postgres", "sglang", "gateway", "trainer", "runner"}
ONE_SHOT = {"migrate", "init-model"}
# Exit codes on `docker compose stop`, as docker-compose.yml documents them: PostgreSQL gets SIGINT (its image's
# STOPSIGNAL, a fast shutdown) and exits 0; rollway's commands get SIGTERM, shut down and end by the signal (143).
STOP_CODES = {"postgres": 0, "sglang": 143, "gateway": 143, "trainer": 143, "runner": 143}
GRACE_S = {"trainer": 60.0}  # stop_grace_period; 10 s for the others

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def log(msg: str) -> None:
    print(f"[compose-e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Stack:
    def __init__(self, env_file: Path, port: int) -> None:
        self.env_file = env_file
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {ADMIN}"}

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["docker", "compose", "-p", PROJECT, "--env-file", str(self.env_file), "-f", "docker-compose.yml",
               "-f", "docker-compose.cpu.yml", *args]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[2:])} exited {out.returncode}:\n{out.stdout[-4000:]}\n"
                                 f"{out.stderr[-4000:]}")
        return out

    def services(self) -> dict[str, dict[str, Any]]:
        out = self.compose("ps", "-a", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return {r["Service"]: r for r in rows}

    def wait_healthy(self, timeout: float = 900) -> float:
        """Every long-running service `healthy`, every one-shot exited 0; seconds it took."""
        t0 = time.monotonic()
        while True:
            svcs = self.services()
            bad = {s: r["ExitCode"] for s, r in svcs.items() if r["State"] == "exited"
                   and (s in LONG_RUNNING or r["ExitCode"] != 0)}
            assert not bad, f"services exited: {bad}"
            healthy = {s for s, r in svcs.items() if r["State"] == "running" and r["Health"] == "healthy"}
            done = {s for s, r in svcs.items() if r["State"] == "exited" and r["ExitCode"] == 0}
            if LONG_RUNNING <= healthy and ONE_SHOT <= done:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, f"not all healthy after {timeout} s: " + ", ".join(
                f"{s}={r['State']}/{r['Health'] or '-'}" for s, r in sorted(svcs.items()))
            time.sleep(3)

    def get(self, path: str) -> Any:
        r = httpx.get(self.url + path, headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict[str, Any], timeout: float = 60) -> Any:
        r = httpx.post(self.url + path, headers=self.headers, json=body, timeout=timeout)
        assert r.status_code < 300, f"POST {path}: {r.status_code} {r.text}"
        return r.json()

    def weights(self) -> dict[str, Any]:
        return self.get("/v1/weights")

    def wait(self, what: str, pred: Any, timeout: float) -> Any:
        t0 = time.monotonic()
        while True:
            value = pred()
            if value:
                log(f"{what}: after {time.monotonic() - t0:.0f} s")
                return value
            assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
            time.sleep(3)

    def engine_info(self) -> dict[str, Any]:
        """/get_model_info of the engine, asked inside its container (its port is not published)."""
        code = ("import urllib.request; print(urllib.request.urlopen("
                "'http://127.0.0.1:30000/get_model_info', timeout=10).read().decode())")
        return json.loads(self.compose("exec", "-T", "sglang", "python", "-c", code, timeout=60).stdout)


def _agent() -> Any:
    spec = importlib.util.spec_from_file_location("arithmetic_agent", REPO / "agents" / "arithmetic.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_agent(stack: Stack, tasks: list[dict[str, Any]], n: int = 4) -> list[tuple[str, list[str], list[float]]]:
    """The example agent (agents/arithmetic.py, the plain OpenAI SDK) on each task, n sessions a group, through the
    published port; each group's rewards sent back over REST (POST /v1/groups/{id}/rewards)."""
    agent = _agent()
    out = []
    for task in tasks:
        group = stack.post("/v1/groups", {"task": task, "n_samples": n, "wait_seconds": 300}, timeout=330)
        sessions = group["sessions"]
        assert all(s["base_url"].startswith(stack.url) for s in sessions), sessions[0]["base_url"]

        async def one(s: dict[str, Any], task: dict[str, Any] = task) -> float:
            async with AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], timeout=120) as client:
                return float(await agent.run(task, client))

        async def all_of(sessions: list[dict[str, Any]] = sessions) -> list[float]:
            return list(await asyncio.gather(*(one(s) for s in sessions)))

        rewards = asyncio.run(all_of())
        ids = [s["session_id"] for s in sessions]
        stack.post(f"/v1/groups/{group['group_id']}/rewards",
                   {"rewards": [{"session_id": i, "reward": r} for i, r in zip(ids, rewards, strict=True)],
                    "finish": True})
        log(f"agent: {task['prompt']!r} group {group['group_id']}: rewards {rewards}")
        out.append((group["group_id"], ids, rewards))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with contextlib.ExitStack() as stack_lock:
        yield from _stack(tmp_path_factory, stack_lock)


def _stack(tmp_path_factory: pytest.TempPathFactory, stack_lock: contextlib.ExitStack) -> Iterator[Stack]:
    if os.geteuid() != 0 and not shutil.which("docker"):
        pytest.skip("needs root (to install Docker) or a Docker engine with Compose v2")
    # One run at a time on a machine (the project name is fixed, so that a run cleans up after an aborted one).
    lock = stack_lock.enter_context(open("/tmp/rollway-compose-e2e.lock", "w"))
    fcntl.flock(lock, fcntl.LOCK_EX)
    t0 = time.monotonic()
    setup = subprocess.run([str(REPO / ".ci" / "docker_setup.sh")], capture_output=True, text=True, timeout=1200)
    print(setup.stderr, flush=True)
    assert setup.returncode == 0, f".ci/docker_setup.sh exited {setup.returncode}"
    # Its stdout is KEY=VALUE lines only; anything else there is a bug in the script (a tool writing to stdout).
    lines = setup.stdout.split()
    assert lines and all(re.fullmatch(r"[A-Z_]+=\S+", line) for line in lines), (
        f".ci/docker_setup.sh printed more than KEY=VALUE lines on stdout: {setup.stdout[-2000:]!r}")
    images = dict(line.split("=", 1) for line in lines)
    log(f"docker setup: {time.monotonic() - t0:.0f} s; base images {images}")

    # Offline build inputs (docker/local/README.md): this machine's CPU torch wheel (pip takes it from its local
    # file index; the PyTorch index is not reachable) and its CA bundle (pip reaches PyPI through a proxy).
    local = REPO / "docker" / "local"
    wheels = sorted(local.glob("torch-2.13.0+cpu-*.whl"))
    if not wheels:
        subprocess.run(["python3", "-m", "pip", "download", "-q", "torch==2.13.0", "--no-deps", "-d", str(local)],
                       check=True, timeout=600)
        wheels = sorted(local.glob("torch-2.13.0+cpu-*.whl"))
    assert wheels, f"no CPU torch wheel in {local}: {sorted(p.name for p in local.iterdir())}"
    shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", local / "ca-certificates.crt")

    port = free_port()
    env_file = tmp_path_factory.mktemp("compose") / "e2e.env"
    env_file.write_text("\n".join([
        f"ROLLWAY_ADMIN_KEY={ADMIN}",
        "POSTGRES_PASSWORD=e2e0123456789abcdef",
        f"BASE_IMAGE={images['BASE_IMAGE']}",
        f"POSTGRES_IMAGE={images['POSTGRES_IMAGE']}",
        f"TORCH_WHEEL={wheels[0].name}",
        "CA_BUNDLE=ca-certificates.crt",
        "ROLLWAY_IMAGE=rollway-e2e",
        "GATEWAY_BIND=127.0.0.1",
        f"GATEWAY_PORT={port}",
        # A light runner (2 CPU cores here), and a trainer that steps on 2 groups, trains groups with equal
        # rewards too (the tiny model rarely answers right) and leases groups of any age.
        "RUNNER_N_SAMPLES=2",
        "RUNNER_CONCURRENCY=2",
        # No staleness bound (eta 10000): the trainer steps ~1/s on the runner's groups, so with eta 8 the agent's
        # groups, queued behind the runner's, were stale before their turn and never trained (seen on a quiet machine).
        "TRAINER_ARGS=--groups-per-step 2 --dynamic-filter false --max-head-offpolicyness 10000 --wait-seconds 5",
        "",
    ]))
    s = Stack(env_file, port)
    s.compose("down", "-v", "--remove-orphans", timeout=300)  # a clean start: nothing left from an aborted run
    try:
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        # Compose builds the image once per service that builds it: all but the tagged one are left dangling.
        # Only this project's go; the tagged image and the build cache stay, for the next run.
        subprocess.run(["docker", "image", "prune", "-f", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                       capture_output=True, timeout=300)


@contextlib.contextmanager
def diagnostics(stack: Stack) -> Iterator[None]:
    """On any failure: `docker compose ps` and every service's log, before the fixture removes the stack."""
    try:
        yield
    except BaseException:
        print(stack.compose("ps", "-a", check=False).stdout, flush=True)
        logs = stack.compose("logs", "--no-color", "--timestamps", check=False, timeout=300)
        print(logs.stdout[-200_000:], logs.stderr[-5000:], flush=True)
        raise


def test_compose_stack_builds_serves_trains_resumes_and_stops(stack: Stack) -> None:
    with diagnostics(stack):
        _builds_serves_trains_resumes_and_stops(stack)


def _builds_serves_trains_resumes_and_stops(stack: Stack) -> None:
    t_test = time.monotonic()
    t0 = time.monotonic()
    stack.compose("build", timeout=1800)
    log(f"build: {time.monotonic() - t0:.0f} s")

    t0 = time.monotonic()
    stack.compose("up", "-d", timeout=900)
    up_s = time.monotonic() - t0
    stack.wait_healthy()
    log(f"all healthy: {time.monotonic() - t0:.0f} s from `up -d` (which returned after {up_s:.0f} s)")
    svcs = stack.services()
    published = [p for p in svcs["gateway"]["Publishers"] if p["PublishedPort"]]
    assert [(p["URL"], p["TargetPort"]) for p in published] == [("127.0.0.1", 8000)], published
    assert not any(p["PublishedPort"] for name, r in svcs.items() if name != "gateway" for p in r["Publishers"])

    # The agent through the published port; the trainer trains a step on the stack's groups and publishes.
    tasks = [json.loads(line) for line in (REPO / "agents/tasks/arithmetic.jsonl").read_text().splitlines()[:2]]
    groups = run_agent(stack, tasks)
    for gid, ids, rewards in groups:
        detail = stack.get(f"/v1/groups/{gid}")
        assert [x["reward"] for x in sorted(detail["sessions"], key=lambda x: ids.index(x["id"]))] == rewards
    v1 = stack.wait("trainer published", lambda: stack.weights()["version"] >= 1 and stack.weights(), 900)
    log(f"published: {v1}")
    assert v1["model_path"].startswith("/checkpoints/run/weights/v"), v1
    states = stack.wait("the agent's groups trained", lambda: all(
        stack.get(f"/v1/groups/{g}")["state"] == "trained" for g, _, _ in groups), 900)
    assert states

    # The engine serves the new version: asked directly, and seen in the versions of a new session's tokens.
    version = stack.weights()["version"]
    info = stack.engine_info()
    assert int(info["weight_version"]) >= version and info["model_path"].startswith("/checkpoints/run/weights/"), info
    after = run_agent(stack, tasks[:1], n=2)
    turn = stack.get(f"/v1/sessions/{after[0][1][0]}")["turns"][0]
    assert min(turn["versions"]) >= version, turn["versions"]
    log(f"engine serves version {info['weight_version']} ({info['model_path']}); new turn versions "
        f"{turn['versions']}")
    steps = stack.compose("exec", "-T", "trainer", "ls", "/checkpoints/run/checkpoints").stdout.split()
    assert steps, "no training checkpoint on the volume"
    log(f"checkpoints on the volume: {steps}")

    # The viewer: the admin key signs in at /ui and the run's pages answer.
    with httpx.Client(base_url=stack.url, timeout=30, follow_redirects=True) as ui:
        assert ui.get("/ui").status_code in (200, 401, 303)
        page = ui.post("/ui/login", data={"key": ADMIN, "next": "/ui"})
        assert page.status_code == 200 and "rollway" in page.text.lower(), (page.status_code, page.text[:500])
        session_page = ui.get(f"/ui/sessions/{groups[0][1][0]}")
        assert session_page.status_code == 200, session_page.status_code
    log("viewer: /ui answers after sign-in")

    # down, then up on the same volumes: the store and the checkpoints are still there; the trainer resumes.
    before = stack.weights()["version"]
    t0 = time.monotonic()
    stack.compose("down", timeout=300)
    log(f"down: {time.monotonic() - t0:.0f} s (version {before} or later published)")
    t0 = time.monotonic()
    stack.compose("up", "-d", timeout=900)
    stack.wait_healthy()
    log(f"up again, all healthy: {time.monotonic() - t0:.0f} s")
    for gid, ids, rewards in groups:
        assert stack.get(f"/v1/groups/{gid}")["state"] == "trained"
        assert stack.get(f"/v1/sessions/{ids[0]}")["reward"] == rewards[0]
    resumed = stack.wait("trainer log says it resumed", lambda: [
        ln for ln in stack.compose("logs", "--no-color", "trainer").stdout.splitlines()
        if "rank(s) on cpu" in ln and ", checkpoint /checkpoints/run/checkpoints/step_" in ln], 300)
    log(f"trainer: {resumed[-1].strip()}")
    m = re.search(r"\(step (\d+), version (\d+)", resumed[-1])
    assert m and int(m[1]) >= max(int(x.removeprefix("step_")) for x in steps) and int(m[2]) >= before, resumed
    at_resume = stack.weights()["version"]
    assert at_resume >= before
    stack.wait(f"a publish after the resume (above version {at_resume})",
               lambda: stack.weights()["version"] > at_resume, 900)
    log(f"published after the resume: {stack.weights()}")

    # stop: SIGTERM, every service exits with its documented code within its grace period.
    t0 = time.monotonic()
    stack.compose("stop", timeout=300)
    took = time.monotonic() - t0
    svcs = stack.services()
    codes = {s: r["ExitCode"] for s, r in svcs.items()}
    log(f"stop: {took:.0f} s; exit codes {codes}")
    for s in LONG_RUNNING:
        assert svcs[s]["State"] == "exited", (s, svcs[s]["State"])
        assert codes[s] == STOP_CODES[s], f"{s} exited {codes[s]} on stop, documented {STOP_CODES[s]}"
    assert took < max(GRACE_S.values()) + 30
    log(f"whole test (build included): {time.monotonic() - t_test:.0f} s")
