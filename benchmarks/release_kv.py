"""What a colocated trainer's `--release-kv-cache` costs the server (docs/scaling.md "One device").

    python benchmarks/release_kv.py                    # ~100M Qwen2, 4 rows of 256 new tokens
    python benchmarks/release_kv.py --size tiny

A `rollway engine` generates `--rows` requests of `--tokens` new tokens each. Undisturbed, then again with, halfway
through, what the gateway does for a trainer's step: `/pause_generation` (retract), `/release_memory_occupation`
{kv_cache}, a `--hold` second stand-in for the step, `/resume_memory_occupation`, `/continue_generation`. Printed:
the KV cache freed (the engine's `released_kv_bytes`), each call's latency, and the generations' extra time beyond
the hold (re-prefilling the retracted rows' caches). Generation stalls for the whole hold: that is the trade-off.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"rollway_engine_{name}_total "):
            return float(line.split()[1])
    return 0.0


def run(url: str, rows: int, tokens: int, disturb: float | None) -> dict[str, float]:
    done: list[float] = []
    t0 = time.perf_counter()

    def one(i: int) -> None:
        body = {"input_ids": [5 + i, 6, 7, 8] * 16, "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                                           "ignore_eos": True}}
        r = httpx.post(url + "/generate", json=body, timeout=600)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == tokens, r.text[:300]
        done.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(rows)]
    for t in threads:
        t.start()
    out: dict[str, float] = {}
    if disturb is not None:
        time.sleep(disturb)
        before = metric(url, "released_kv_bytes")
        c0 = time.perf_counter()
        httpx.post(url + "/pause_generation", json={"mode": "retract"}, timeout=60).raise_for_status()
        httpx.post(url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=60).raise_for_status()
        c1 = time.perf_counter()
        out["freed_bytes"] = metric(url, "released_kv_bytes") - before
        time.sleep(out.setdefault("hold_s", HOLD))
        c2 = time.perf_counter()
        httpx.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=60).raise_for_status()
        httpx.post(url + "/continue_generation", json={}, timeout=60).raise_for_status()
        c3 = time.perf_counter()
        out.update(release_s=c1 - c0, resume_s=c3 - c2)
    for t in threads:
        t.join()
    out["seconds"] = max(done)
    return out


HOLD = 1.0


def main(argv: list[str] | None = None) -> None:
    global HOLD
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", choices=["tiny", "100m"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hold", type=float, default=1.0, help="seconds released (the trainer's step)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    HOLD = args.hold
    from benchmarks.trainer import make_model
    from engine.tiny_model import create_tiny_model
    from rollway import paths
    from rollway.embedded import free_port, wait_healthy

    work = Path(tempfile.mkdtemp(prefix="rollway-release-kv-"))
    proc = None
    try:
        tok = create_tiny_model(work / "tok", seed=0)
        source = work / "model"
        make_model(args.size, source)
        for name in paths.TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copyfile(tok / name, source / name)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "engine", "--model", str(source), "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(url, proc, timeout=600)
        run(url, args.rows, 8, None)  # warm-up
        plain = [run(url, args.rows, args.tokens, None)["seconds"] for _ in range(args.reps)]
        base = statistics.median(plain)
        released = [run(url, args.rows, args.tokens, base / 2) for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in released) for k in released[0]}
        extra = med["seconds"] - base - med["hold_s"]
        print(f"\n{args.size}, {args.rows} rows x {args.tokens} new tokens on one CPU engine, median of {args.reps}")
        print(f"  undisturbed: {base:.2f} s; released halfway for {med['hold_s']:.1f} s: {med['seconds']:.2f} s")
        print(f"  KV cache freed: {med['freed_bytes'] / 2**20:.1f} MiB; pause + release {med['release_s'] * 1e3:.0f} ms, "
              f"resume + continue {med['resume_s'] * 1e3:.0f} ms")
        print(f"  generation stalled for the hold; cost beyond it (calls + re-prefill of the retracted rows): "
              f"{extra:.2f} s")
        print(json.dumps({"benchmark": "release_kv", "size": args.size, "rows": args.rows, "tokens": args.tokens,
                          "undisturbed_s": round(base, 3), "median": {k: round(v, 4) for k, v in med.items()},
                          "extra_s": round(extra, 3)}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
