"""`rollway view` as a subprocess over a store a real gateway made: it serves the sign-in and the viewer-key
routes with the key it prints (or the one it is given), refuses the OpenAI/REST routes clearly, reads what the
gateway and the trainer's reports stored, and refuses a store that is not there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.store.db import upgrade
from tests.fakes.sglang import FakeSGLang
from tests.harness import ADMIN_KEY, LiveGateway


@pytest.fixture(scope="module")
def recorded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A SQLite store with a played, rewarded group, a trainer's report and a viewer key; the gateway stopped."""
    url = f"sqlite:///{tmp_path_factory.mktemp('run') / 'rollway.db'}"
    upgrade(url)
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=url) as gw:
        cred = gw.group(2)["sessions"][0]
        r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {cred['api_key']}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        report = {"step": 1, "version": 1, "metrics": {"loss": 0.25},
                  "samples": [{"session_id": cred["session_id"], "group_id": "g", "advantage": 0.5}]}
        assert gw.admin.post("/v1/training/steps", json=report).status_code == 200
        viewer = gw.admin.post("/v1/viewer_keys", json={"name": "colleague"}).json()
    return {"url": url, "session": cred, "viewer": viewer}


class View:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if k not in ("ROLLWAY_ADMIN_KEY", "ROLLWAY_DB")}
        full_env["ROLLWAY_DATA_DIR"] = tempfile.mkdtemp()  # no admin_key file of the user's is found
        self.proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "view", "--port", "0", *args],
                                     env={**full_env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.expect_key = "ROLLWAY_ADMIN_KEY" not in (env or {})

    def start(self) -> View:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"rollway view exited {self.proc.wait()}: {''.join(self.lines)}")
            self.lines.append(line)
            if line.startswith("rollway view: http://"):
                self.url = line.split()[2].removesuffix("/ui")
                break
        if self.expect_key:
            self.lines.append(self.proc.stdout.readline())
        while True:  # the socket is bound before the app starts: wait for it to answer
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        return self

    @property
    def printed_key(self) -> str | None:
        found = [line.rsplit(" ", 1)[1].strip() for line in self.lines if line.startswith("admin key (generated")]
        return found[0] if found else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def view(recorded: dict[str, Any]) -> Iterator[View]:
    v = View("--db", recorded["url"])
    try:
        yield v.start()
    finally:
        v.stop()


def test_it_serves_the_sign_in_with_the_key_it_prints(view: View, recorded: dict[str, Any]) -> None:
    key = view.printed_key
    assert key and key.startswith("rw-admin-")
    with httpx.Client(base_url=view.url, timeout=30) as c:
        assert c.get("/ui/login").status_code == 200
        assert c.post("/ui/login", data={"key": key}).status_code == 303
        assert c.get("/ui/api/me").json() == {"role": "admin", "session_id": None}
        # the viewer key the gateway made and the session key both sign in here
        for who, role in ((recorded["viewer"]["key"], "viewer"), (recorded["session"]["api_key"], "session")):
            assert c.get("/ui/api/me", headers={"Authorization": f"Bearer {who}"}).json()["role"] == role
        # the admin hands out viewer keys here too
        made = c.post("/v1/viewer_keys", json={"name": "x"}, headers={"Authorization": f"Bearer {key}"})
        assert made.status_code == 201 and made.json()["key"].startswith("rw-viewer-")
        assert c.get("/v1/viewer_keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 401


def test_the_openai_and_rest_routes_are_refused_clearly(view: View, recorded: dict[str, Any]) -> None:
    session = recorded["session"]
    with httpx.Client(base_url=view.url, timeout=30, headers={"Authorization": f"Bearer {session['api_key']}"}) as c:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/groups"),
                             ("POST", "/v1/batches"), ("GET", f"/v1/sessions/{session['session_id']}"),
                             ("POST", f"/sessions/{session['session_id']}/v1/chat/completions"),
                             ("POST", "/v1/training/steps"), ("GET", "/metrics")):
            r = c.request(method, path, json={})
            assert r.status_code == 404, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "viewer_only" and "rollway serve" in err["message"], err


def test_the_viewer_reads_what_the_gateway_and_trainer_stored(recorded: dict[str, Any]) -> None:
    """The same store functions the pages call, on the store `rollway view` was given (it migrated it)."""
    import asyncio

    from gateway.store.db import create_engine
    from gateway.store.store import Store

    async def read() -> tuple[Any, Any, Any]:
        store = Store(create_engine(recorded["url"]))
        try:
            return (await store.training_steps(), await store.session_advantages([recorded["session"]["session_id"]]),
                    await store.session(recorded["session"]["session_id"]))
        finally:
            await store.close()

    steps, adv, (_, turns) = asyncio.run(read())
    assert steps[0]["metrics"] == {"loss": 0.25} and adv[recorded["session"]["session_id"]]["advantage"] == 0.5
    assert len(turns) == 1


def test_a_given_key_is_used_and_not_printed(recorded: dict[str, Any]) -> None:
    v = View("--db", recorded["url"], env={"ROLLWAY_ADMIN_KEY": "rw-admin-chosen"})
    try:
        v.start()
        assert v.printed_key is None and not any("rw-admin-chosen" in line for line in v.lines)
        with httpx.Client(base_url=v.url, timeout=30) as c:
            assert c.post("/ui/login", data={"key": "rw-admin-chosen"}).status_code == 303
    finally:
        v.stop()


@pytest.mark.parametrize("folder", ["model-init", "tiny-model"])
def test_a_data_dir_gives_the_store_its_admin_key_and_tokenizer(
    recorded: dict[str, Any], tiny_model_dir: Path, tmp_path: Path, folder: str
) -> None:
    """`rollway view --data-dir OUT` over what the demo (model-init) or `rollway serve` (tiny-model) leaves in
    OUT: rollway.db, the admin_key file and the model folder, whose tokenizer turns the token view's ids into
    text (issue 28: serve's tiny-model was not looked for, and the page showed ids)."""
    shutil.copy(recorded["url"].removeprefix("sqlite:///"), tmp_path / "rollway.db")
    (tmp_path / "admin_key").write_text("rw-admin-from-file\n")
    shutil.copytree(tiny_model_dir, tmp_path / folder)
    v = View("--data-dir", str(tmp_path))
    v.expect_key = False
    try:
        v.start()
        assert not any("rw-admin-from-file" in line for line in v.lines)
        with httpx.Client(base_url=v.url, timeout=30) as c:
            assert c.post("/ui/login", data={"key": "rw-admin-from-file"}).status_code == 303
            assert c.get("/ui/api/me").json()["role"] == "admin"
            tokens = c.get(f"/ui/api/sessions/{recorded['session']['session_id']}/tokens", params={"turn": "last"})
            assert tokens.status_code == 200, tokens.text
            text = tokens.json()["text"]
            assert text and not any(t.startswith("<") and t[1:-1].isdigit() for t in text)  # text, not <id>
    finally:
        v.stop()


def test_a_missing_store_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.db"
    r = subprocess.run([sys.executable, "-m", "rollway.cli", "view", "--db", f"sqlite:///{missing}", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no store at" in r.stderr and not missing.exists()
    bad = subprocess.run([sys.executable, "-m", "rollway.cli", "view", "--db", "mysql://x/y", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "rollway view" in bad.stderr and "Traceback" not in bad.stderr


def test_help_explains() -> None:
    r = subprocess.run([sys.executable, "-m", "rollway.cli", "view", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    for words in ("no inference engine", "viewer key", "ROLLWAY_ADMIN_KEY", "rollway-demo/rollway.db"):
        assert words in r.stdout, words


def test_the_pages_open_without_an_engine(view: View, recorded: dict[str, Any]) -> None:
    """The pages of gateway/ui/ are mounted and read the store alone (a viewer signed in with the form)."""
    session = recorded["session"]["session_id"]
    with httpx.Client(base_url=view.url, timeout=60) as c:
        assert c.post("/ui/login", data={"key": recorded["viewer"]["key"]}).status_code == 303
        for path in ("/ui", "/ui/groups", f"/ui/sessions/{session}"):
            r = c.get(path, headers={"Accept": "text/html"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (path, r.text[:300])
        assert c.get("/ui/api/overview").status_code == 200
        assert c.get("/ui/static/ui.css").status_code == 200
        icon = c.get("/favicon.ico")  # every page's origin is asked for it: no 404 in the console
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
        assert icon.content[:4] == b"\x00\x00\x01\x00"


@pytest.fixture(scope="module")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.conftest import _fresh_db

    yield from _fresh_db("postgres", tmp_path_factory.mktemp("pg"))


@pytest.mark.postgres
def test_it_serves_a_postgresql_store_and_refuses_one_behind(pg_url: str, tiny_model_dir: Path) -> None:
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=pg_url) as gw:
        viewer = gw.admin.post("/v1/viewer_keys", json={"name": "pg"}).json()["key"]
    v = View("--db", pg_url)
    try:
        v.start()
        with httpx.Client(base_url=v.url, timeout=30) as c:
            assert c.get("/ui/api/me", headers={"Authorization": f"Bearer {viewer}"}).json()["role"] == "viewer"
    finally:
        v.stop()


@pytest.mark.postgres
def test_a_postgresql_store_behind_the_code_is_refused(pg_url: str) -> None:
    import secrets

    from tests.conftest import PG_HOST, PG_PORT, _pg_admin

    name = f"rollway_test_{secrets.token_hex(6)}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    try:
        url = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}"
        upgrade(url, "0002")
        r = subprocess.run([sys.executable, "-m", "rollway.cli", "view", "--db", url, "--port", "0"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "rollway db upgrade" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
