"""`rollway demo` stopped with SIGTERM during its SFT warm-up leaves no process behind (torchrun and its
worker included) and exits with 128 + SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _procs_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


@pytest.mark.slow
def test_sigterm_during_sft_stops_every_child(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "demo", "--out", str(out)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while not (out / "sft" / "metrics.jsonl").is_file():  # the SFT worker is training
            assert proc.poll() is None, "the demo ended before its SFT started"
            assert time.time() < deadline, "SFT did not start"
            time.sleep(0.5)
        assert any("trainer.train" in p for p in _procs_mentioning(str(out)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        time.sleep(1)
        assert _procs_mentioning(str(out)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
