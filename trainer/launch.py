"""`rollway train`: check the config, write it to `out/config.json`, and run torchrun on `trainer.train`.

    from trainer.launch import main
    main(["--gateway", URL, "--model", DIR, "--out", DIR, "--nproc", "2", "--config", FILE, "--lr", "1e-5"])

Every option of `trainer.config.TrainConfig` can be given as `--name value` (dashes or underscores) and
overrides the file. A wrong option fails here, before any process starts. The admin key travels in the
environment (`ROLLWAY_ADMIN_KEY`), never in the written config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from rollway_common.procs import die_with_parent
from trainer.client import GatewayClient
from trainer.config import TrainConfig, load_config, parse_overrides
from trainer.tracking import check_installed


def torchrun_command(config_path: str | Path, nproc: int) -> list[str]:
    """The exact command: `python -m trainer.torchrun --standalone --nproc-per-node N -m trainer.train
    --config FILE` (torchrun, `torch.distributed.run`, without a traceback when stopped: trainer/torchrun.py;
    `--standalone`: a free local rendezvous port, one node)."""
    return [
        sys.executable, "-m", "trainer.torchrun", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "trainer.train", "--config", str(config_path),
    ]  # fmt: skip


def prepare(argv: list[str]) -> tuple[TrainConfig, int, list[str], dict[str, str]]:
    """Parse and validate; returns (config, nproc, torchrun command, environment). Writes out/config.json."""
    args = list(argv)
    nproc, config_file = 1, None
    for flag in ("--nproc", "--config"):
        for i, a in enumerate(args):
            if a == flag or a.startswith(flag + "="):
                value = a.split("=", 1)[1] if "=" in a else args[i + 1]
                del args[i : i + (1 if "=" in a else 2)]
                if flag == "--nproc":
                    nproc = int(value)
                else:
                    config_file = value
                break
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    cfg = load_config(config_file, parse_overrides(args), os.environ)
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg.out = str(out)
    for name in ("model", "sft_data"):  # the workers may run from another directory
        if getattr(cfg, name):
            setattr(cfg, name, str(Path(getattr(cfg, name)).resolve()))
    config_path = out / "config.json"
    config_path.write_text(cfg.to_json())
    env = dict(os.environ)
    if cfg.admin_key:
        env["ROLLWAY_ADMIN_KEY"] = cfg.admin_key
    return cfg, nproc, torchrun_command(config_path, nproc), env


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rollway train`; returns torchrun's exit code (2 for a bad config or gateway)."""
    try:
        cfg, nproc, cmd, env = prepare(sys.argv[1:] if argv is None else argv)
        check_installed(cfg)  # a tracker asked for but not installed: say so here, not in rank 0 alone
        if cfg.gateway:  # fail here, with the URL in the message, rather than in N workers
            with GatewayClient(cfg.gateway, cfg.resolved_admin_key(), timeout=10.0) as client:
                client.current_weights()
    except (ValueError, OSError, RuntimeError) as e:
        print(f"rollway train: {e}", file=sys.stderr)
        return 2
    print(f"rollway train: {nproc} process(es); config in {cfg.out}/config.json", file=sys.stderr)
    # torchrun gets SIGTERM when this process dies, however it dies (a SIGKILL runs none of the handling
    # below): it then stops its workers, which would otherwise keep leasing groups as orphans.
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent(signal.SIGTERM))
    return wait_stopping_on_signals(proc)


def wait_stopping_on_signals(proc: subprocess.Popen[bytes], grace_s: float = 45.0) -> int:
    """Wait for torchrun; on SIGTERM or SIGINT stop it first (SIGTERM: it forwards it to its workers, gives
    them 30 s and kills them; we SIGKILL torchrun after `grace_s`, longer, so that it can), then let the signal do what it did before: the default action of
    SIGTERM ends this process by it, SIGINT raises KeyboardInterrupt, a caller's handler (`rollway demo`'s)
    runs. Without a handler here, a SIGTERM ended this process at once and left torchrun and its workers
    running, re-parented to PID 1. Handlers can only be set from the main thread; elsewhere this just waits."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not received:
            received.append(signum)
            if proc.poll() is None:
                proc.terminate()

    handled = (signal.SIGTERM, signal.SIGINT)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in handled} if main_thread else {}
    try:
        deadline: float | None = None
        while True:
            try:
                return_code = proc.wait(timeout=0.5)  # short waits: a signal sets `received` meanwhile
                break
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                return_code = proc.wait()
                break
    except BaseException:  # an exception from elsewhere (a caller's timer, say): never leave torchrun behind
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be restored from here
                signal.signal(s, handler)
    if received:
        signal.raise_signal(received[0])
    return return_code


if __name__ == "__main__":
    raise SystemExit(main())
