"""The virtual environment SGLang's own code runs in for the conformance suite: the `sglang` wheel of
`SGLANG_VERSION` installed **without dependencies** (no CUDA stack), plus `msgspec` (what its request types
import), on top of this environment's packages (`--system-site-packages`: the CPU torch its sampling parameters
import). Cached at ~/.cache/rollway/sglang-venv-<version> (ROLLWAY_SGLANG_VENV overrides); built once, from the
wheel file named by ROLLWAY_SGLANG_WHEEL if set, else from the package index. No network once it exists.

    python -m tests.sglang_conformance.sglang_venv      # build (or check) it; prints its python
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SGLANG_VERSION = "0.5.23"
"""The one pin: the SGLang release the gateway, the engine and the fakes conform to (docker-compose.yml's default
image tag must name the same)."""


def venv_dir() -> Path:
    env = os.environ.get("ROLLWAY_SGLANG_VENV")
    return Path(env) if env else Path.home() / ".cache" / "rollway" / f"sglang-venv-{SGLANG_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def installed_version(python: Path) -> str | None:
    if not python.exists():
        return None
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_venv() -> Path:
    """The venv's python, built first if missing or holding another version."""
    python = venv_python()
    if installed_version(python) == SGLANG_VERSION:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv_dir())], check=True)
    wheel = os.environ.get("ROLLWAY_SGLANG_WHEEL") or f"sglang=={SGLANG_VERSION}"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", wheel], check=True)
    subprocess.run([*pip, "msgspec"], check=True)
    got = installed_version(python)
    if got != SGLANG_VERSION:
        raise RuntimeError(f"{venv_dir()} holds sglang {got}, not {SGLANG_VERSION}")
    return python


if __name__ == "__main__":
    print(ensure_venv())
