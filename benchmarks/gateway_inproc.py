"""The gateway's own work per chat call, without HTTP servers or a load generator: its ASGI app called in-process
by C concurrent workers running `gateway.py`'s two-call sessions (the same bodies, the same fast fake backend in
its own process), on SQLite or PostgreSQL. Two figures per checkout:

- CPU per call: the process's CPU time over the measured rounds / calls (the smallest round's);
- with `--callgrind`: instructions per call, counted by valgrind's callgrind over one measured round (user-space
  instructions only, kernel work not counted). This count does not move with other work on the machine, so two
  checkouts compare on a shared machine where `gateway.py`'s CPU figures drift by tens of percent.

    python benchmarks/gateway_inproc.py                                  # this checkout, SQLite
    python benchmarks/gateway_inproc.py --callgrind --db sqlite postgres \\
        --code before=/tmp/old-checkout --code after=.                    # instructions per call, each checkout

The app's lifespan runs as `rollway serve`'s does (its store, pool, health loop); the measured window excludes
group creation. Callgrind runs the interpreter ~50x slower: `--pairs 50` (the default with it) takes ~2 min per
checkout and database. Needs valgrind (`apt-get install -y valgrind`) for `--callgrind`, PostgreSQL at 127.0.0.1
(trust auth) for `postgres`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# benchmarks/ last on the path: its gateway.py must not stand for the gateway package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]


def _bench_module() -> Any:
    """benchmarks/gateway.py (its name is the gateway package's: loaded under another)."""
    if "gateway_bench" in sys.modules:
        return sys.modules["gateway_bench"]
    spec = importlib.util.spec_from_file_location("gateway_bench", HERE / "gateway.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gateway_bench"] = module
    spec.loader.exec_module(module)
    return module


async def _call(app: Any, path: str, body: bytes, key: str) -> tuple[int, bytes]:
    headers = [(b"content-type", b"application/json"), (b"host", b"bench"), (b"authorization", f"Bearer {key}".encode()),
               (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    sent = False
    gone = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    gone.set()
    return status, b"".join(chunks)


async def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One checkout (this process runs from it), one database: the measured rounds."""
    from gateway.app import create_app
    from gateway.settings import Settings
    from gateway.store.db import upgrade

    wl = _bench_module().build_workload(Path(args.tokenizer))
    dbname = None
    if args.db == "sqlite":
        db = f"sqlite:///{args.workdir}/inproc-{secrets.token_hex(3)}.db"
    else:
        import asyncpg

        dbname = f"rollway_inproc_{os.getpid()}_{secrets.token_hex(3)}"
        conn = await asyncpg.connect(host=args.pg_host, port=args.pg_port, user="postgres", database="postgres")
        await conn.execute(f'CREATE DATABASE "{dbname}"')
        await conn.close()
        db = f"postgresql://postgres@{args.pg_host}:{args.pg_port}/{dbname}"
    upgrade(db)
    admin = secrets.token_urlsafe(16)
    app = create_app(Settings(backends=[args.backend], tokenizer=args.tokenizer, db=db, port=1,
                              data_dir=Path(args.workdir) / f"data-{secrets.token_hex(3)}"), admin_key=admin)
    cpu: list[float] = []
    instructions_calls = 0
    try:
        async with app.router.lifespan_context(app):
            async def sessions(n: int) -> list[str]:
                keys: list[str] = []
                for i in range(0, n, 8):
                    body = json.dumps({"task": {"i": i}, "n_samples": 8}).encode()
                    status, raw = await _call(app, "/v1/groups", body, admin)
                    assert status == 201, (status, raw[:300])
                    keys += [s["api_key"] for s in json.loads(raw)["sessions"]]
                return keys

            async def worker(keys: list[str], w: int, done: list[int]) -> None:
                for i, key in enumerate(keys):
                    n = f"{w}-{i}-{secrets.token_hex(3)}"  # a fresh first message per session, as in gateway.py
                    for body in (wl.chat1, wl.chat2):
                        status, raw = await _call(app, "/v1/chat/completions", body.replace("__N__", n).encode(), key)
                        assert status == 200, (status, raw[:300])
                        done[0] += 1

            rounds = 1 if args.callgrind else args.rounds
            for r in range(rounds + 1):  # round 0 warms up
                keys = await sessions(args.pairs if r else max(args.pairs // 4, args.conc))
                done = [0]
                measured = args.callgrind and r == rounds
                if measured:
                    _callgrind("on")
                t0 = time.process_time()
                await asyncio.gather(*(worker(keys[w::args.conc], w, done) for w in range(args.conc)))
                t1 = time.process_time()
                if measured:
                    _callgrind("off")
                    instructions_calls = done[0]
                if r:
                    cpu.append((t1 - t0) * 1000 / done[0])
    finally:
        if dbname is not None:
            import asyncpg

            conn = await asyncpg.connect(host=args.pg_host, port=args.pg_port, user="postgres", database="postgres")
            await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            await conn.close()
    return {"cpu_ms": cpu, "calls": instructions_calls}


def _callgrind(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def _run_child(name: str, code: Path, db: str, args: argparse.Namespace, backend: str, tokenizer: Path,
               workdir: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "gateway_inproc.py"), "--child", "--db", db, "--pairs", str(args.pairs),
           "--conc", str(args.conc), "--rounds", str(args.rounds), "--backend", backend, "--tokenizer",
           str(tokenizer), "--workdir", str(workdir), "--pg-host", args.pg_host, "--pg-port", str(args.pg_port)]
    out_file = workdir / f"callgrind-{name}-{db}.out"
    if args.callgrind:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
               *cmd, "--callgrind"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=3600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("INPROC ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} {db} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = {"code": name, "db": db, **json.loads(lines[-1][len("INPROC "):])}
    row["cpu_ms_min"] = min(row["cpu_ms"])
    if args.callgrind:
        totals = [ln for ln in out_file.read_text(errors="replace").splitlines() if ln.startswith(("totals:", "summary:"))]
        row["instructions_per_call"] = max(int(t.split()[1]) for t in totals) / row["calls"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", nargs="+", default=["sqlite"], choices=["sqlite", "postgres"])
    parser.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                        help="run the gateway of this checkout (repeatable: each in turn)")
    parser.add_argument("--callgrind", action="store_true", help="instructions per call under valgrind's callgrind")
    parser.add_argument("--pairs", type=int, default=0, help="sessions (two calls each) per measured round")
    parser.add_argument("--conc", type=int, default=32, help="concurrent workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="passes over the checkouts, alternating")
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.db = args.db[0]
        try:
            import uvloop  # the loop rollway serve runs on

            uvloop.install()
        except ImportError:
            pass
        print("INPROC " + json.dumps(asyncio.run(_child(args))), flush=True)
        return
    args.pairs = args.pairs or (50 if args.callgrind else 600)
    if args.callgrind:
        args.conc = min(args.conc, 8)
    variants = [(n, Path(d).resolve()) for n, d in (c.split("=", 1) for c in args.code)] or [("this", ROOT)]
    sys.path.insert(0, str(ROOT))
    from bench_procs import Procs

    from engine.tiny_model import create_tiny_model
    from rollway.embedded import free_port

    load = [os.getloadavg()[0]]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rollway-inproc-") as tmp:
        workdir = Path(tmp)
        procs = Procs(workdir)
        try:
            tokenizer = create_tiny_model(workdir / "tiny", seed=0)
            port = free_port()
            procs.start("backend", [sys.executable, "-m", "tests.fakes.fast_backend", "--port", str(port)])
            backend = f"http://127.0.0.1:{port}"
            _bench_module().wait_up(f"{backend}/health", procs.procs["backend"], procs, "backend")
            for _ in range(args.repeat):
                for db in args.db:
                    for name, code in variants:
                        row = _run_child(name, code, db, args, backend, tokenizer, workdir)
                        rows.append(row)
                        extra = (f", {row['instructions_per_call'] / 1e6:.3f} M instructions/call"
                                 if args.callgrind else "")
                        print(f"  {name} {db}: {row['cpu_ms_min']:.3f} ms CPU/call{extra}", file=sys.stderr, flush=True)
        finally:
            procs.stop_all()
    load.append(os.getloadavg()[0])
    print(f"\n{'code':<12}{'db':<10}{'CPU ms/call (min)':>20}{'M instr/call':>14}   (load average {load[0]:.2f} -> "
          f"{load[1]:.2f}; CPU under valgrind is its own, not the gateway's)")
    for r in rows:
        instr = f"{r['instructions_per_call'] / 1e6:.3f}" if "instructions_per_call" in r else "-"
        print(f"{r['code']:<12}{r['db']:<10}{r['cpu_ms_min']:>20.3f}{instr:>14}")
    print(json.dumps({"benchmark": "gateway_inproc", "callgrind": args.callgrind, "pairs": args.pairs,
                      "conc": args.conc, "load_average": load, "results": rows}))


if __name__ == "__main__":
    main()
