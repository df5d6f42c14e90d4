"""CPU per statement of the gateway's PostgreSQL connections (gateway/store/pg_pool.py) against asyncpg's Pool as the
gateway configured it before (no reset on release, no idle expiry) and against one connection held throughout (the
floor), all in this process on uvloop, on the same one-row SELECT; at concurrency 1 and C.

    python benchmarks/pg_pool.py                     # 3000 statements per figure, C = 16, 3 interleaved rounds
    python benchmarks/pg_pool.py --statements 500 --rounds 1   # smoke run

CPU = this process's user + system time over the statements / statements (the server's own CPU is not counted: it
is the same work for all three). The three run interleaved, round after round; figures are medians of the rounds.
Needs PostgreSQL at --pg-host:--pg-port (trust auth, database postgres).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SQL = "SELECT $1::int + 1"


async def _measure(fetchval: Any, statements: int, conc: int) -> float:
    for i in range(100):  # statements prepared on every connection, connections opened
        await asyncio.gather(*(fetchval(SQL, i) for _ in range(conc)))
    per_worker = statements // conc
    c0 = time.process_time()

    async def worker() -> None:
        for i in range(per_worker):
            await fetchval(SQL, i)

    await asyncio.gather(*(worker() for _ in range(conc)))
    return (time.process_time() - c0) / (per_worker * conc) * 1e6


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg

    from gateway.store.pg_pool import PgConnections

    connect = {"host": args.pg_host, "port": args.pg_port, "user": "postgres", "database": "postgres"}

    async def keep_as_is(_: Any) -> None:
        return None

    pool = await asyncpg.create_pool(min_size=1, max_size=args.conc, reset=keep_as_is,
                                     max_inactive_connection_lifetime=0, **connect)
    conns = await PgConnections.open(connect, args.conc)
    held = await asyncpg.connect(**connect)
    kinds = {"asyncpg Pool": pool.fetchval, "PgConnections": conns.fetchval, "held connection": held.fetchval}
    rows: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for conc in (1, args.conc):
                for name, fetchval in kinds.items():
                    if name == "held connection" and conc > 1:
                        continue  # one connection runs one statement at a time
                    us = await _measure(fetchval, args.statements, conc)
                    rows.setdefault((name, conc), []).append(us)
                    print(f"  round {r + 1}: {name} C={conc}: {us:.1f} us CPU/statement", file=sys.stderr, flush=True)
    finally:
        await pool.close()
        await conns.close()
        await held.close()
    return {f"{name}@{conc}": statistics.median(v) for (name, conc), v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--statements", type=int, default=3000)
    parser.add_argument("--conc", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    args = parser.parse_args()
    import uvloop

    load = [os.getloadavg()[0]]
    medians = uvloop.run(_main(args))
    load.append(os.getloadavg()[0])
    print(f"\n{'connections':<18}{'C':>4}{'us CPU/statement':>18}{'x held':>9}   (medians of {args.rounds} rounds; "
          f"load average {load[0]:.2f} -> {load[1]:.2f})")
    floor = medians["held connection@1"]
    for key, us in medians.items():
        name, conc = key.split("@")
        print(f"{name:<18}{conc:>4}{us:>18.1f}{us / floor:>9.2f}")
    saved = {c: medians[f"asyncpg Pool@{c}"] - medians[f"PgConnections@{c}"] for c in (1, args.conc)}
    print(json.dumps({"benchmark": "pg_pool", "statements": args.statements, "conc": args.conc, "rounds": args.rounds,
                      "load_average": load, "us_cpu_per_statement": medians,
                      "saved_us_per_statement": saved}))


if __name__ == "__main__":
    main()
