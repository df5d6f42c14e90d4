"""CPU per group creation in the store: `Store.create_group` (a group and its n sessions, one transaction) on the
direct path (sqlite3 / asyncpg, `gateway/store/direct.py`) and on the SQLAlchemy Core path it replaced, on a fresh
migrated SQLite file and, when reachable, on PostgreSQL. Rounds alternate the two paths so drift hits both.

    python benchmarks/create_group.py                     # 4 rounds x 500 groups of 8, SQLite and PostgreSQL
    python benchmarks/create_group.py --groups 200 --rounds 2 --pg ''   # SQLite only, a shorter run

CPU is this process's (time.process_time): the gateway's own cost per creation, the database server's excluded.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.store.db import create_engine, upgrade
from gateway.store.store import Store


async def measure(url: str, groups: int, rounds: int, n_samples: int) -> dict[str, float]:
    store = Store(create_engine(url))
    await store.open()
    direct = store.direct
    per: dict[str, list[float]] = {"direct": [], "core": []}
    try:
        for _ in range(rounds):
            for path in ("direct", "core"):
                store.direct = direct if path == "direct" else None
                t0 = time.process_time()
                for i in range(groups):
                    await store.create_group({"question": f"{i}+{i}="}, n_samples, sampling={"temperature": 1.0},
                                             metadata=None)
                per[path].append((time.process_time() - t0) / groups * 1000)
    finally:
        store.direct = direct
        await store.close()
    return {path: round(statistics.median(v), 3) for path, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=500, help="groups created per path per round (default 500)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, each path once per round (default 4)")
    ap.add_argument("--n-samples", type=int, default=8, help="sessions per group (default 8)")
    ap.add_argument("--pg", default="127.0.0.1:5432",
                    help="host:port of a PostgreSQL server (trust auth) to create a fresh database on; '' to skip")
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        upgrade(url)
        results["sqlite"] = asyncio.run(measure(url, args.groups, args.rounds, args.n_samples))
    if args.pg:
        try:
            pg_url = _fresh_pg(args.pg)
        except Exception as e:  # recovery: an unreachable server is reported, SQLite's figures stand
            print(f"PostgreSQL skipped: {type(e).__name__}: {e}", file=sys.stderr)
        else:
            results["postgres"] = asyncio.run(measure(pg_url, args.groups, args.rounds, args.n_samples))
    print(f"{'database':10} {'direct ms CPU/group':>20} {'core ms CPU/group':>18} {'direct/core':>12}")
    for db, r in results.items():
        print(f"{db:10} {r['direct']:>20} {r['core']:>18} {r['direct'] / r['core']:>12.2f}")
    print(json.dumps({"benchmark": "create_group", "groups": args.groups, "rounds": args.rounds,
                      "n_samples": args.n_samples, "ms_cpu_per_group": results}))


def _fresh_pg(host: str) -> str:
    """A new, migrated database `bench_create_group` on the server at host:port (trust auth, user postgres),
    replacing the last run's."""
    import asyncpg

    hostname, _, port = host.partition(":")
    name = "bench_create_group"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(host=hostname, port=int(port or 5432), user="postgres", database="postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    url = f"postgresql://postgres@{hostname}:{port or 5432}/{name}"
    upgrade(url)
    return url


if __name__ == "__main__":
    main()
