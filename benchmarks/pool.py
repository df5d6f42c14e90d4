"""Backend pool: chat-completion throughput through one gateway with one vs two CPU engine backends.

    python benchmarks/pool.py                 # full run: 3 s warm-up + 20 s per configuration
    python benchmarks/pool.py --quick         # smoke run: 2 s warm-up + 8 s per configuration
    python benchmarks/pool.py --seconds 30 --concurrency 64

Setup: the tiny model (engine/tiny_model.py) in a temp dir; two `rollway engine` processes on it, each with
one torch thread (OMP_NUM_THREADS=1 / MKL_NUM_THREADS=1; torch reads them at import); for each
configuration a fresh `rollway serve` gateway (own SQLite database and data dir, ROLLWAY_ADMIN_KEY set)
with `--backend A` ("one") or `--backend A --backend B` ("two"). Every process runs in its own process
group and is removed at the end, even on error.

Load, from this process (asyncio + aiohttp, the cheaper client on a shared machine): C concurrent workers,
each taking a fresh session key (groups of 8 created with POST /v1/groups before the window, more on
demand) and making one non-streaming chat completion (user "12+34=", max_tokens 32), over and over for
--seconds. Counted: completions that finished inside the window; tokens = usage.completion_tokens;
latency = the client's time for the call. The split across backends comes from the gateway's stored turns
(`timings.backend`, read from its SQLite file for the turns finished inside the window; GET
/v1/sessions/{id} does not return timings), mapped to URLs with GET /v1/backends.

CPU over the window: utime + stime from /proc of each engine, the gateway and this client, and the
machine's busy CPU not accounted for by them (`other`: other work on a shared machine), in cores.
The two engines share the same cores as the gateway and the client: on a small machine "two" cannot be
2x "one" - the ratio shows how much a second engine process buys when the cores are already busy.
Prints a table, notes, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from bench_procs import ROOT, Procs

from rollway.embedded import free_port, wait_healthy

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
GROUP_SIZE = 8
MAX_TOKENS = 32
MESSAGES = [{"role": "user", "content": "12+34="}]


def proc_cpu(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine (all cores) since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) * TICK


# --- load ----------------------------------------------------------------------------------------------


@dataclass
class Sample:
    end: float
    latency: float
    tokens: int


@dataclass
class Load:
    url: str
    admin: str
    keys: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    groups_on_demand: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    async def create_groups(self, http: aiohttp.ClientSession, sessions: int) -> None:
        async def one() -> None:
            async with http.post(f"{self.url}/v1/groups", json={"task": {}, "n_samples": GROUP_SIZE},
                                 headers={"Authorization": f"Bearer {self.admin}"}) as r:
                if r.status != 201:
                    raise RuntimeError(f"POST /v1/groups: HTTP {r.status}: {(await r.text())[:300]}")
                for s in (await r.json())["sessions"]:
                    self.keys.put_nowait(s["api_key"])

        n = math.ceil(sessions / GROUP_SIZE)
        for i in range(0, n, 16):  # a few at a time: the gateway is on the same cores
            await asyncio.gather(*(one() for _ in range(min(16, n - i))))

    async def next_key(self, http: aiohttp.ClientSession) -> str:
        if self.keys.empty():
            self.groups_on_demand += 1
            await self.create_groups(http, GROUP_SIZE)
        return self.keys.get_nowait()

    async def run(self, http: aiohttp.ClientSession, concurrency: int, seconds: float) -> tuple[list[Sample], float]:
        """C workers until the deadline; returns the samples that finished inside the window and its start."""
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        samples: list[Sample] = []
        start = time.perf_counter()
        deadline = start + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                key = await self.next_key(http)
                t0 = time.perf_counter()
                try:
                    async with http.post(f"{self.url}/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {key}"}) as r:
                        data = await r.json(content_type=None)
                        ok = r.status == 200
                except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                    ok, data = False, {"error": repr(e)}
                t1 = time.perf_counter()
                if not ok:
                    self.errors += 1
                    if len(self.first_errors) < 3:
                        self.first_errors.append(json.dumps(data)[:300])
                    continue
                if t1 <= deadline:
                    samples.append(Sample(t1, t1 - t0, int(data["usage"]["completion_tokens"])))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def backend_split(db_file: Path, since: float, until: float) -> dict[str, int]:
    """Turns that finished inside [since, until] (wall clock) per backend id, from the gateway's store."""
    conn = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT json_extract(timings, '$.backend'), count(*) FROM turns "
            "WHERE json_extract(timings, '$.finished') BETWEEN ? AND ? GROUP BY 1", (since, until)).fetchall()
    finally:
        conn.close()
    return {str(b): int(n) for b, n in rows}


# --- one configuration ---------------------------------------------------------------------------------


def get_json(url: str, key: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


async def bench_config(name: str, backends: list[str], engine_pids: dict[str, int], procs: Procs,
                       model_dir: Path, workdir: Path, admin: str, args: argparse.Namespace) -> dict[str, Any]:
    data_dir = workdir / f"gw-{name}"
    data_dir.mkdir()
    db_file = data_dir / "db.sqlite"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rollway.cli", "--log-level", "WARNING", "serve", "--tokenizer", str(model_dir),
           "--db", f"sqlite:///{db_file}", "--port", str(port), "--data-dir", str(data_dir)]
    for b in backends:
        cmd += ["--backend", b]
    env = {**os.environ, "ROLLWAY_ADMIN_KEY": admin, "PYTHONPATH": str(ROOT)}
    gw = procs.start(f"gateway-{name}", cmd, env)
    try:
        wait_healthy(url, gw)
        for _ in range(100):  # the pool marks backends healthy after its first check
            listed = get_json(f"{url}/v1/backends", admin)["data"]
            if len(listed) == len(backends) and all(b["healthy"] for b in listed):
                break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"gateway ({name}): backends not healthy: {listed}")
        by_id = {b["id"]: b["url"] for b in listed}

        timeout = aiohttp.ClientTimeout(total=120)
        conn = aiohttp.TCPConnector(limit=args.concurrency + 16)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            load = Load(url, admin)
            await load.create_groups(http, 2 * args.concurrency)
            warm, _ = await load.run(http, args.concurrency, args.warmup)
            # Enough fresh sessions for the window, from the warm-up rate (x2, more on demand).
            rate = len(warm) / args.warmup if warm else 10.0
            await load.create_groups(http, max(0, int(rate * args.seconds * 2) + args.concurrency
                                               - load.keys.qsize()))
            load.groups_on_demand, load.errors, load.first_errors = 0, 0, []

            pids = {**{f"engine{i}": engine_pids[b] for i, b in enumerate(backends)}, "gateway": gw.pid}
            cpu0 = {k: proc_cpu(p) for k, p in pids.items()}
            self0, busy0 = time.process_time(), machine_busy()
            wall0 = time.time()
            samples, start = await load.run(http, args.concurrency, args.seconds)
            wall1 = wall0 + args.seconds
            cpu = {k: proc_cpu(p) - cpu0[k] for k, p in pids.items()}
            cpu["client"] = time.process_time() - self0
            busy = machine_busy() - busy0
        # Stragglers (started before, finished after the deadline) are drained by gather above; they
        # are not counted. The elapsed time includes them, so CPU is read over the full elapsed window.
        elapsed = time.perf_counter() - start
        cpu["other"] = max(0.0, busy - sum(cpu.values()))
        split_ids = backend_split(db_file, wall0, wall1)
    finally:
        procs.stop(f"gateway-{name}")

    lat = [s.latency for s in samples]
    tokens = sum(s.tokens for s in samples)
    split = {by_id.get(b, b): n for b, n in split_ids.items()}
    return {
        "config": name, "backends": len(backends), "completions": len(samples), "seconds": args.seconds,
        "completions_per_s": len(samples) / args.seconds, "tokens_per_s": tokens / args.seconds,
        "tokens_per_completion": tokens / len(samples) if samples else 0.0,
        "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
        "errors": load.errors, "first_errors": load.first_errors, "groups_on_demand": load.groups_on_demand,
        "split": {b: split.get(b, 0) for b in backends},
        "cpu_cores": {k: v / elapsed for k, v in cpu.items()},
    }


# --- main ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 s windows, 2 s warm-up")
    parser.add_argument("--seconds", type=float, default=None, help="timed window per configuration (20)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up per configuration (3)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--keep-logs", default="", metavar="DIR", help="copy the process logs here")
    args = parser.parse_args()
    args.seconds = args.seconds or (8.0 if args.quick else 20.0)
    args.warmup = args.warmup or (2.0 if args.quick else 3.0)
    sys.path.insert(0, str(ROOT))
    from engine.tiny_model import create_tiny_model

    admin = "rw-admin-" + secrets.token_urlsafe(24)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rollway-pool-") as tmp:
        workdir = Path(tmp)
        logdir = workdir / "logs"
        logdir.mkdir()
        procs = Procs(logdir)
        try:
            model_dir = create_tiny_model(workdir / "tiny-model", seed=0)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TORCH_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT)}
            engines: dict[str, int] = {}
            started: list[tuple[str, subprocess.Popen[bytes]]] = []
            for i in range(2):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cmd = [sys.executable, "-m", "rollway.cli", "--log-level", "WARNING", "engine", "--model",
                       str(model_dir), "--port", str(port)]
                started.append((url, procs.start(f"engine{i}", cmd, env)))
            for url, proc in started:
                wait_healthy(url, proc)
                engines[url] = proc.pid
            urls = list(engines)
            for name, backends in (("one", urls[:1]), ("two", urls)):
                print(f"[{name}] {len(backends)} backend(s), C={args.concurrency}, {args.warmup:g} s warm-up + "
                      f"{args.seconds:g} s ...", file=sys.stderr, flush=True)
                results.append(asyncio.run(bench_config(name, backends, engines, procs, model_dir, workdir,
                                                        admin, args)))
        except BaseException:
            for name in list(procs.procs):
                tail = procs.log_tail(name)
                if tail:
                    print(f"--- {name}.log (tail) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            procs.stop_all()
            if args.keep_logs:
                import shutil

                shutil.copytree(logdir, args.keep_logs, dirs_exist_ok=True)

    print(f"{'config':<7} {'compl':>6} {'compl/s':>8} {'tok/s':>8} {'tok/compl':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'errors':>6}  {'split (engine0/engine1)':<24} cpu cores (eng0 eng1 gw client other)")
    for r in results:
        split = "/".join(str(n) for n in r["split"].values())
        c = r["cpu_cores"]
        cpu = " ".join(f"{c.get(k, 0.0):.2f}" for k in ("engine0", "engine1", "gateway", "client", "other"))
        print(f"{r['config']:<7} {r['completions']:>6} {r['completions_per_s']:>8.1f} {r['tokens_per_s']:>8.1f} "
              f"{r['tokens_per_completion']:>9.1f} {r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} {r['errors']:>6}  "
              f"{split:<24} {cpu}")
    one, two = results
    ratio_c = two["completions_per_s"] / one["completions_per_s"] if one["completions_per_s"] else float("nan")
    ratio_t = two["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else float("nan")
    print(f"two/one: completions/s {ratio_c:.2f}x, tokens/s {ratio_t:.2f}x")
    ncpu = os.cpu_count() or 0
    print(f"notes: {ncpu} CPU core(s) shared by both engines (1 torch thread each), the gateway, this client and "
          "whatever else runs on the machine ('other'); a second engine only helps while a core is idle, so "
          "two/one is not expected to reach 2x here. Each engine batches continuously, so one engine at C=32 "
          "already amortises its per-step cost over many requests.")
    eng1, eng2 = (sum(v for k, v in r["cpu_cores"].items() if k.startswith("engine")) for r in results)
    print(f"  engine CPU: {eng1:.2f} cores with one engine, {eng2:.2f} with two; other work on the machine: "
          f"{one['cpu_cores']['other']:.2f} / {two['cpu_cores']['other']:.2f} cores. When other work is large, "
          "part of any gain is the engines' larger share of a contended machine, not spare capacity.")
    for r in results:
        if r["errors"]:
            print(f"  {r['config']}: {r['errors']} failed requests, e.g. {r['first_errors'][0]}")
        if r["groups_on_demand"]:
            print(f"  {r['config']}: {r['groups_on_demand']} groups created inside the window")
    summary: dict[str, Any] = {"benchmark": "pool", "concurrency": args.concurrency, "seconds": args.seconds,
                               "max_tokens": MAX_TOKENS, "cpus": ncpu}
    for r in results:
        summary[r["config"]] = {
            "completions_per_s": round(r["completions_per_s"], 2), "tokens_per_s": round(r["tokens_per_s"], 1),
            "p50_ms": round(r["p50_ms"], 1), "p99_ms": round(r["p99_ms"], 1), "errors": r["errors"],
            "split": list(r["split"].values()),
            "cpu_cores": {k: round(v, 2) for k, v in r["cpu_cores"].items()},
        }
    summary["ratio_completions"] = round(ratio_c, 3)
    summary["ratio_tokens"] = round(ratio_t, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
