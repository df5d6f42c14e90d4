"""Engine throughput: generated tokens/s at 1, 8 and 32 concurrent /generate requests over HTTP.

    python benchmarks/engine.py [--sizes tiny 100m] [--threads 2] [--tokens 128] [--grammar none regex json]

Each size gets a fresh model (random weights), served by `python -m engine.server` in a subprocess with
`--threads` torch threads. At concurrency c, c clients each send one request for `--tokens` tokens
(sampling at T = 1, ignore_eos) at the same moment; tokens/s = generated tokens / wall time. The target
is speedup(32) = tokens/s at 32 / tokens/s at 1 >= 8. Prints a table, then one JSON line.

`--grammar` measures constrained decoding too (engine/grammar.py): every request carries a grammar that never
ends by itself within `--tokens` 128 (`regex` [a-z ]*, `json` an array of at least 64 short strings), so a
reply still runs its `--tokens` unless the model samples eos (regex); one row per grammar and level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 8, 32)
GRAMMARS = {
    "none": {},
    "regex": {"regex": "[a-z ]*"},
    # At least 64 items: the array cannot close before --tokens 128 (each item is 2 tokens or more).
    "json": {"json_schema": json.dumps({"type": "array", "minItems": 64,
                                        "items": {"type": "string", "enum": ["north", "south", "east", "west"]}})},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model_dir: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    code = f"import torch; torch.set_num_threads({threads}); from engine.server import main; main()"
    cmd = [
        sys.executable,
        "-c",
        code,
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--max-batch-size",
        "32",
    ]
    return subprocess.Popen(cmd, env=env, cwd=ROOT)


async def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with httpx.AsyncClient() as c:
        for _ in range(600):
            assert proc.poll() is None, "engine exited"
            try:
                if (await c.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("engine did not become healthy")


async def run_level(url: str, concurrency: int, tokens: int, grammar: str = "none") -> dict[str, Any]:
    params = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True, **GRAMMARS[grammar]}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as c:

        async def one(i: int) -> int:
            prompt = [10 + (i * 7 + j) % 500 for j in range(16 + i % 8)]  # different prompts and lengths
            r = await c.post("/generate", json={"input_ids": prompt, "sampling_params": params})
            r.raise_for_status()
            return len(r.json()["output_ids"])

        await one(0)  # warm-up
        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "tokens": produced, "seconds": wall, "tokens_per_s": produced / wall,
            "grammar": grammar}


async def bench_size(
    size: str, threads: int, tokens: int, workdir: Path, grammars: list[str]
) -> list[dict[str, Any]]:
    from engine.tiny_model import create_tiny_model

    model_dir = create_tiny_model(workdir / size, seed=0, size=size)
    port = free_port()
    proc = start_server(model_dir, port, threads)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, proc)
        return [await run_level(url, c, tokens, g) for g in grammars for c in CONCURRENCY]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "100m"], choices=["tiny", "100m"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--grammar", nargs="+", default=["none"], choices=sorted(GRAMMARS))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # `engine` must be the package, not this file
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results[size] = asyncio.run(bench_size(size, args.threads, args.tokens, Path(tmp), args.grammar))
    print(f"{'model':<6} {'grammar':>7} {'concurrency':>11} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'speedup':>8}")
    summary: dict[str, dict[str, float]] = {}
    for size, rows in results.items():
        base = rows[0]["tokens_per_s"]
        for row in rows:
            speedup = row["tokens_per_s"] / base
            print(
                f"{size:<6} {row['grammar']:>7} {row['concurrency']:>11} {row['tokens']:>7} {row['seconds']:>8.2f} "
                f"{row['tokens_per_s']:>9.1f} {speedup:>7.1f}x"
            )
            tag = "" if row["grammar"] == "none" else f"_{row['grammar']}"
            summary.setdefault(size, {})[f"tok_s{tag}_c{row['concurrency']}"] = round(row["tokens_per_s"], 1)
        summary[size]["speedup_c32"] = round(rows[len(CONCURRENCY) - 1]["tokens_per_s"] / base, 2)
    print(json.dumps({"benchmark": "engine", "threads": args.threads, "tokens": args.tokens, **summary}))


if __name__ == "__main__":
    main()
