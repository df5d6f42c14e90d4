#!/usr/bin/env python
"""Client compatibility matrix: agent frameworks driven, unmodified, against a real `rollway serve`.

    python scripts/client_matrix.py                 # every driver; rewrites the matrix in docs/clients.md
    python scripts/client_matrix.py --only dspy,smolagents
    python scripts/client_matrix.py --ci            # the CI set (CI_SET): exits 1 if any of it fails

Each framework has a driver, `scripts/clients/<name>.py`, found by listing that folder, with

    def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict
        # {"ok": bool, "calls": int, "chains": int, "detail": str, "version": str}

and module-level constants read without importing it (`ast`): LABEL (the row's name), LANGUAGE ("python" or
"node"), MODES (what it exercises), REQUIREMENTS (pinned pip specs: its venv), NPM (pinned npm specs: its
node_modules, handed to the driver as $ROLLWAY_NODE_MODULES), VENV (a venv name to share with another driver).
Missing REQUIREMENTS fall back to PINS below. A driver runs in its own virtual environment,
~/.cache/rollway/client-matrix/<name>-<version> (made once, from PyPI/npm: the only network use), in a
subprocess, against one greedy session of a gateway started here on the client tests' tuned model
(tests/clients/tuned-model: it thinks and calls the `calculate` tool when asked "What is 12+7?").

The row's calls and chains are the gateway's (the session's stored turns; a chain starts at each turn with no
parent), not the driver's word; a row works when the driver says so, every request it made was answered 2xx (the
gateway's `rollway_requests_total` by status, before and after), at least one call was stored, and every stored
turn has its completion ids with one logprob each. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DRIVERS = ROOT / "scripts" / "clients"
MODEL = ROOT / "tests" / "clients" / "tuned-model"
DOC = ROOT / "docs" / "clients.md"
CACHE = Path(os.environ.get("ROLLWAY_CLIENT_MATRIX_CACHE", "~/.cache/rollway/client-matrix")).expanduser()
CI_SET = ("claude_agent_sdk", "openai_python", "openai_js")
"""Run by `--ci` (and so by .ci/run): the Claude Agent SDK and one framework per language."""
PINS: dict[str, list[str]] = {"claude_agent_sdk": ["claude-agent-sdk==0.2.189"]}
"""Requirements for a driver that does not state its own."""
NOT_RUN: dict[str, tuple[str, str]] = {}
"""Frameworks of the matrix that have no driver yet: a row saying so (a driver of the same name replaces it)."""
BEGIN, END = "<!-- client-matrix:begin -->", "<!-- client-matrix:end -->"
RUNNER = """
import importlib.util, json, pathlib, sys, traceback
path, base_url, api_key, workdir = sys.argv[1:5]
sys.path.append(str(pathlib.Path(path).parent))  # the drivers' _common, after the frameworks (a driver may share a name with one)
spec = importlib.util.spec_from_file_location("driver", path)
mod = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(mod)
    out = mod.run(base_url, api_key, pathlib.Path(workdir))
except BaseException as e:
    out = {"ok": False, "calls": 0, "chains": 0, "version": "?",
           "detail": f"{type(e).__name__}: {e}"[:600] + " | " + traceback.format_exc()[-600:]}
print("\\n@@result@@ " + json.dumps(out, default=str), flush=True)
"""


def driver_meta(path: Path) -> dict[str, Any]:
    """The driver's module-level constants (literals only), read without running it."""
    meta: dict[str, Any] = {"name": path.stem, "path": path}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in {"LABEL", "LANGUAGE", "MODES", "REQUIREMENTS", "NPM", "VENV"}:
                    with contextlib.suppress(ValueError):
                        meta[t.id.lower()] = ast.literal_eval(node.value)  # type: ignore[arg-type]
    meta.setdefault("label", path.stem)
    meta.setdefault("language", "node" if meta.get("npm") else "python")
    meta.setdefault("modes", "")
    meta.setdefault("requirements", PINS.get(path.stem, []))
    meta.setdefault("npm", [])
    return meta


def discover() -> dict[str, dict[str, Any]]:
    return {p.stem: driver_meta(p) for p in sorted(DRIVERS.glob("*.py")) if not p.stem.startswith("_")}


def _version_of(spec: str) -> str:
    for sep in ("==", "@"):
        head, found, tail = spec.rpartition(sep)
        if found and head:
            return tail
    return "unpinned"


def _pinned_dir(name: str, specs: list[str]) -> Path:
    return CACHE / f"{name}-{_version_of(specs[0])}"


def _ready(folder: Path, specs: list[str]) -> bool:
    stamp = folder / ".rollway-specs"
    return stamp.is_file() and stamp.read_text() == json.dumps(specs)


def ensure_venv(meta: dict[str, Any], log: Any) -> str:
    """The driver's interpreter: a venv with its REQUIREMENTS (made once), or this one, isolated, with none."""
    specs: list[str] = meta["requirements"]
    if not specs:
        return sys.executable
    venv = _pinned_dir(meta.get("venv") or meta["name"], specs)
    python = venv / "bin" / "python"
    if not _ready(venv, specs):
        t0 = time.monotonic()
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *specs],
                       check=True, stdout=log, stderr=log)
        (venv / ".rollway-specs").write_text(json.dumps(specs))
        print(f"  venv {venv.name}: {time.monotonic() - t0:.0f} s", file=log, flush=True)
    return str(python)


def ensure_node_modules(meta: dict[str, Any], log: Any) -> str | None:
    specs: list[str] = meta["npm"]
    if not specs:
        return None
    folder = _pinned_dir(meta["name"] + "-npm", specs)
    if not _ready(folder, specs):
        t0 = time.monotonic()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "package.json").write_text(json.dumps({"name": "rollway-client-matrix", "private": True}))
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--save-exact", *specs], cwd=folder, check=True,
                       stdout=log, stderr=log)
        (folder / ".rollway-specs").write_text(json.dumps(specs))
        print(f"  node_modules {folder.name}: {time.monotonic() - t0:.0f} s", file=log, flush=True)
    return str(folder / "node_modules")


@contextlib.contextmanager
def gateway(workdir: Path, model: Path = MODEL) -> Iterator[tuple[str, str]]:
    """`rollway serve` on the tuned model (its embedded CPU engine), SQLite in `workdir`: (URL, admin key)."""
    from rollway.embedded import free_port, stop, wait_healthy

    key = "rw-admin-" + secrets.token_urlsafe(24)
    port = free_port()
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ROLLWAY_ADMIN_KEY": key, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with (workdir / "serve.log").open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "serve", "--model", str(model), "--port",
                                 str(port), "--data-dir", str(data), "--served-model-name", "policy"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, timeout=300)
            yield url, key
        finally:
            stop(proc)


def _admin(url: str, key: str) -> Any:
    import httpx

    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False)


def new_session(url: str, key: str, name: str) -> dict[str, Any]:
    with _admin(url, key) as http:
        r = http.post("/v1/groups", json={"task": {"client_matrix": name}, "n_samples": 1,
                                          "sampling": {"temperature": 0.0}})
        r.raise_for_status()
        return dict(r.json()["sessions"][0])


def stored(url: str, key: str, session_id: str) -> dict[str, Any]:
    """What the gateway stored: calls (turns), chains (turns with no parent), whether every turn is trainable."""
    with _admin(url, key) as http:
        r = http.get(f"/v1/sessions/{session_id}")
        r.raise_for_status()
    turns = sorted(r.json()["turns"], key=lambda t: t["seq"])
    reasons = sorted({t["chain_reason"] for t in turns[1:] if t["parent_id"] is None and t.get("chain_reason")})
    return {"calls": len(turns), "chains": sum(t["parent_id"] is None for t in turns),
            "tokens_ok": all(t["completion_ids"] and len(t["logprobs"]) == len(t["completion_ids"]) for t in turns),
            "chain_reasons": reasons}


def statuses(url: str) -> Counter[tuple[str, str]]:
    """The gateway's request counts by (route, status), from its Prometheus metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    out: Counter[tuple[str, str]] = Counter()
    for m in re.finditer(r'^rollway_requests_total\{([^}]*)\} ([0-9.e+]+)$', text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        out[(labels.get("route", "?"), labels.get("status", "?"))] += int(float(m[2]))
    return out


def run_driver(meta: dict[str, Any], url: str, key: str, workdir: Path, timeout: float, log: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"name": meta["name"], "label": meta["label"], "language": meta["language"],
                           "modes": meta["modes"], "pins": meta["requirements"] + meta["npm"]}
    try:
        python = ensure_venv(meta, log)
        node_modules = ensure_node_modules(meta, log)
    except (subprocess.CalledProcessError, OSError) as e:
        return {**row, "ok": False, "calls": 0, "chains": 0, "version": "?", "seconds": 0,
                "detail": f"could not build its environment: {e}"}
    session = new_session(url, key, meta["name"])
    wd = workdir / meta["name"]
    wd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
                                                            "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"}}
    env.update({"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
                "ROLLWAY_NODE_MODULES": node_modules or "", "ROLLWAY_ANTHROPIC_BASE_URL":
                session.get("anthropic_base_url") or session["base_url"].removesuffix("/").removesuffix("/v1")})
    before = statuses(url)
    argv = [python, "-c", RUNNER, str(meta["path"]), session["base_url"], session["api_key"], str(wd)]
    try:
        proc = subprocess.run(argv, env=env, cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        output = proc.stdout
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n@@result@@ {json.dumps({'ok': False, 'detail': f'timed out after {timeout:.0f} s'})}"
    (wd / "driver.log").write_text(output)
    said: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith("@@result@@ "):
            said = json.loads(line.removeprefix("@@result@@ "))
    if not said:
        said = {"ok": False, "detail": "the driver printed no result: " + output[-400:]}
    got = stored(url, key, session["session_id"])
    refused = {k: n for k, n in (statuses(url) - before).items() if not k[1].startswith("2")}
    ok = bool(said.get("ok")) and got["calls"] > 0 and got["tokens_ok"] and not refused
    detail = str(said.get("detail", ""))
    if refused:
        detail = "not 2xx: " + ", ".join(f"{r} {st} x{n}" for (r, st), n in sorted(refused.items())) + ". " + detail
    if said.get("ok") and not got["calls"]:
        detail = "no call was stored. " + detail
    elif said.get("ok") and not got["tokens_ok"]:
        detail = "a stored turn lacks its completion ids or logprobs. " + detail
    if isinstance(said.get("calls"), int) and said["calls"] and said["calls"] != got["calls"]:
        detail += f" (the driver counted {said['calls']} calls)"
    return {**row, "ok": ok, "calls": got["calls"], "chains": got["chains"], "chain_reasons": got["chain_reasons"],
            "version": said.get("version", "?"), "detail": detail.strip(), "seconds": round(time.monotonic() - t0, 1)}


def chain_meaning(row: dict[str, Any]) -> str:
    """The chains the gateway stored, with the reasons the later ones started (docs/architecture.md)."""
    if not row.get("calls"):
        return ""
    why = f" (new chains: {', '.join(row['chain_reasons'])})" if row.get("chain_reasons") else ""
    if row["chains"] <= 1:
        return "one chain: the session is one sample, every call's tokens in it"
    if row["chains"] >= row["calls"]:
        return f"a new chain every call{why}: each call is its own sample, all sharing the session's reward"
    return f"{row['chains']} chains in {row['calls']} calls{why}: a sample per chain"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| framework | language | version | modes | works | calls | chains | for training | detail |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        works = "not run by the script yet" if r.get("not_run") else ("yes" if r["ok"] else "**no**")
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['label']} | {r['language']} | {r.get('version', '')} | {r.get('modes', '')} | {works} | "
                     f"{r.get('calls', '')} | {r.get('chains', '')} | {chain_meaning(r)} | {detail[:300]} |")
    return "\n".join(lines)


def write_doc(rows: list[dict[str, Any]], seconds: float) -> None:
    section = (f"{BEGIN}\n<!-- generated by `python scripts/client_matrix.py`: do not edit by hand -->\n\n"
               f"Run: {time.strftime('%Y-%m-%d', time.gmtime())}, {seconds:.0f} s for {sum(not r.get('not_run') for r in rows)} "
               f"frameworks (venvs already built; building them is extra, once).\n\n{table(rows)}\n{END}")
    text = DOC.read_text() if DOC.is_file() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated driver names (scripts/clients/<name>.py)")
    ap.add_argument("--ci", action="store_true", help=f"the CI set: {', '.join(CI_SET)}")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per framework (default 600)")
    ap.add_argument("--model", type=Path, default=MODEL, help="the model folder to serve (default: the tuned model)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/clients.md (--only/--ci never do)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    drivers = discover()
    wanted = list(CI_SET) if args.ci else [n for n in args.only.split(",") if n] or list(drivers)
    unknown = [n for n in wanted if n not in drivers]
    if unknown:
        print(f"no driver for {', '.join(unknown)} (scripts/clients/: {', '.join(drivers)})", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="client-matrix-") as tmp, gateway(Path(tmp), args.model) as (url, key):
        print(f"gateway up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        for name in wanted:
            print(f"- {name}", file=sys.stderr, flush=True)
            row = run_driver(drivers[name], url, key, Path(tmp), args.timeout, sys.stderr)
            print(f"  {'ok' if row['ok'] else 'FAILED'}: {row['calls']} calls, {row['chains']} chains, "
                  f"{row['seconds']} s; {chain_meaning(row)}; {row['detail'][:300]}", file=sys.stderr, flush=True)
            rows.append(row)
    seconds = time.monotonic() - t0
    all_rows = rows + [{"name": n, "label": label, "language": lang, "not_run": True}
                       for n, (label, lang) in NOT_RUN.items() if n not in drivers]
    print(table(all_rows))
    if not (args.only or args.ci or args.no_docs or args.model != MODEL):
        write_doc(all_rows, seconds)
    failed = [r["name"] for r in rows if not r["ok"]]
    print(json.dumps({"ok": not failed, "failed": failed, "seconds": round(seconds), "rows": rows,
                      "model_sha256": hashlib.sha256((args.model / "model.safetensors").read_bytes()).hexdigest()[:16]},
                     default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
