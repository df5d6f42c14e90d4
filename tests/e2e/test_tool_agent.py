"""End to end on CPU: runner + gateway + engine + a tiny model run the calculator tool agent.

The random tiny model never emits a tool call, so it first gets a short SFT on calculator transcripts
(system + question -> `<tool_call>` calculate -> tool result -> the number). Then a few greedy groups run
runner (in-process `Runner`) -> gateway (`rollway serve --backend`) -> recording proxy -> `rollway engine`.
The proxy forwards everything unchanged and keeps, for each /generate, the input ids the gateway sent and
the output ids the engine answered, so the test can show that every stored session is one token chain
whose model-generated spans are exactly the engine's output ids.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from rollway.embedded import engine_process, free_port, stop, wait_healthy
from rollway_common.paths import agent_file

pytestmark = pytest.mark.slow

SYSTEM = "Use the calculate tool, then answer with the number only."
# Measured on the 2-core dev machine: 12 steps of 8 chats at lr 3e-3 give a parseable greedy tool call on
# ~8/10 held-out questions, 20 steps on 10/10 (about a minute of SFT, torchrun start included).
SFT_STEPS = 20
SFT_BATCH = 8
SFT_LR = 3e-3
N_TASKS = 3
N_SAMPLES = 2


def _calculator() -> ModuleType:
    """agents/calculator.py as a module (its TOOLS schema, calculate() and the agent's run())."""
    path = agent_file("calculator.py")
    spec = importlib.util.spec_from_file_location("rollway_agent_calculator_e2e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _transcript(calc: ModuleType, expression: str) -> dict[str, Any]:
    result = calc.calculate(expression)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})}}
    return {"tools": calc.TOOLS, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": result},
    ]}


def _sft(calc: ModuleType, model: Path, out: Path) -> Path:
    from trainer.launch import main as train_main

    rng = random.Random(0)
    data = out / "sft.jsonl"
    with data.open("w") as f:
        for _ in range(SFT_STEPS * SFT_BATCH):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps(_transcript(calc, f"{a}{rng.choice('+-*')}{b}")) + "\n")
    rc = train_main(["--mode", "sft", "--model", str(model), "--out", str(out / "sft"), "--sft-data", str(data),
                     "--steps", str(SFT_STEPS), "--lr", str(SFT_LR), "--nproc", "1",
                     "--sft-batch-sequences", str(SFT_BATCH), "--checkpoint-every", "1000"])
    assert rc == 0, f"SFT failed (exit {rc}); see {out / 'sft'}"
    final = out / "sft" / "weights" / "sft-final"
    assert (final / "config.json").is_file()
    return final


class RecordingProxy:
    """A minimal HTTP proxy in a thread: forwards every request to `target` as is (streams included) and
    records each /generate exchange: input_ids, output_ids, finish_reason, rid, stream, sampling_params."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.records: list[dict[str, Any]] = []
        self.url = ""
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="recording-proxy", daemon=True)
        self._runner: Any = None
        self._session: Any = None

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def generate_records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.records)

    async def _start(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, web

        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_read=300))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self._session.request(request.method, self.target + request.path_qs, data=body,
                                         headers=headers) as up:
            passed = {k: v for k, v in up.headers.items() if k.lower() == "content-type"}
            generate = request.path == "/generate" and request.method == "POST" and up.status == 200
            req = json.loads(body) if generate else {}
            if generate and req.get("stream"):
                resp = web.StreamResponse(status=up.status, headers=passed)
                await resp.prepare(request)
                raw = b""
                async for piece in up.content.iter_any():
                    raw += piece
                    await resp.write(piece)
                await resp.write_eof()
                self._record(req, _last_sse_state(raw), stream=True)
                return resp
            data = await up.read()
            if generate:
                obj = json.loads(data)
                self._record(req, (obj["output_ids"], obj["meta_info"].get("finish_reason")), stream=False)
            return web.Response(body=data, status=up.status, headers=passed)

    def _record(self, req: dict[str, Any], result: tuple[list[int], Any], *, stream: bool) -> None:
        ids, finish = result
        with self._lock:
            self.records.append({"input_ids": list(req["input_ids"]), "output_ids": list(ids),
                                 "finish_reason": finish, "rid": req.get("rid"), "stream": stream,
                                 "sampling_params": req.get("sampling_params") or {}})


def _last_sse_state(raw: bytes) -> tuple[list[int], Any]:
    """Output ids and finish reason of a /generate SSE stream, cumulative or incremental chunks alike
    (`meta_info.completion_tokens` is cumulative in both modes)."""
    ids: list[int] = []
    finish = None
    for event in raw.decode().split("\n\n"):
        data = event.strip().removeprefix("data:").strip()
        if not data or data == "[DONE]":
            continue
        obj = json.loads(data)
        out, meta = list(obj["output_ids"]), obj["meta_info"]
        ids = ids + out if len(ids) + len(out) == meta["completion_tokens"] else out
        finish = meta.get("finish_reason") or finish
    return ids, finish


async def _run_groups(gateway: str, key: str, agent: Any, tasks: list[dict[str, Any]]) -> tuple[list[Any], Any]:
    from rollway.rollout import Runner

    runner = Runner(gateway, key, agent, concurrency=4, client_timeout=120.0)
    try:
        rewards = await asyncio.gather(
            *(runner.run_group(t, N_SAMPLES, sampling={"temperature": 0.0}) for t in tasks))
    finally:
        await runner.close()
    return rewards, runner.stats


def _sessions(gateway: str, key: str) -> list[dict[str, Any]]:
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        r = http.get("/v1/sessions", params={"limit": 100})
        r.raise_for_status()
        out = []
        for row in r.json()["data"]:
            s = http.get(f"/v1/sessions/{row['id']}")
            s.raise_for_status()
            out.append(s.json())
        return out


@pytest.mark.timeout(900)
def test_tool_agent_sessions_are_one_chain_of_engine_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.tiny_model import create_tiny_model
    from trainer.sft import session_rows

    t0 = time.monotonic()
    if "OMP_NUM_THREADS" not in os.environ:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # children (torchrun, engine) share a small machine
    key = "rw-admin-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("ROLLWAY_ADMIN_KEY", key)
    calc = _calculator()
    tasks = [json.loads(line) for line in agent_file("tasks/calculator.jsonl").read_text().splitlines()
             if line.strip()][:N_TASKS]

    model = _sft(calc, create_tiny_model(tmp_path / "model-init", seed=0), tmp_path)
    t_sft = time.monotonic()

    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    gw_log_path = tmp_path / "gateway.log"
    with engine_process(model, log_path=tmp_path / "engine.log") as engine_url, RecordingProxy(engine_url) as proxy:
        with gw_log_path.open("ab") as gw_log:
            gw = subprocess.Popen(
                [sys.executable, "-m", "rollway.cli", "serve", "--backend", proxy.url, "--tokenizer", str(model),
                 "--db", f"sqlite:///{tmp_path / 'rollway.db'}", "--port", str(port),
                 "--data-dir", str(tmp_path / "gateway-data")],
                stdout=gw_log, stderr=subprocess.STDOUT,
            )
            try:
                wait_healthy(gateway, gw, timeout=120)
                rewards, stats = asyncio.run(asyncio.wait_for(
                    _run_groups(gateway, key, calc.run, tasks), timeout=300))
                sessions = _sessions(gateway, key)
            finally:
                stop(gw)
        records = proxy.generate_records()
    t_end = time.monotonic()
    (tmp_path / "sessions.json").write_text(json.dumps({"sessions": sessions, "engine": records}, indent=1))
    print(f"\nSFT {t_sft - t0:.1f}s, rollout {t_end - t_sft:.1f}s, total {t_end - t0:.1f}s; "
          f"rewards {rewards}; {len(records)} /generate calls")

    # -- every session ran to the end and is one chain of turns
    assert stats.sessions_failed == 0, f"agent errors; see {gw_log_path}"
    assert len(sessions) == N_TASKS * N_SAMPLES
    turns = [t for s in sessions for t in s["turns"]]
    for s in sessions:
        assert s["state"] == "finished", s["state"]
        chain = sorted(s["turns"], key=lambda t: t["seq"])
        assert chain, f"session {s['id']} has no turns"
        assert chain[0]["continuity"] == "new-chain" and chain[0]["parent_id"] is None
        for parent, turn in itertools.pairwise(chain):
            assert turn["continuity"] == "extends", (s["id"], turn["seq"], turn["chain_reason"])
            assert turn["parent_id"] == parent["id"]
            prefix = parent["prompt_ids"] + parent["completion_ids"]
            assert turn["prompt_ids"][: len(prefix)] == prefix
            assert len(turn["prompt_ids"]) > len(prefix)  # plus the tool result the agent sent back
        # What the trainer builds from the session: one sequence, the last turn's exact ids, with the loss
        # mask on precisely the model-generated spans of the chain.
        rows = session_rows(s)
        assert len(rows) == 1
        row, last = rows[0], chain[-1]
        assert row.token_ids == last["prompt_ids"] + last["completion_ids"]
        spans: list[int] = []
        for turn in chain:
            start = len(turn["prompt_ids"])
            assert row.token_ids[start: start + len(turn["completion_ids"])] == turn["completion_ids"]
            spans += turn["completion_ids"]
        assert [t for t, m in zip(row.token_ids, row.loss_mask, strict=True) if m] == spans

    # -- the model-generated spans are exactly what the engine produced, for exactly those prompts
    assert all((r["finish_reason"] or {}).get("type") != "abort" for r in records), records
    assert all(r["sampling_params"].get("temperature") == 0.0 for r in records)  # the group's greedy policy
    engine_pairs = Counter((tuple(r["input_ids"]), tuple(r["output_ids"])) for r in records)
    stored_pairs = Counter((tuple(t["prompt_ids"]), tuple(t["completion_ids"])) for t in turns)
    assert len(records) == len(turns)
    assert stored_pairs == engine_pairs

    # -- tool-call turns: a calculate call, its result sent back, and a turn that extends the call
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with_tools = 0
    for s in sessions:
        by_id = {t["id"]: t for t in s["turns"]}
        replied = [tc["id"] for t in s["turns"] for tc in (t["reply"] or {}).get("tool_calls") or []]
        assert [c["id"] for c in s["tool_calls"]] == replied
        for call in s["tool_calls"]:
            assert call["name"] == "calculate"
            try:  # exactly as the agent reads it
                expression = json.loads(call["arguments"]).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            assert call["result"] == calc.calculate(str(expression))
            child = by_id[call["result_turn_id"]]
            assert child["continuity"] == "extends" and child["parent_id"] == call["turn_id"]
            parent = by_id[call["turn_id"]]
            assert "<tool_call>" in tok.decode(parent["completion_ids"])  # the call is the model's own tokens
            delta = child["prompt_ids"][len(parent["prompt_ids"]) + len(parent["completion_ids"]):]
            assert f"<tool_response>\n{call['result']}\n</tool_response>" in tok.decode(delta)
            with_tools += 1
    assert with_tools >= 1, "no session made a tool call; the SFT warm-up did not take"
