"""The viewer's speed on a big store: the groups page over 100k sessions (SQLite and PostgreSQL) at p50/p95
over filter combinations, and a 200-turn session of 4k tokens a turn opened in Chromium at the token view of
its last turn.

    python benchmarks/viewer.py                          # both stores, 100k sessions, the browser figure
    python benchmarks/viewer.py --stores sqlite --sessions 20000 --repeat 10     # a quick look

Stores are built once by bulk inserts and kept (`--cache`, default runs/bench-viewer: a SQLite file per
size; PostgreSQL a database `rollway_bench_viewer_<sessions>` at --pg), then reused: delete them to rebuild.
Groups of 8 sessions; 10% eval; states 70% trained, 10% complete, 10% open, 10% dropped (filtered, stale,
too_few_sessions); rewards in {0, 0.25, ..., 1}, a quarter of the groups with one reward for all (zero
variance); the task is "What is A+B?". The big session: 200 turns, each a 3,000-token prompt delta and a
1,000-token reply (800k tokens in its first chain), a chain broken at turn 120 (an edited message: the new
chain's prompt repeats the first with one token changed), weights published in the middle of the last reply.
Its messages are short texts: the tokens, not the JSON, are what is big here.

Served by `rollway view --db URL` (the viewer alone: no engine); each request is timed from the client
(httpx, keep-alive), full HTML of /ui/groups including the match count. The browser figure is Playwright's
`goto(.../ui/sessions/<id>#tokens=last)` until the token view says it rendered: warm (the session's chains
already built) and cold, interleaved: before a cold load the session's `turn_count` is moved on by one, as a
new turn would (the viewer keys its chains by it, so the server builds them again), and put back at the end.
Prints a table, then one JSON line. Targets (issue 16): groups p95 <= 200 ms, the session's token view <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollway.embedded import free_port  # noqa: E402
from rollway_common.wire import pack  # noqa: E402

ADMIN = "rw-admin-bench-viewer"
GROUP_SIZE = 8
BIG_TURNS, PROMPT_DELTA, REPLY = 200, 3000, 1000
BREAK_AT = 120
MARK = "bench_viewer_built"


def _rng_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def groups_and_sessions(n_sessions: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(0)
    groups: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []
    t0 = time.time() - n_sessions  # one session a second, oldest first
    for g in range(n_sessions // GROUP_SIZE):
        created = t0 + g * GROUP_SIZE
        is_eval = g % 10 == 9
        roll = rng.random()
        state, reason = (("trained", None) if roll < 0.7 else ("complete", None) if roll < 0.8 else
                         ("open", None) if roll < 0.9 else ("dropped", rng.choice(["filtered", "stale", "too_few_sessions"])))
        if is_eval:
            state, reason = "complete", None
        gid = f"grp_{g:08d}{rng.getrandbits(64):016x}"
        a, b = rng.randrange(100), rng.randrange(100)
        groups.append({"id": gid, "task": {"prompt": f"What is {a}+{b}?", "answer": a + b}, "n_samples": GROUP_SIZE,
                       "state": state, "drop_reason": reason, "is_eval": is_eval, "sampling": {"temperature": 1.0},
                       "metadata": {"eval_version": g // 640} if is_eval else None, "created_at": created,
                       "completed_at": created + 30 if state != "open" else None, "batch_id": None,
                       "trained_version": g // 64 if state == "trained" else None})
        same = rng.random() < 0.25
        base = rng.randrange(5) / 4
        for r in range(GROUP_SIZE):
            reward = None if state == "open" else base if same else rng.randrange(5) / 4
            sessions.append({"id": f"sess_{g:08d}{r:02d}{rng.getrandbits(48):012x}", "group_id": gid, "replica": r,
                             "key_hash": f"{rng.getrandbits(256):064x}",
                             "state": "active" if state == "open" else "finished", "end_reason": None,
                             "reward": reward, "turn_count": 0, "created_at": created + r,
                             "last_active_at": created + r, "ended_at": None if state == "open" else created + 20 + r})
    return groups, sessions


def big_session_turns(session_id: str) -> list[dict[str, Any]]:
    rng = random.Random(1)
    turns: list[dict[str, Any]] = []
    chain: list[int] = []
    parent: str | None = None
    now = time.time()
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for seq in range(1, BIG_TURNS + 1):
        delta = _rng_ids(rng, PROMPT_DELTA)
        reply = _rng_ids(rng, REPLY)
        history.append({"role": "user" if seq == 1 else "tool", "content": f"observation {seq}",
                        **({"tool_call_id": f"call_{seq - 1}"} if seq > 1 else {})})
        continuity, reason = ("extends", None) if parent else ("new-chain", "first_turn")
        if seq == BREAK_AT:  # an edited message: a new chain whose prompt is the old one with one token changed
            prompt = [*chain, *delta]
            prompt[1500] += 1
            delta, parent, continuity, reason = prompt, None, "new-chain", "edited_message"
        version = seq // 20
        versions = [version] * REPLY if seq < BIG_TURNS else [version] * (REPLY // 2) + [version + 1] * (REPLY // 2)
        tid = f"chatcmpl-bench{seq:05d}"
        turns.append({"id": tid, "session_id": session_id, "seq": seq, "parent_id": parent, "endpoint": "chat",
                      "request": {"messages": list(history), "tools": None, "asked": {}, "sampling": {"temperature": 1.0}},
                      "reply": {"role": "assistant", "content": None, "tool_calls": [
                          {"id": f"call_{seq}", "type": "function", "function": {"name": "run", "arguments": "{}"}}]},
                      "prompt_ids": pack(delta, "int32"), "prompt_len": len(chain) + len(delta) if parent else len(delta),
                      "completion_ids": pack(reply, "int32"),
                      "logprobs": pack([-rng.random() * 3 for _ in reply], "float32"),
                      "versions": pack(versions, "int32"), "temperature": 1.0, "finish_reason": "tool_calls",
                      "continuity": continuity, "chain_reason": reason, "client_disconnected": False, "reward": None,
                      "timings": {"started": now + seq, "finished": now + seq + 0.5}, "created_at": now + seq,
                      "constrained": False})
        chain = ([*chain, *delta] if parent else list(delta)) + reply
        history.append({"role": "assistant", "content": None, "tool_calls": turns[-1]["reply"]["tool_calls"]})
        parent = tid
    return turns


async def build(url: str, n_sessions: int) -> str:
    """Fill the store at `url` (already migrated) unless it was built before; returns the big session's id."""
    from sqlalchemy import select

    from gateway.store.db import create_engine
    from gateway.store.models import Group, Session, Setting, Turn

    engine = create_engine(url)
    G, S, T, K = (m.__table__ for m in (Group, Session, Turn, Setting))
    try:
        async with engine.connect() as conn:
            done = (await conn.execute(select(K.c.value).where(K.c.key == MARK))).scalar()  # type: ignore[attr-defined]
        if done:
            return str(done["big_session"])
        groups, sessions = groups_and_sessions(n_sessions)
        big = sessions[-1]["id"]
        sessions[-1]["turn_count"] = BIG_TURNS
        t = time.monotonic()
        async with engine.begin() as conn:
            for i in range(0, len(groups), 5000):
                await conn.execute(G.insert(), groups[i:i + 5000])  # type: ignore[attr-defined]
            for i in range(0, len(sessions), 5000):
                await conn.execute(S.insert(), sessions[i:i + 5000])  # type: ignore[attr-defined]
            turns = big_session_turns(big)
            for i in range(0, len(turns), 20):
                await conn.execute(T.insert(), turns[i:i + 20])  # type: ignore[attr-defined]
            await conn.execute(K.insert().values(key=MARK, value={"big_session": big}))  # type: ignore[attr-defined]
        if engine.dialect.name == "postgresql":  # what autovacuum would do soon after a run's first hour
            from sqlalchemy import text

            async with engine.connect() as conn:
                await conn.execute(text("ANALYZE"))
                await conn.commit()
        print(f"built {url.split('@')[-1]}: {len(groups)} groups, {len(sessions)} sessions, {BIG_TURNS} turns "
              f"in {time.monotonic() - t:.1f} s", flush=True)
        return big
    finally:
        await engine.dispose()


def store_url(kind: str, n: int, cache: Path, pg: str) -> str:
    from gateway.store.db import upgrade

    if kind == "sqlite":
        cache.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{cache / f'viewer-{n}.db'}"
    else:
        import asyncpg

        name = f"rollway_bench_viewer_{n}"

        async def ensure() -> None:
            conn = await asyncpg.connect(f"{pg}/postgres")
            try:
                if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                    await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()

        asyncio.run(ensure())
        url = f"{pg}/{name}"
    upgrade(url)
    return url


FILTERS = [
    ("first page", {}),
    ("state=trained", {"state": "trained"}),
    ("eval", {"kind": "eval"}),
    ("reason=filtered", {"reason": "filtered"}),
    ("version=50", {"version": "50"}),
    ("reward 0.4..0.6", {"reward_min": "0.4", "reward_max": "0.6"}),
    ("text common", {"q": "What is 4"}),
    ("text rare", {"q": "What is 97+98?"}),
    ("text none", {"q": "no such task"}),
    ("last page", {"last": "1"}),
    ("last page + text", {"last": "1", "q": "+1"}),
    ("trained+reward+text", {"state": "trained", "reward_min": "0.5", "q": "What is 4"}),
    ("page 2 (cursor)", {"after": None}),
]


def time_groups(base: str, repeat: int) -> list[dict[str, Any]]:
    out = []
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
        first = c.get("/ui/api/groups").json()
        for name, params in FILTERS:
            if "after" in params:
                params = {"after": first["next"]}
            url = "/ui/groups?" + urllib.parse.urlencode(params)
            r = c.get(url)
            assert r.status_code == 200, (url, r.status_code, r.text[:300])
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                r = c.get(url)
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200
            times.sort()
            out.append({"filter": name, "rows": r.text.count('class="group-row'), "p50_ms": round(statistics.median(times), 1),
                        "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))], 1)})
    return out


def bump_turn_count(url: str, session_id: str, by: int) -> None:
    """Move the session's turn count as a new turn does (the viewer's chain cache is keyed by it)."""
    from concurrent.futures import ThreadPoolExecutor
    from typing import cast

    from sqlalchemy import Table, update

    from gateway.store.db import create_engine
    from gateway.store.models import Session

    async def go() -> None:
        engine = create_engine(url)
        S = cast(Table, Session.__table__)
        try:
            async with engine.begin() as conn:
                await conn.execute(update(S).where(S.c.id == session_id).values(turn_count=S.c.turn_count + by))
        finally:
            await engine.dispose()

    with ThreadPoolExecutor(1) as ex:  # Playwright's sync API holds this thread's event loop
        ex.submit(asyncio.run, go()).result()


def time_session(base: str, url: str, session_id: str, runs: int, cold_runs: int) -> tuple[list[float], list[float]]:
    """(cold, warm) seconds: the first load and `cold_runs` more after a moved turn count, `runs` - 1 warm ones,
    interleaved."""
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("ROLLWAY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    cold: list[float] = []
    warm: list[float] = []
    bumped = 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{base}/ui/login?next=/ui/search")  # not the overview: its polling would compete for the CPU
        page.fill("#key", ADMIN)
        with page.expect_navigation():
            page.click("button[type=submit]")
        warm_runs = max(0, runs - 1)
        plan = [True] + [False, True] * min(cold_runs, warm_runs) + [True] * max(0, cold_runs - warm_runs)
        plan += [False] * (warm_runs - plan.count(False))
        try:
            for i, is_cold in enumerate(plan):
                if is_cold and i:  # the first load is cold by itself (a fresh server)
                    bump_turn_count(url, session_id, 1)
                    bumped += 1
                page.goto("about:blank")
                t = time.perf_counter()
                page.goto(f"{base}/ui/sessions/{session_id}#tokens=last")
                page.wait_for_selector("#tokens[data-ready='1'] .vmark", timeout=60_000)
                (cold if is_cold else warm).append(round(time.perf_counter() - t, 3))
        finally:
            if bumped:
                bump_turn_count(url, session_id, -bumped)
        browser.close()
    return cold, warm


def serve(url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "ROLLWAY_ADMIN_KEY": ADMIN}
    proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "view", "--db", url, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"rollway view exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("rollway view did not start in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=20, help="requests per filter combination")
    ap.add_argument("--browser-runs", type=int, default=4, help="warm session-page loads in Chromium, plus one")
    ap.add_argument("--cold-runs", type=int, default=3,
                    help="cold loads after the first (each after the turn count moved), between the warm ones")
    ap.add_argument("--cache", type=Path, default=ROOT / "runs" / "bench-viewer")
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432")
    args = ap.parse_args()
    result: dict[str, Any] = {"benchmark": "viewer", "sessions": args.sessions, "repeat": args.repeat,
                              "cpus": os.cpu_count(), "stores": {}}
    for kind in args.stores:
        url = store_url(kind, args.sessions, args.cache, args.pg)
        big = asyncio.run(build(url, args.sessions))
        proc, base = serve(url)
        try:
            groups = time_groups(base, args.repeat)
            cold, warm = time_session(base, url, big, args.browser_runs, args.cold_runs) if args.browser_runs else ([], [])
        finally:
            proc.terminate()
            proc.wait(15)
        worst = max(g["p95_ms"] for g in groups)
        result["stores"][kind] = {"groups": groups, "groups_p95_max_ms": worst, "groups_ok": worst <= 200,
                                  "session_cold_s": cold, "session_warm_s": warm,
                                  "session_ok": bool(cold) and max(cold + warm) <= 1.0}
        print(f"\n{kind}: /ui/groups over {args.sessions:,} sessions ({args.repeat} requests each)")
        print(f"{'filter':<24}{'rows':>6}{'p50 ms':>10}{'p95 ms':>10}")
        for g in groups:
            print(f"{g['filter']:<24}{g['rows']:>6}{g['p50_ms']:>10}{g['p95_ms']:>10}")
        print(f"session of {BIG_TURNS} turns x {PROMPT_DELTA + REPLY} tokens, token view of the last turn in Chromium: "
              f"cold {cold} s (the first load, then each after a new turn count), warm {warm} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
