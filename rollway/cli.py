"""`rollway` command line. Each command is a thin wrapper over the package that does the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    from rollway.serve import serve

    return serve(args)


def _engine(args: argparse.Namespace) -> int:
    from engine.lora import LoRAOptions
    from engine.server import serve

    serve(args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
          max_batch_size=args.max_batch_size, incremental_streaming_output=args.incremental_streaming_output,
          lora=LoRAOptions.from_args(args), api_key=args.api_key, admin_api_key=args.admin_api_key)
    return 0


def _lora_engine_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's LoRA flags on `rollway engine` (engine/lora.py; imported lazily: the CLI starts without torch)."""
    g = parser.add_argument_group("LoRA adapters (SGLang's flags)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
    g.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                   help="linears adapters may target (default q_proj k_proj v_proj o_proj; 'all')")
    g.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank")
    g.add_argument("--max-loaded-loras", type=int, default=None,
                   help="adapters kept loaded; a load past it unloads the least recently used one")
    g.add_argument("--max-loras-per-batch", type=int, default=8, help="accepted for SGLang compatibility")
    g.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=PATH", help="adapters loaded at start")


def _init_model(args: argparse.Namespace) -> int:
    if args.arch is None:
        if args.tokenizer is not None:
            raise SystemExit("rollway init-model: --tokenizer DIR goes with --arch (qwen3, qwen2 or llama); "
                             "without --arch the tiny demo model brings its own tokenizer")
        if args.size == "small":
            raise SystemExit("rollway init-model: --size small goes with --arch; the tiny demo model comes in "
                             "tiny or 100m")
        from engine.tiny_model import create_tiny_model

        out = create_tiny_model(args.out, seed=args.seed, size=args.size)
        print(f"wrote {out}")
        return 0
    if args.tokenizer is None:
        raise SystemExit(f"rollway init-model: --arch {args.arch} needs --tokenizer DIR, a local folder with the "
                         "tokenizer files and chat template of the model family (e.g. a downloaded model's folder)")
    if args.size == "100m":
        raise SystemExit("rollway init-model: with --arch the sizes are tiny and small")
    from engine.init_model import TokenizerFolderError, create_model

    try:
        out = create_model(args.out, arch=args.arch, tokenizer_dir=args.tokenizer, size=args.size, seed=args.seed)
    except TokenizerFolderError as e:
        raise SystemExit(f"rollway init-model: {e}") from None
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
        print(TRAIN_USAGE + "\n\noptions:\n" + TRAIN_LAUNCH_HELP + "\n" + _config_help())
        return 0
    from rollway.keys import ENV, find_admin_key
    from trainer.launch import main as train_main

    argv, data_dir = _take_option(list(args.args), "--data-dir", os.environ.get("ROLLWAY_DATA_DIR", "rollway-data"))
    key = find_admin_key(data_dir)
    if key and not os.environ.get(ENV):  # the workers take it from the environment, never from a file
        os.environ[ENV] = key
        # a 401 from the gateway then says which gateway's key this was
        print(f"rollway train: admin key from {Path(data_dir) / 'admin_key'}", file=sys.stderr)
    return train_main(argv)


def _take_option(argv: list[str], flag: str, default: str) -> tuple[list[str], str]:
    """Remove `flag VALUE` / `flag=VALUE` from argv; returns (the rest, the value or default)."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if a.startswith(flag + "="):
            return argv[:i] + argv[i + 1:], a.split("=", 1)[1]
    return argv, default


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


TRAIN_USAGE = """usage: rollway train --gateway URL --model DIR [--out DIR] [--nproc N] [--config FILE] [--OPTION VALUE ...]

Lease complete groups from the gateway, train with FSDP2 under torchrun, publish weights.
Every trainer option below can be set, from weakest to strongest: in the --config file, as an environment
variable ROLLWAY_<OPTION> (e.g. ROLLWAY_LR=1e-5), or as --option value on the command line.
Admin key: ROLLWAY_ADMIN_KEY, else DATA_DIR/admin_key (the file `rollway serve` writes; DATA_DIR: --data-dir,
else ROLLWAY_DATA_DIR, else rollway-data)."""

TRAIN_LAUNCH_HELP = """  --nproc N                      (default 1) trainer processes on this machine (torchrun --nproc-per-node)
  --config FILE                  (default none) TOML or JSON file of trainer options (a TOML file may use [train])
  --data-dir DIR                 (default ROLLWAY_DATA_DIR, else rollway-data) where to find admin_key when
                                 ROLLWAY_ADMIN_KEY is unset"""


def _demo(args: argparse.Namespace) -> int:
    from rollway.demo import main as demo_main

    return demo_main(args)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default in its help line (none for required options)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or action.required or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, argparse._HelpAction) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _setting(parser: argparse.ArgumentParser, flag: str, field: str, **kw: Any) -> None:
    """An option of `rollway serve` that maps to gateway.settings.Settings.<field>: absent unless given, so
    the settings object sees the environment; its help shows the Settings default."""
    from gateway.settings import Settings

    default = Settings.model_fields[field].get_default(call_default_factory=True)
    shown = ",".join(default) if isinstance(default, list) else default
    kw["help"] = f"{kw.get('help', '')} (default: {shown if shown not in ('', []) else 'none'}; env ROLLWAY_{field.upper()})"
    parser.add_argument(flag, dest=field, default=argparse.SUPPRESS, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollway",
        description="Turn any OpenAI-SDK agent into RL training data, and train on it.",
        formatter_class=HelpFormatter,
        epilog="Start with `rollway demo` (the whole loop on CPU), or `rollway serve` and point an agent at it.",
    )
    p.add_argument("--log-level", default=os.environ.get("ROLLWAY_LOG_LEVEL", "INFO"),
                   help="logging level (env ROLLWAY_LOG_LEVEL)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the gateway (with a CPU engine and the tiny model when no --backend)",
                       formatter_class=HelpFormatter,
                       description="Run the OpenAI-compatible recording gateway. With no --backend it also starts "
                       "the CPU engine with the tiny model (created on first use): an untrained model whose "
                       "replies are noise, to try the API; serve a trained one with --model DIR.",
                       epilog="Every option can also be set as an environment variable ROLLWAY_<OPTION> "
                       "(ROLLWAY_BACKENDS=url1,url2, ROLLWAY_TOKENIZER, ROLLWAY_DB, ROLLWAY_PORT, ...); "
                       "a flag on the command line wins over the environment, which wins over the default.")
    # No argparse defaults here: an option not given must not hide its ROLLWAY_* variable (the defaults
    # live in gateway.settings.Settings and are shown in the help from there).
    _setting(s, "--backend", "backends", action="append", metavar="URL",
             help="SGLang server base URL (repeatable); none = embedded CPU engine")
    _setting(s, "--model", "model", metavar="DIR",
             help="with no --backend: the HF model folder the embedded CPU engine serves (e.g. a folder "
             "`rollway train` published under OUT/weights/); default: the tiny model in the data dir")
    _setting(s, "--tokenizer", "tokenizer", metavar="DIR",
             help="HF model folder with the chat template (required with --backend)")
    _setting(s, "--db", "db", metavar="URL", help="sqlite:///FILE or postgresql://... (empty: SQLite in the data dir)")
    _setting(s, "--data-dir", "data_dir", help="embedded database, admin key, tiny model")
    _setting(s, "--host", "host", help="bind address (non-loopback needs ROLLWAY_ADMIN_KEY)")
    _setting(s, "--port", "port", type=int)
    _setting(s, "--public-url", "public_url", help="base URL handed to agents (empty: from each request)")
    _setting(s, "--trusted-proxy", "trusted_proxies", action="append", metavar="IP[/BITS]",
             help="a reverse proxy whose X-Forwarded-For/-Proto/-Host are believed (repeatable)")
    _setting(s, "--served-model-name", "served_model_name",
             help="model name in replies (empty: the model folder's name)")
    from gateway.tool_formats import reasoning_format_names, tool_format_names

    _setting(s, "--tool-parser", "tool_parser",
             help=f"tool-call format: auto (from the chat template) | {' | '.join(tool_format_names())} | none "
             "(docs/models.md)")
    _setting(s, "--reasoning-parser", "reasoning_parser",
             help=f"reasoning format: auto (from the chat template) | {' | '.join(reasoning_format_names())} | none")
    _setting(s, "--context-length", "context_length", type=int,
             help="fallback when backend and config don't say (0: unknown)")
    s.set_defaults(fn=_serve)

    e = sub.add_parser("engine", formatter_class=HelpFormatter, help="the CPU stand-in for SGLang alone",
                       description="Serve SGLang's HTTP contract on CPU with transformers (continuous batching).")
    e.add_argument("--model", required=True, metavar="DIR", help="HF model folder")
    e.add_argument("--host", default="127.0.0.1", help="bind address")
    e.add_argument("--port", type=int, default=30000, help="port")
    e.add_argument("--served-model-name", default=None, help="model name in /get_model_info (default: folder name)")
    e.add_argument("--max-batch-size", type=int, default=32, help="sequences decoded together")
    e.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream deltas instead of cumulative chunks (like SGLang's flag)")
    # SGLang's key flags (engine/auth.py; the CLI starts without importing the engine): absent, the environment's.
    e.add_argument("--api-key", default=None,
                   help="key for /generate and the info routes (Authorization: Bearer; env ROLLWAY_ENGINE_API_KEY)")
    e.add_argument("--admin-api-key", default=None, help="key for the admin routes: pause, abort, weights, "
                   "adapters (env ROLLWAY_ENGINE_ADMIN_API_KEY)")
    _lora_engine_flags(e)
    e.set_defaults(fn=_engine)

    m = sub.add_parser("init-model", formatter_class=HelpFormatter,
                       help="create a small random model: the tiny demo one, or a real architecture on your tokenizer",
                       description="Write a small random HF model folder; no download.\n\n"
                       "Without --arch: the tiny demo model, a Qwen2-style model with a locally trained tokenizer "
                       "and a tool-capable ChatML template.\n"
                       "With --arch qwen3|qwen2|llama --tokenizer DIR: that architecture's own config (transformers' "
                       "Qwen3Config, Qwen2Config, LlamaConfig) at a small size, on the tokenizer in DIR, a local "
                       "folder (a model downloaded from the hub works; only its tokenizer files are read): the "
                       "vocabulary size, bos/eos/pad ids and stop tokens come from it (the stop tokens from its "
                       "generation_config.json when it has one), and its tokenizer files and chat template are "
                       "copied in. The model's replies are noise until trained; it is there to run the whole loop "
                       "(gateway, engine, trainer) on a real vocabulary and template.\n\n"
                       "Weights are deterministic for a seed.",
                       epilog="example: rollway init-model --out models/qwen3-tiny --arch qwen3 --tokenizer "
                       "~/models/Qwen3-0.6B")
    m.add_argument("--out", required=True, metavar="DIR", help="folder to write the model into")
    m.add_argument("--arch", default=None, choices=["qwen3", "qwen2", "llama"],
                   help="a real architecture on the tokenizer of --tokenizer (default: the tiny demo model)")
    m.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --arch: local folder with tokenizer.json (or tokenizer.model) and the chat template")
    m.add_argument("--seed", type=int, default=0, help="weights (and the demo model's tokenizer) are deterministic "
                   "for a seed")
    m.add_argument("--size", default="tiny", choices=["tiny", "small", "100m"],
                   help="without --arch: tiny (the demo's) or 100m (~100M parameters); with --arch: tiny (hidden "
                   "64, 2 layers) or small (hidden 256, 4 layers)")
    m.set_defaults(fn=_init_model)

    r = sub.add_parser("rollout", formatter_class=HelpFormatter, help="run an agent over a task file, n samples per task",
                       description="Replicate each task into a group of sessions, run the agent on each, post "
                       "rewards. Admin key from ROLLWAY_ADMIN_KEY.")
    from rollway.rollout import add_arguments as rollout_args

    rollout_args(r)
    r.set_defaults(fn=_rollout)

    t = sub.add_parser("train", help="the RL/SFT trainer (launches torchrun)", add_help=False)
    t.add_argument("args", nargs=argparse.REMAINDER, help="trainer options (rollway train --help)")
    t.set_defaults(fn=_train)

    from rollway.demo import EVAL_TASKS, SFT_MAX_SECONDS, SFT_STEPS  # torch-free, as the rollout import

    d = sub.add_parser("demo", formatter_class=HelpFormatter, help="the whole loop on this CPU machine",
                       description="Create the tiny model, warm it up with SFT, serve it, and train it with RL on "
                       "two-digit addition; prints a summary table, a plot and a JSON line.")
    d.add_argument("--out", default="rollway-demo", help="folder for the model, database, logs and plot")
    d.add_argument("--seed", type=int, default=0, help="seed of the model, the SFT data order and the trainer")
    d.add_argument("--minutes", type=float, default=6.0,
                   help="time budget for the RL phase, from its start (the warm-up and the evals come on top: the "
                   "whole demo takes about 10 minutes on 2 cores); a run that trains no RL step exits with 1")
    d.add_argument("--steps", type=int, default=0, help="stop after this many trainer steps (0 = time budget)")
    d.add_argument("--nproc", type=int, default=1, help="trainer processes (CPU ranks)")
    d.add_argument("--lora-rank", type=int, default=0,
                   help="RL-train a LoRA adapter of this rank (published as adapters, pinned sessions) instead of "
                        "the full weights")
    d.add_argument("--sft-steps", type=int, default=SFT_STEPS,
                   help=f"SFT warm-up steps (a fixed number, so that the warm-up ends alike on any CPU; a slow "
                   f"machine stops sooner, at {SFT_MAX_SECONDS:.0f} s, and says so)")
    d.add_argument("--eval-tasks", type=int, default=EVAL_TASKS, help="held-out tasks evaluated before and after RL")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("db", formatter_class=HelpFormatter, help="database migrations", description="Alembic migrations of the store.")
    b.add_argument("action", choices=["upgrade", "current"])
    b.add_argument("--db", default=os.environ.get("ROLLWAY_DB", ""), metavar="URL",
                   help="sqlite:///FILE or postgresql://... (env ROLLWAY_DB; empty: SQLite in the data dir)")
    b.add_argument("--data-dir", default=os.environ.get("ROLLWAY_DATA_DIR", "rollway-data"),
                   help="data folder of the embedded SQLite file (env ROLLWAY_DATA_DIR)")
    b.set_defaults(fn=_db)

    from rollway.view import add_parser as view_parser  # torch-free, like the rollout import above

    view_parser(sub, HelpFormatter)
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


# Commands that write the store, the admin key and logs: the store holds session ids, and a session id alone
# opens the keyless /sessions/{id}/v1/... URLs, so what they create is for this user only (0700 / 0600).
PRIVATE_COMMANDS = ("serve", "demo", "db")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in PRIVATE_COMMANDS:
        os.umask(0o077)
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
