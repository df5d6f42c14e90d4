"""One stack for the client tests, started once for this package's tests.

`tuned_model`: the tiny model fine-tuned to think, call the calculate tool and answer (tests/clients/model.py),
committed under tests/clients/tuned-model so that no test depends on the CPU that would train it. `stack`:
`rollway engine` on it, a recording proxy, and `rollway serve --backend <proxy>` on a SQLite file;
`stack.new_session()` creates a greedy group of one session and hands back its credentials;
`assert_engine_chain` checks that what the gateway stored for a session is exactly what the engine
generated, as one token chain.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.model import COMMITTED
from tests.clients.proxy import RecordingProxy


@dataclass
class ClientSession:
    """One session's credentials as `POST /v1/groups` hands them out."""

    id: str
    group_id: str
    api_key: str
    base_url: str
    """OpenAI base URL (`.../v1`)."""
    session_base_url: str
    anthropic_base_url: str
    """What the Anthropic SDK takes (it appends `/v1/messages`): the group's answer's own when it names
    one, else `base_url` without its `/v1`."""
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class Stack:
    gateway: str
    admin_key: str
    proxy: RecordingProxy
    model: Path
    logs: Path

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, headers={"Authorization": f"Bearer {self.admin_key}"},
                            timeout=60, trust_env=False)

    def new_session(self, sampling: dict[str, Any] | None = None) -> ClientSession:
        """A group of one greedy session (greedy: the tuned model's replies are then reproducible)."""
        with self.admin() as http:
            r = http.post("/v1/groups", json={"task": {"client_test": True}, "n_samples": 1,
                                              "sampling": sampling or {"temperature": 0.0}})
            assert r.status_code == 201, r.text
        group = r.json()
        s = group["sessions"][0]
        named = s.get("anthropic_base_url")
        return ClientSession(id=s["session_id"], group_id=group["group_id"], api_key=s["api_key"], base_url=s["base_url"],
                             session_base_url=s["session_base_url"],
                             anthropic_base_url=named or s["base_url"].removesuffix("/").removesuffix("/v1"),
                             raw=s)

    def session(self, session_id: str) -> dict[str, Any]:
        """The stored record, over REST (GET /v1/sessions/{id})."""
        with self.admin() as http:
            r = http.get(f"/v1/sessions/{session_id}")
            assert r.status_code == 200, r.text
            return r.json()


def assert_engine_chain(stack: Stack, session_id: str, since: int, *, turns: int | None = None) -> dict[str, Any]:
    """Every stored turn of the session has the prompt ids the engine was sent and exactly the output ids it
    answered (one /generate per turn, the engine's records from index `since` on being this session's), and
    the turns form one token chain: each later turn's prompt starts with its parent's prompt + completion."""
    record = stack.session(session_id)
    chain = sorted(record["turns"], key=lambda t: t["seq"])
    assert chain, f"session {session_id} stored no turn"
    if turns is not None:
        assert len(chain) == turns, [(t["seq"], t["finish_reason"]) for t in chain]
    assert chain[0]["continuity"] == "new-chain" and chain[0]["parent_id"] is None
    for parent, turn in itertools.pairwise(chain):
        assert turn["continuity"] == "extends", (turn["seq"], turn["chain_reason"])
        assert turn["parent_id"] == parent["id"]
        prefix = parent["prompt_ids"] + parent["completion_ids"]
        assert turn["prompt_ids"][: len(prefix)] == prefix
    for turn in chain:
        assert turn["completion_ids"], turn["id"]
        assert len(turn["logprobs"]) == len(turn["completion_ids"]) == len(turn["versions"])
    engine = stack.proxy.generate_records(since)
    assert all((r["finish_reason"] or {}).get("type") != "abort" for r in engine), engine
    stored = Counter((tuple(t["prompt_ids"]), tuple(t["completion_ids"])) for t in chain)
    produced = Counter((tuple(r["input_ids"]), tuple(r["output_ids"])) for r in engine)
    assert stored == produced, (f"stored turns {[(len(p), c) for p, c in stored]} != engine calls "
                                f"{[(len(p), c) for p, c in produced]}")
    return record


@pytest.fixture(scope="session")
def tuned_model() -> Path:
    """The committed tuned model (tests/clients/tuned-model, built by `python -m tests.clients.model`); whether it
    follows the current recipe and has every trained form is tests/clients/test_tuned_model.py's to say."""
    assert (COMMITTED / "config.json").is_file(), f"no tuned model at {COMMITTED}: run python -m tests.clients.model"
    return COMMITTED


@pytest.fixture(scope="package")  # not held through the rest of a whole-suite run
def stack(tuned_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from rollway.embedded import engine_process, free_port, stop, wait_healthy

    logs = tmp_path_factory.mktemp("client-stack")
    key = "rw-admin-" + secrets.token_urlsafe(24)
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as es, pytest.MonkeyPatch.context() as mp:
        if "OMP_NUM_THREADS" not in os.environ:
            mp.setenv("OMP_NUM_THREADS", "1")  # the engine shares a small machine
        engine_url = es.enter_context(engine_process(tuned_model, log_path=logs / "engine.log"))
        proxy = es.enter_context(RecordingProxy(engine_url))
        gw_log = es.enter_context((logs / "gateway.log").open("ab"))
        gw = subprocess.Popen(
            [sys.executable, "-m", "rollway.cli", "serve", "--backend", proxy.url, "--tokenizer", str(tuned_model),
             "--db", f"sqlite:///{logs / 'rollway.db'}", "--port", str(port), "--data-dir", str(logs / "data")],
            stdout=gw_log, stderr=subprocess.STDOUT, env={**os.environ, "ROLLWAY_ADMIN_KEY": key},
        )
        es.callback(stop, gw)
        wait_healthy(gateway, gw, timeout=180)
        yield Stack(gateway=gateway, admin_key=key, proxy=proxy, model=tuned_model, logs=logs)
