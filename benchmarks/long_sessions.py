"""Long agent sessions: the gateway's cost per turn over a session's length, and the store's size per byte of
conversation (issue 31).

    python benchmarks/long_sessions.py                                   # defaults: 4 x 120 turns x 400 words
    python benchmarks/long_sessions.py --sessions 2 --turns 40 --words 120 --dbs sqlite   # a quick look
    python benchmarks/long_sessions.py --code before=/path/to/old/checkout --code after=.  # alternated

S sessions of T turns each run side by side through the real `openai` SDK (AsyncOpenAI, one client per session
key) against the gateway, which generates through the fast fake SGLang (tests/fakes/fast_backend.py: the same
30-token text reply at once, so only the gateway's own cost shows). Each session starts with a system prompt
and a task; every later turn sends the whole conversation again, as the OpenAI API demands: the previous
reply as the SDK returned it (`message.to_dict()`) and a new user message carrying W words of tool output.
One tool is offered with every call. With the defaults a session ends at ~100k tokens of context.

All sessions make turn t together, and the gateway's CPU is read between turns, so "CPU per turn" at turn t is
the gateway's CPU over that step divided by S; the table shows its mean by tenth of the session. The CPU is
the run time of the gateway's threads in nanoseconds (/proc/PID/task/TID/schedstat): utime + stime count
10 ms clock ticks, and a step of S turns takes a few ms, so a tenth's figure read that way moved by ~10% on
the ticks alone. The JSON gives both clocks' totals over the run (`cpu_total_ms`, `cpu_total_ms_ticks`).
Client latency is the wall time of one `chat.completions.create`.

Store bytes: what the database grew by over the run (SQLite: the file after a WAL checkpoint; PostgreSQL:
pg_database_size, TOAST compression included), divided by the conversation bytes of all sessions (one
session's: the compact UTF-8 JSON of its final `messages` plus the last reply). `turn bytes` is the sum of
the stored lengths of the turns rows' columns (token ids, logprobs and versions included).

`--code NAME=DIR` runs the gateway (and its store migrations) from another checkout; given more than once,
every database runs every variant in turn, alternating, `--repeat` rounds, so ratios are measured under the
same load. Needs PostgreSQL at --pg (trust auth) for `postgres`. Prints a table and a final JSON line.

Targets (issue 31): CPU per turn in the last tenth <= 2x the first tenth; <= 4 bytes stored per byte of final
conversation; on SQLite and PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_procs import ROOT, proc_table, tree_ms, tree_run_ms

from rollway.embedded import free_port

WORDS = ("the of and to in is was that for on with as by at from file line error test value return function "
         "class def import self none true false data path result output status build module passed failed "
         "assert expected got diff patch repo branch commit config").split()
TOOL = {"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command in the repository and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}}
SYSTEM = "You are a software agent. Use the tool to inspect and change the repository; answer briefly."
TASK = "The test suite fails on the parser module. Find the cause and fix it."

LAUNCH = """
import sys
import uvicorn
from gateway.store.db import upgrade
from gateway.app import create_app
from gateway.settings import Settings
backend, tokenizer, db, port, data_dir = sys.argv[1:6]
upgrade(db)
s = Settings(backends=[backend], tokenizer=tokenizer, db=db, port=int(port), data_dir=data_dir)
uvicorn.run(create_app(s, admin_key=s.admin_key), host="127.0.0.1", port=s.port, loop="uvloop",
            http="httptools", access_log=False, log_level="warning")
"""


def observation(rng: random.Random, turn: int, words: int) -> str:
    return f"$ step {turn}\n" + " ".join(rng.choice(WORDS) for _ in range(words))


def http_json(url: str, body: Any = None, key: str | None = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"no answer at {url}:\n{log.read_text(errors='replace')[-3000:]}")


def start(cmd: list[str], log: Path, pythonpath: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=pythonpath, env={**os.environ, "PYTHONPATH": pythonpath}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


# --- the store's size ---------------------------------------------------------------------------------------

async def _pg(host: str, port: int, sql: str, database: str = "postgres") -> Any:
    import asyncpg

    conn = await asyncpg.connect(host=host, port=port, user="postgres", database=database)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


def store_size(db: str, args: argparse.Namespace) -> tuple[int, int]:
    """(database bytes, stored bytes of the turns rows)."""
    if db.startswith("sqlite"):
        path = db.split("///", 1)[1]
        con = sqlite3.connect(path)
        try:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            cols = [r[1] for r in con.execute("PRAGMA table_info(turns)")]
            expr = " + ".join(f"coalesce(length(CAST({c} AS BLOB)), 0)" for c in cols)
            turn = con.execute(f"SELECT coalesce(sum({expr}), 0) FROM turns").fetchone()[0]
        finally:
            con.close()
        return os.path.getsize(path), int(turn)
    name = db.rsplit("/", 1)[1]
    size = asyncio.run(_pg(args.pg_host, args.pg_port, "SELECT pg_database_size(current_database())", name))
    turn = asyncio.run(_pg(args.pg_host, args.pg_port, "SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM turns t",
                           name))
    return int(size), int(turn)


# --- one run -------------------------------------------------------------------------------------------------


async def one_session_turn(client: Any, state: dict[str, Any], turn: int, rng: random.Random,
                           args: argparse.Namespace) -> float:
    msgs = state["messages"]
    if turn > 0:
        msgs.append(state["reply"])
        msgs.append({"role": "user", "content": observation(rng, turn, args.words)})
    t0 = time.perf_counter()
    resp = await client.chat.completions.create(model="tiny", messages=msgs, tools=[TOOL], max_tokens=64,
                                                temperature=0.7)
    took = time.perf_counter() - t0
    state["reply"] = resp.choices[0].message.to_dict()
    state["tokens"] = resp.usage.prompt_tokens + resp.usage.completion_tokens
    return took


async def drive(base: str, keys: list[str], gw_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0, timeout=300) for k in keys]
    states = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]}
              for _ in keys]
    rngs = [random.Random(1000 + i) for i in range(len(keys))]
    cpu: list[float] = []
    lat: list[list[float]] = []
    table = proc_table()
    ticks0, run0 = tree_ms(table, gw_pid), tree_run_ms(table, gw_pid)
    try:
        for t in range(args.turns):
            before = tree_run_ms(proc_table(), gw_pid)
            took = await asyncio.gather(*(one_session_turn(c, s, t, r, args)
                                          for c, s, r in zip(clients, states, rngs, strict=True)))
            cpu.append((tree_run_ms(proc_table(), gw_pid) - before) / len(keys))
            lat.append([x * 1000 for x in took])
    finally:
        for c in clients:
            await c.close()
    table = proc_table()
    # The two clocks over the whole run: they agree unless a thread of the gateway exited during it.
    totals = {"cpu_total_ms": round(tree_run_ms(table, gw_pid) - run0, 1),
              "cpu_total_ms_ticks": round(tree_ms(table, gw_pid) - ticks0, 1)}
    conv = sum(len(json.dumps([*s["messages"], s["reply"]], separators=(",", ":"), ensure_ascii=False).encode())
               for s in states)
    return {"cpu": cpu, "lat": lat, "conversation_bytes": conv, **totals,
            "tokens": statistics.mean(s["tokens"] for s in states)}


def tenths(values: list[float]) -> list[float]:
    n = len(values)
    return [statistics.mean(values[i * n // 10:max((i + 1) * n // 10, i * n // 10 + 1)]) for i in range(10)]


def run_one(variant: str, code: str, dbkind: str, args: argparse.Namespace, backend: str, tokenizer: Path,
            workdir: Path) -> dict[str, Any]:
    tag = f"{variant}-{dbkind}-{secrets.token_hex(3)}"
    if dbkind == "sqlite":
        db = f"sqlite:///{workdir / (tag + '.db')}"
    else:
        dbname = f"rollway_long_{os.getpid()}_{secrets.token_hex(3)}"
        asyncio.run(_pg(args.pg_host, args.pg_port, f'CREATE DATABASE "{dbname}"'))
        db = f"postgresql://postgres@{args.pg_host}:{args.pg_port}/{dbname}"
    admin_key = secrets.token_urlsafe(24)
    port = free_port()
    log = workdir / f"{tag}.log"
    launch = workdir / "launch_gateway.py"
    launch.write_text(LAUNCH)
    os.environ["ROLLWAY_ADMIN_KEY"] = admin_key
    # A session records prompt + completion of every turn: ~6M tokens for the defaults' 120 turns.
    os.environ["ROLLWAY_MAX_SESSION_TOKENS"] = str(10**9)
    proc = start([sys.executable, str(launch), backend, str(tokenizer), db, str(port), str(workdir / tag)], log,
                 code)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_up(f"{base}/health", proc, log)
        group = http_json(f"{base}/v1/groups", {"task": {"bench": "long"}, "n_samples": args.sessions}, admin_key)
        keys = [s["api_key"] for s in group["sessions"]]
        size0, _ = store_size(db, args)
        print(f"  {variant} {dbkind}: {args.sessions} x {args.turns} turns ...", file=sys.stderr, flush=True)
        spy = None
        if args.py_spy:  # sampled over the turns only; written when py-spy gets SIGINT
            spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-r", "200", "-f", "raw", "-o",
                                    str(Path(args.py_spy) / f"{variant}-{dbkind}.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        t0 = time.monotonic()
        try:
            got = asyncio.run(drive(base, keys, proc.pid, args))
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
        wall = time.monotonic() - t0
        rss, hwm = rss_kib(proc.pid)
        size1, turn_bytes = store_size(db, args)
    finally:
        stop(proc)
        if dbkind == "postgres":
            asyncio.run(_pg(args.pg_host, args.pg_port, f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
    cpu_t = tenths(got["cpu"])
    lat_turn = [statistics.median(x) for x in got["lat"]]
    row = {
        "variant": variant, "db": dbkind, "wall_s": round(wall, 1),
        "cpu_ms_by_tenth": [round(x, 2) for x in cpu_t],
        "cpu_last_over_first": round(cpu_t[-1] / cpu_t[0], 2),
        "cpu_ms_mean": round(statistics.mean(got["cpu"]), 2),
        "cpu_total_ms": got["cpu_total_ms"], "cpu_total_ms_ticks": got["cpu_total_ms_ticks"],
        "latency_ms_by_tenth": [round(x, 1) for x in tenths(lat_turn)],
        "latency_p50_ms": round(statistics.median(x for xs in got["lat"] for x in xs), 1),
        "store_bytes": size1 - size0, "turn_bytes": turn_bytes,
        "conversation_bytes": got["conversation_bytes"],
        "store_per_conv_byte": round((size1 - size0) / got["conversation_bytes"], 2),
        "turn_bytes_per_conv_byte": round(turn_bytes / got["conversation_bytes"], 2),
        "tokens_per_session": round(got["tokens"]),
        "gateway_rss_mib": round(rss / 1024, 1), "gateway_peak_rss_mib": round(hwm / 1024, 1),
    }
    print(f"  {variant} {dbkind}: cpu/turn {row['cpu_ms_by_tenth'][0]} -> {row['cpu_ms_by_tenth'][-1]} ms, "
          f"store {row['store_per_conv_byte']} B/B, {wall:.0f} s", file=sys.stderr, flush=True)
    return row


def report(rows: list[dict[str, Any]], args: argparse.Namespace, load: list[float]) -> None:
    print(f"\n{args.sessions} sessions x {args.turns} turns x {args.words} words of tool output; gateway CPU ms per "
          "turn by tenth of the session (medians over rounds)")
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["variant"], r["db"]), []).append(r)
    head = (f"{'variant':<10}{'db':<10}" + "".join(f"{f'{i + 1}/10':>7}" for i in range(10))
            + f"{'last/1st':>9}{'p50 ms':>8}{'last ms':>8}{'B/B':>7}{'turnB/B':>8}{'RSS MiB':>8}{'tokens':>8}")
    print(head)
    print("-" * len(head))
    med = []
    for (variant, db), rs in by.items():
        cpu = [statistics.median(r["cpu_ms_by_tenth"][i] for r in rs) for i in range(10)]
        m = {"variant": variant, "db": db, "rounds": len(rs), "cpu_ms_by_tenth": [round(x, 2) for x in cpu],
             "cpu_last_over_first": round(cpu[-1] / cpu[0], 2)}
        for k in ("latency_p50_ms", "store_per_conv_byte", "turn_bytes_per_conv_byte", "gateway_rss_mib",
                  "gateway_peak_rss_mib", "tokens_per_session", "conversation_bytes", "store_bytes", "wall_s"):
            m[k] = statistics.median(r[k] for r in rs)
        m["latency_last_tenth_ms"] = statistics.median(r["latency_ms_by_tenth"][-1] for r in rs)
        med.append(m)
        print(f"{variant:<10}{db:<10}" + "".join(f"{x:>7.2f}" for x in cpu)
              + f"{m['cpu_last_over_first']:>9.2f}{m['latency_p50_ms']:>8.1f}{m['latency_last_tenth_ms']:>8.1f}"
              f"{m['store_per_conv_byte']:>7.2f}{m['turn_bytes_per_conv_byte']:>8.2f}{m['gateway_rss_mib']:>8.0f}"
              f"{m['tokens_per_session']:>8.0f}")
    print(f"load average (1 min) at the start and end: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} CPUs")
    targets = {f"{m['variant']}_{m['db']}": {"cpu_ok": m["cpu_last_over_first"] <= 2.0,
                                              "store_ok": m["store_per_conv_byte"] <= 4.0} for m in med}
    print(json.dumps({"benchmark": "long_sessions", "sessions": args.sessions, "turns": args.turns,
                      "words": args.words, "repeat": args.repeat, "cpus": os.cpu_count(), "load": load,
                      "medians": med, "results": rows, "targets": targets}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=120)
    parser.add_argument("--words", type=int, default=400, help="words of tool output per turn")
    parser.add_argument("--dbs", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                        help="run the gateway from this checkout (repeatable; default: this one)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--py-spy", default="", metavar="DIR", help="py-spy record each gateway into DIR")
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    args = parser.parse_args()
    variants = [tuple(c.split("=", 1)) for c in args.code] or [("this", str(ROOT))]
    variants = [(n, str(Path(d).resolve())) for n, d in variants]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(ROOT))
    from engine.tiny_model import create_tiny_model

    load = [os.getloadavg()[0]]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rollway-long-") as tmp:
        workdir = Path(tmp)
        tokenizer = create_tiny_model(workdir / "tiny", seed=0)
        port = free_port()
        log = workdir / "backend.log"
        backend_proc = start([sys.executable, "-m", "tests.fakes.fast_backend", "--port", str(port),
                              "--context-length", "1048576"], log, str(ROOT))
        try:
            backend = f"http://127.0.0.1:{port}"
            wait_up(f"{backend}/health", backend_proc, log)
            for round_ in range(args.repeat):
                for dbkind in args.dbs:
                    for variant, code in variants:
                        row = run_one(variant, code, dbkind, args, backend, tokenizer, workdir)
                        rows.append({**row, "round": round_})
        finally:
            stop(backend_proc)
    load.append(os.getloadavg()[0])
    report(rows, args, load)


if __name__ == "__main__":
    main()
