"""The backend pool at run time through the gateway: a backend added later is brought to the current
weight version before it gets traffic; removing one keeps sessions going on the others; a backend that
dies mid-load costs the agents no failed request."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


def chat(gw: LiveGateway, cred: dict[str, Any]) -> Any:
    return gw.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                   max_tokens=3)


def test_added_backend_serves_current_version_before_traffic(tiny_model_dir: Path, sqlite_url: str,
                                                             tmp_path: Path) -> None:
    with FakeSGLang() as a, FakeSGLang() as b, LiveGateway(backends=[a.url], tokenizer=str(tiny_model_dir),
                                                          db=sqlite_url) as gw:
        v = gw.admin.get("/v1/weights").json()["version"] + 1
        assert gw.admin.post("/v1/weights", json={"version": v, "model_path": str(tmp_path)}).status_code == 200
        r = gw.admin.post("/v1/backends", json={"url": b.url})
        assert r.status_code == 201, r.text
        assert b.weight_version == str(v)
        assert [p for p, _ in b.calls][:1] == ["/update_weights_from_disk"] and not b.requests
        listed = gw.admin.get("/v1/backends").json()["data"]
        assert {x["url"] for x in listed} == {a.url, b.url}
        # Remove the first: every new call goes to the second, carrying the current version.
        a_id = next(x["id"] for x in listed if x["url"] == a.url)
        assert gw.admin.delete(f"/v1/backends/{a_id}").status_code == 200
        cred = gw.group(2)["sessions"][0]
        chat(gw, cred)
        assert b.requests and set(gw.session(cred["session_id"])["turns"][0]["versions"]) == {v}
        assert gw.admin.post("/v1/backends", json={"url": "http://127.0.0.1:9"}).status_code == 400
        assert gw.admin.delete("/v1/backends/no-such-id").status_code == 404


def test_backend_dying_mid_load_fails_no_request(tiny_model_dir: Path, sqlite_url: str) -> None:
    with FakeSGLang(token_delay=0.002) as a, FakeSGLang(token_delay=0.002) as b, LiveGateway(
        backends=[a.url, b.url], tokenizer=str(tiny_model_dir), db=sqlite_url
    ) as gw:
        groups = [gw.group(4) for _ in range(4)]
        creds = [c for g in groups for c in g["sessions"]]
        errors: list[Exception] = []

        def agent(cred: dict[str, Any]) -> None:
            for _ in range(3):
                try:
                    chat(gw, cred)
                except Exception as e:  # counted, the assertion below reports them
                    errors.append(e)

        threads = [threading.Thread(target=agent, args=(c,)) for c in creds]
        for t in threads:
            t.start()
        a.down = True  # connections to the first backend now drop
        for t in threads:
            t.join(60)
        assert errors == []
        assert all(len(gw.session(c["session_id"])["turns"]) == 3 for c in creds)


def test_backend_recovering_during_a_publish_gets_its_version(tiny_model_dir: Path, sqlite_url: str,
                                                              tmp_path: Path) -> None:
    """A backend the health loop admits while a publish loads the others waits for that publish and loads
    its version: a publish updates the backends in rotation when it starts, so one that read the version
    before the publish stored the next, and joined the rotation after it started, once kept serving the old
    weights (seen with a backend another gateway added, admitted during a publish)."""
    with FakeSGLang(load_delay=1.5) as a, FakeSGLang() as x, LiveGateway(
        backends=[a.url, x.url], tokenizer=str(tiny_model_dir), db=sqlite_url, health_interval_s=0.1
    ) as gw:
        def x_listed() -> dict[str, Any]:
            return next(b for b in gw.admin.get("/v1/backends").json()["data"] if b["url"] == x.url)

        x.healthy = False
        _wait(lambda: not x_listed()["healthy"], "the health loop never took the silent backend out")
        v = gw.admin.get("/v1/weights").json()["version"] + 1
        publish = threading.Thread(target=lambda: gw.admin.post(
            "/v1/weights", json={"version": v, "model_path": str(tmp_path)}).raise_for_status())
        publish.start()
        _wait(lambda: "/update_weights_from_disk" in [p for p, _ in a.calls], "the publish never reached a")
        x.healthy = True  # admitted by the health loop while `a` loads (1.5 s)
        publish.join(30)
        assert a.weight_version == str(v)
        _wait(lambda: x.weight_version == str(v), f"the backend admitted during the publish never loaded {v}")
        # The fake has the version once its load is done, a moment before the gateway reads the answer and puts
        # the backend in rotation (asserted at once, that failed on a busy machine with x still out, then in).
        _wait(lambda: x_listed()["healthy"] and x_listed()["weight_version"] == str(v),
              f"the backend admitted during the publish never went back in rotation with {v}")


def _wait(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
