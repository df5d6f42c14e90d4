"""Engine fixtures: one engine app per module (in-process over ASGI, or uvicorn on a free loopback port).

Run with `pytest tests/engine -q`; torch is held to one thread so the suite shares a small machine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from engine.server import create_app

torch.set_num_threads(1)


def perturbed(tiny_model_dir: Path, out: Path, seed: int, *, tokenizer: bool = False) -> Path:
    """The tiny model with its weights moved by seeded noise (what a trainer might publish), saved at `out`."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    model.save_pretrained(out)
    if tokenizer:
        for f in tiny_model_dir.glob("tokenizer*"):
            shutil.copy(f, out)
    return out


@pytest.fixture(scope="module")
def engine_app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    app = create_app(tiny_model_dir, max_batch_size=8)
    yield app
    app.state.engine.scheduler.stop()


@pytest.fixture
async def client(engine_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """In-process client; the model thread starts on the first request and stops with the module."""
    transport = httpx.ASGITransport(app=engine_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as c:
        yield c


class LiveServer:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def live_engine(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(create_app(tiny_model_dir, max_batch_size=8)) as server:
        yield server
