"""`rollway serve`: migrations, admin key, the embedded engine when no backend is given, then uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from rollway.embedded import EngineSupervisor, ensure_tiny_model
from rollway.keys import admin_key, private_data_dir

READY_WAIT_S = 10.0
"""How long after the gateway first answers a backend may take to become healthy before `rollway serve` warns."""


KEEP_ALIVE_S = 75
"""How long the gateway keeps an idle client connection open. Well above what clients keep one for (the openai
and anthropic SDKs: httpx's 5 s; the rollout runner: 2 s): a client must be the side that drops an idle
connection, else it may send a request on one the server is closing at that instant. With uvicorn's default of
5 s, equal to the SDKs' own, a demo on a machine at load 18 lost its group creation to exactly that ("Can not
write request body") and stopped."""


def server_config(app: Any, **overrides: Any) -> Any:
    """The gateway's uvicorn configuration (`rollway serve`; benchmarks/gateway.py runs the gateway with it too):
    uvloop, uvicorn's httptools protocol with each response's headers and first body bytes in one write
    (gateway.server_protocol), no access log. proxy_headers off: uvicorn would believe X-Forwarded-For from
    127.0.0.1, i.e. from any local user; the app believes them from ROLLWAY_TRUSTED_PROXIES only (gateway.proxies)."""
    import uvicorn

    from gateway.server_protocol import GatewayHttpProtocol

    options: dict[str, Any] = {"log_level": "warning", "access_log": False, "loop": "uvloop", "http": GatewayHttpProtocol,
                               "timeout_graceful_shutdown": 5, "proxy_headers": False,
                               "timeout_keep_alive": KEEP_ALIVE_S}
    return uvicorn.Config(app, **{**options, **overrides})


def prepare_database(url: str) -> None:
    """SQLite: bring the embedded file to head. PostgreSQL: refuse to start when behind (docs/architecture.md
    "The store")."""
    from gateway.store import db

    if db.is_sqlite(url):
        db.upgrade(url)
        return
    current, head = db.current_revision(url), db.head_revision()
    if current != head:
        raise SystemExit(f"the database is at revision {current or 'none'}, the code at {head}: "
                         f"run `rollway db upgrade --db {url}`")


SAME_MODEL_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads")
"""What a checkpoint must share with the model it was trained from to load into an engine serving that model."""


def resumed_weights(db_url: str, model: Path) -> None:
    """The embedded engine starts on `model`, and the gateway then loads the store's current published version
    into it (a restart resumes the run). Refused up front when that cannot work: the version's folder is gone (the
    gateway would retry forever, never ready), or it is of another model than `model` (a data folder of an
    earlier run with `--model` changed: the engine would swap in weights of another architecture)."""
    from gateway.adapters import is_adapter
    from gateway.store import db
    from gateway.weight_sync import DISTRIBUTED

    version, path = db.current_weights(db_url)
    if version == 0 or path is None or is_adapter(path) or path.startswith(DISTRIBUTED):
        return
    here = f"the store ({db_url}) serves weights version {version}, published from {path},"
    fresh = "start a new run with a new --data-dir (or --db): this one's groups and versions belong to that run"
    if not Path(path).is_dir():
        raise SystemExit(f"{here} and that folder is gone: restore it, or {fresh}")
    trained, given = _config(Path(path)), _config(model)
    differ = [k for k in SAME_MODEL_KEYS if k in trained and k in given and trained[k] != given[k]]  # both say
    if trained and given and differ:
        shown = ", ".join(f"{k} {trained.get(k)!r} there, {given.get(k)!r} in {model}" for k in differ[:3])
        raise SystemExit(f"{here} of another model than --model {model} ({shown}): to serve that model, {fresh}")
    print(f"resuming this data folder's run: the engine starts on {model}, then loads its weights version {version} "
          f"({path})", file=sys.stderr)


def _config(model: Path) -> dict[str, Any]:
    try:
        data = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def listen_socket(host: str, port: int) -> socket.socket:
    """The gateway's socket, bound before anything else starts (engine, migrations, key file): a port in use
    fails the command at once, with the port named. Bound as uvicorn binds (same family choice, SO_REUSEADDR so
    a restart needs no wait for TIME_WAIT), and not listening yet: until the app is up a client is refused
    rather than left waiting in the backlog. uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"rollway serve: port {port} on {host} is already in use; stop what listens there "
                             f"or pick another port (--port, env ROLLWAY_PORT)") from None
        raise SystemExit(f"rollway serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def local_url(host: str, port: int) -> str:
    """How this machine reaches a gateway bound to host:port (a wildcard address through loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our own loopback: never via a proxy


def readiness(url: str) -> tuple[int, str]:
    """(status of GET url/ready, its reason); status 0 while the gateway does not answer at all."""
    try:
        with _direct.open(f"{url}/ready", timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        try:
            return e.code, str(json.loads(e.read()).get("reason", e.reason))
        except (ValueError, AttributeError, OSError):
            return e.code, str(e.reason)
    except (urllib.error.URLError, OSError):
        return 0, "the gateway does not answer yet"


def announce_readiness(url: str, backends: Sequence[str], wait_s: float = READY_WAIT_S) -> None:
    """Say when the gateway is ready to serve agents (GET /ready answers 200). If no backend is healthy within
    `wait_s` of the gateway answering, say so plainly, naming the backends, and keep watching: the gateway
    serves on (liveness, admin routes) and says ready once a backend answers."""
    deadline: float | None = None
    warned = False
    while True:
        status, reason = readiness(url)
        if status == 200:
            print(f"rollway serve: ready at {url} (GET /ready answers 200)", file=sys.stderr, flush=True)
            return
        if status and deadline is None:
            deadline = time.monotonic() + wait_s
        if deadline is not None and not warned and time.monotonic() >= deadline:
            print(f"rollway serve: WARNING: not ready {wait_s:.0f}s after start: {reason}. Backend(s): "
                  f"{', '.join(backends) or 'none (add one with POST /v1/backends)'}. The gateway keeps serving "
                  "and GET /ready answers 503 until a backend answers GET /health.", file=sys.stderr, flush=True)
            warned = True
        time.sleep(2.0 if warned else 0.25)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Settings fields given on the command line (`rollway.cli` leaves the others out of the namespace,
    so they come from ROLLWAY_* or the defaults)."""
    from gateway.settings import Settings

    return {k: v for k, v in vars(args).items() if k in Settings.model_fields}


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import Settings

    # One precedence: a flag given on the command line > ROLLWAY_* environment > Settings' default.
    settings = Settings(**settings_from_args(args))
    data_dir = settings.data_dir
    # Everything that can be refused is refused before anything is written or started.
    if not settings.is_loopback and not settings.admin_key:
        raise SystemExit(f"refusing to bind {settings.host} without ROLLWAY_ADMIN_KEY set explicitly")
    if settings.model and settings.backends:
        raise SystemExit("--model is for the embedded CPU engine; with --backend, give --tokenizer DIR instead")
    if settings.backends and not settings.tokenizer:
        raise SystemExit("--tokenizer DIR is required with --backend (the gateway tokenizes itself)")
    sock = listen_socket(settings.host, settings.port)
    # SIGTERM unwinds like Ctrl-C, so the embedded engine is stopped on the way out. (uvicorn handles SIGTERM
    # while it serves, then raises it again once it has shut down: with the default action the process died
    # right there and the engine was left running.)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with contextlib.ExitStack() as stack:
        stack.callback(sock.close)
        # Made here whatever the key's source: with ROLLWAY_ADMIN_KEY set, nothing else creates it before the
        # engine's log and the SQLite store are opened inside it.
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key, generated = admin_key(data_dir)
        private_data_dir(data_dir, settings.db_url)
        if generated:
            print(f"admin key (stored in {data_dir / 'admin_key'}; shown once): {key}", file=sys.stderr)
        prepare_database(settings.db_url)
        supervisor = None
        if not settings.backends:
            model = Path(settings.model) if settings.model else ensure_tiny_model(data_dir)
            resumed_weights(settings.db_url, model)
            # Its admin routes (pause, abort, weights) take a key of this run's: no other local user can pause it.
            engine_key = settings.backend_admin_api_key or "rw-engine-" + secrets.token_urlsafe(32)
            supervisor = EngineSupervisor(model, log_path=data_dir / "engine.log",  # restarted when it dies
                                          admin_api_key=engine_key)
            url = supervisor.start()
            stack.callback(supervisor.stop)
            settings = settings.model_copy(update={"backends": [url], "tokenizer": settings.tokenizer or str(model),
                                                   "backend_admin_api_key": engine_key})
            print(f"embedded CPU engine at {url} serving {model}", file=sys.stderr)
        # The embedded engine's supervisor is attached to the pool in the lifespan and reported by GET /ready.
        app = create_app(settings, admin_key=key, engine_supervisor=supervisor)
        print(f"gateway on http://{settings.host}:{settings.port}  (agents: POST /v1/groups for keys)",
              file=sys.stderr)
        server = uvicorn.Server(server_config(app))
        threading.Thread(target=announce_readiness, args=(local_url(settings.host, settings.port), settings.backends),
                         name="readiness", daemon=True).start()
        server.run(sockets=[sock])
        if not server.started:  # the app failed to start; uvicorn logged why
            return 3
    return 0
