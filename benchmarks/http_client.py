"""Which HTTP client the gateway uses for the non-streaming /generate: CPU per call of each candidate, against
the fast fake backend (tests/fakes/fast_backend.py, its own process) with the gateway's payload shape (a
~400-id prompt, logprobs on, a 30-token answer parsed as JSON), C concurrent callers on one uvloop.

    python benchmarks/http_client.py                 # C = 1 and 32, 4000 calls each, 3 rounds
    python benchmarks/http_client.py --calls 1000    # quicker

Candidates: `gateway.http1.Http1Client` (what `SGLangClient.generate` uses), aiohttp (one shared session, as
for streams and control calls), and httpx (when installed). CPU = this process's user + system time over the
timed calls / calls, the median of the rounds (rounds interleave the candidates).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.http1 import Http1Client  # noqa: E402
from rollway.embedded import free_port  # noqa: E402

PAYLOAD = {"input_ids": list(range(1000, 1400)), "return_logprob": True, "rid": "bench", "stream": False,
           "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64, "stop_token_ids": [2]}}


async def timed(call: Callable[[], Awaitable[Any]], calls: int, conns: int) -> float:
    """ms of CPU per call, `conns` callers at once."""

    async def worker(n: int) -> None:
        for _ in range(n):
            await call()

    await asyncio.gather(*(worker(10) for _ in range(conns)))  # connections open, caches warm
    t0 = time.process_time()
    await asyncio.gather(*(worker(calls // conns) for _ in range(conns)))
    return (time.process_time() - t0) * 1000 / (calls // conns * conns)


async def run(url: str, args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    import aiohttp

    body = orjson.dumps(PAYLOAD)
    lean = Http1Client(url)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    headers = {"Content-Type": "application/json"}

    async def with_lean() -> Any:
        _, data = await lean.post("/generate", body)
        return orjson.loads(data)

    async def with_aiohttp() -> Any:
        async with session.post(url + "/generate", data=body, headers=headers) as r:
            return orjson.loads(await r.read())

    clients: dict[str, Callable[[], Awaitable[Any]]] = {"http1 (gateway)": with_lean, "aiohttp": with_aiohttp}
    closers: list[Callable[[], Awaitable[Any]]] = [session.close]
    try:
        import httpx

        hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

        async def with_httpx() -> Any:
            r = await hx.post(url + "/generate", content=body, headers=headers)
            return orjson.loads(r.content)

        clients["httpx"] = with_httpx
        closers.append(hx.aclose)
    except ImportError:
        pass
    out: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.levels} for name in clients}
    try:
        for _ in range(args.rounds):
            for conns in args.levels:
                for name, call in clients.items():
                    out[name][conns].append(await timed(call, args.calls, conns))
    finally:
        lean.close()
        for close in closers:
            await close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    import uvloop

    port = free_port()
    backend = subprocess.Popen([sys.executable, "-m", "tests.fakes.fast_backend", "--port", str(port)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        results = uvloop.run(run(url, args))
    finally:
        backend.terminate()
        backend.wait(10)
    print(f"\nms of client CPU per /generate call (median of {args.rounds} rounds, {args.calls} calls each)")
    print(f"{'client':<18}" + "".join(f"{'C=' + str(c):>10}" for c in args.levels))
    medians = {name: {c: statistics.median(v) for c, v in by.items()} for name, by in results.items()}
    for name, by in medians.items():
        print(f"{name:<18}" + "".join(f"{by[c]:>10.3f}" for c in args.levels))
    print(json.dumps({"benchmark": "http_client", "calls": args.calls, "rounds": args.rounds,
                      "cpu_ms_per_call": {name: {str(c): round(v, 4) for c, v in by.items()}
                                          for name, by in medians.items()}}))


if __name__ == "__main__":
    main()
