"""A copy of this checkout with the chat call's hot modules compiled by Cython, unchanged (no type declarations):
what compiling the per-call Python work as it stands would take off the gateway's CPU, measured against this
checkout with `gateway_inproc.py` or `gateway.py`:

    pip install cython
    python benchmarks/compiled_copy.py /tmp/rollway-compiled
    python benchmarks/gateway_inproc.py --callgrind --db sqlite postgres --code source=. \\
        --code compiled=/tmp/rollway-compiled

A module Cython cannot compile as it is stays Python (listed as such). The copy is of the committed tree
(`git archive HEAD`); it needs a C compiler and Python's headers. Nothing of the project imports it: this is a
measurement, not a build of rollway.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HOT = [
    "gateway/auth.py", "gateway/byte_level.py", "gateway/continuity.py", "gateway/disconnect.py",
    "gateway/encoding.py", "gateway/generation.py", "gateway/hf_messages.py", "gateway/http1.py",
    "gateway/loop_batch.py", "gateway/metrics.py", "gateway/pool.py", "gateway/routes/body_prefix.py",
    "gateway/routes/common.py", "gateway/routes/dispatch.py", "gateway/routes/message_reuse.py",
    "gateway/routes/openai_api.py", "gateway/routes/replies.py", "gateway/server_protocol.py",
    "gateway/sessions_cache.py", "gateway/sglang.py", "gateway/sglang_wire.py", "gateway/store/direct.py",
    "gateway/store/requests.py", "gateway/store/store.py", "gateway/template_env.py",
    "gateway/template_segments.py", "gateway/templating.py", "gateway/tool_parsers.py", "gateway/turns.py",
    "rollway_common/wire.py",
]
"""What a recorded chat completion runs through (py-spy of `gateway_inproc.py`), pydantic's models left out."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="where the copy goes (must not exist)")
    parser.add_argument("--jobs", type=int, default=2, help="modules compiled at once")
    args = parser.parse_args()
    try:
        import Cython
    except ImportError:
        sys.exit("needs Cython: pip install cython")
    if args.dest.exists():
        sys.exit(f"{args.dest} exists; give a new path")
    tar = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
    args.dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(args.dest, filter="data")
    started = time.monotonic()
    compiled, left = [], []
    running: list[tuple[str, subprocess.Popen[bytes]]] = []
    todo = list(HOT)
    while todo or running:
        while todo and len(running) < args.jobs:
            module = todo.pop(0)
            proc = subprocess.Popen([sys.executable, "-m", "Cython.Build.Cythonize", "-3", "-i", "-q", module],
                                    cwd=args.dest, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            running.append((module, proc))
        module, proc = running.pop(0)
        out = proc.communicate()[0].decode(errors="replace")
        if proc.returncode == 0:
            compiled.append(module)
        else:
            # Cython's reason: "path:line:col: message" (its warnings start with "warning: ")
            line = next((ln.strip() for ln in out.splitlines() if ln.startswith(f"{module}:")), "")
            left.append((module, line[:100]))
        print(f"  [{len(compiled) + len(left)}/{len(HOT)}] {module}: "
              f"{'compiled' if proc.returncode == 0 else 'stays Python'}", file=sys.stderr, flush=True)
    print(f"\n{'module':<40}result   (Cython {Cython.__version__}, {time.monotonic() - started:.0f} s)")
    for m in compiled:
        print(f"{m:<40}compiled")
    for m, why in left:
        print(f"{m:<40}stays Python ({why})")
    print(json.dumps({"benchmark": "compiled_copy", "dest": str(args.dest), "cython": Cython.__version__,
                      "compiled": compiled, "python": [m for m, _ in left]}))


if __name__ == "__main__":
    main()
