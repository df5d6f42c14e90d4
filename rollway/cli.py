"""`rollway` command line. Each command is a thin wrapper over the package that does the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    from rollway.serve import serve

    return serve(args)


def _engine(args: argparse.Namespace) -> int:
    from engine.server import serve

    serve(args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
          max_batch_size=args.max_batch_size, incremental_streaming_output=args.incremental_streaming_output)
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import create_tiny_model

    out = create_tiny_model(args.out, seed=args.seed, size=args.size)
    print(f"wrote {out}")
    return 0


def _db(args: argparse.Namespace) -> int:
    from gateway.settings import Settings
    from gateway.store import db

    url = args.db or Settings(data_dir=Path(args.data_dir)).db_url
    if args.action == "upgrade":
        db.upgrade(url)
        print(f"database at revision {db.current_revision(url)} (head {db.head_revision()})")
    else:
        print(db.current_revision(url) or "empty")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from rollway.rollout import main as rollout_main

    return rollout_main(args)


def _train(args: argparse.Namespace) -> int:
    if any(a in ("-h", "--help") for a in args.args):
        print(TRAIN_USAGE + "\n\noptions:\n" + _config_help())
        return 0
    from trainer.launch import main as train_main

    return train_main(args.args)


def _config_help() -> str:
    """Each TrainConfig field with its default and the docstring under it (read from the source)."""
    import ast
    import inspect

    from trainer.config import TrainConfig

    tree = ast.parse(inspect.getsource(TrainConfig))
    lines: list[str] = []
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            default = ast.unparse(node.value) if node.value is not None else "required"
            doc = ""
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = " ".join(nxt.value.value.split())
            lines.append(f"  --{node.target.id.replace('_', '-'):<28} (default {default}) {doc}")
    return "\n".join(lines)


TRAIN_USAGE = """usage: rollway train --gateway URL --model DIR --out DIR [--nproc N] [--config FILE] [--OPTION VALUE ...]

Lease complete groups from the gateway, train with FSDP2 under torchrun, publish weights.
Admin key from ROLLWAY_ADMIN_KEY. Every option below can be given as --name value and overrides the file."""


def _demo(args: argparse.Namespace) -> int:
    from rollway.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollway",
        description="Turn any OpenAI-SDK agent into RL training data, and train on it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `rollway demo` (the whole loop on CPU), or `rollway serve` and point an agent at it.",
    )
    p.add_argument("--log-level", default=os.environ.get("ROLLWAY_LOG_LEVEL", "INFO"), help="logging level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the gateway (with a CPU engine and the tiny model when no --backend)",
                       description="Run the OpenAI-compatible recording gateway. With no --backend it also starts "
                       "the CPU engine with the tiny model (created on first use).")
    s.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="SGLang server base URL (repeatable); none = embedded CPU engine")
    s.add_argument("--tokenizer", default="", metavar="DIR", help="HF model folder with the chat template "
                   "(required with --backend)")
    s.add_argument("--db", default="", metavar="URL", help="sqlite:///FILE or postgresql://... "
                   "(default: SQLite in the data dir)")
    s.add_argument("--data-dir", default="rollway-data", help="embedded database, admin key, tiny model")
    s.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs ROLLWAY_ADMIN_KEY)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--public-url", default="", help="base URL handed to agents (default: from each request)")
    s.add_argument("--served-model-name", default="", help="model name in replies (default: model folder name)")
    s.add_argument("--tool-parser", default="hermes", help="tool-call format: hermes | llama3_json")
    s.add_argument("--context-length", type=int, default=0, help="fallback when backend and config don't say")
    s.set_defaults(fn=_serve)

    e = sub.add_parser("engine", help="the CPU stand-in for SGLang alone",
                       description="Serve SGLang's HTTP contract on CPU with transformers (continuous batching).")
    e.add_argument("--model", required=True, metavar="DIR", help="HF model folder")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=30000)
    e.add_argument("--served-model-name", default=None)
    e.add_argument("--max-batch-size", type=int, default=32)
    e.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream deltas instead of cumulative chunks (like SGLang's flag)")
    e.set_defaults(fn=_engine)

    m = sub.add_parser("init-model", help="create the tiny local model and tokenizer",
                       description="Write a tiny Qwen2-style HF model with a locally trained tokenizer and a "
                       "tool-capable ChatML template. Deterministic for a seed; no download.")
    m.add_argument("--out", required=True, metavar="DIR")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    m.set_defaults(fn=_init_model)

    r = sub.add_parser("rollout", help="run an agent over a task file, n samples per task",
                       description="Replicate each task into a group of sessions, run the agent on each, post "
                       "rewards. Admin key from ROLLWAY_ADMIN_KEY.")
    from rollway.rollout import add_arguments as rollout_args

    rollout_args(r)
    r.set_defaults(fn=_rollout)

    t = sub.add_parser("train", help="the RL/SFT trainer (launches torchrun)", add_help=False)
    t.add_argument("args", nargs=argparse.REMAINDER, help="trainer options (rollway train --help)")
    t.set_defaults(fn=_train)

    d = sub.add_parser("demo", help="the whole loop on this CPU machine",
                       description="Create the tiny model, warm it up with SFT, serve it, and train it with RL on "
                       "two-digit addition; prints a summary table, a plot and a JSON line.")
    d.add_argument("--out", default="rollway-demo", help="folder for the model, database, logs and plot")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--minutes", type=float, default=8.0, help="time budget for the RL phase")
    d.add_argument("--steps", type=int, default=0, help="stop after this many trainer steps (0 = time budget)")
    d.add_argument("--nproc", type=int, default=1, help="trainer processes (CPU ranks)")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("db", help="database migrations", description="Alembic migrations of the store.")
    b.add_argument("action", choices=["upgrade", "current"])
    b.add_argument("--db", default="", metavar="URL")
    b.add_argument("--data-dir", default="rollway-data")
    b.set_defaults(fn=_db)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Like parse_args, except that `train` takes every option after it (the trainer validates them)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.args = extra + list(args.args)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "openai"):  # one line per request is not a log
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
