"""Gateway fixtures: a scripted fake SGLang and a live gateway in front of it, per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeSGLang]:
    with FakeSGLang(vocab=range(100, 1000)) as f:
        yield f


@pytest.fixture(scope="module")
def gateway(fake: FakeSGLang, tiny_model_dir: Path, db_url: str) -> Iterator[LiveGateway]:
    with LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=db_url) as gw:
        yield gw


def ids_of(tokenizer: Any, text: str, *, end: bool = True) -> list[int]:
    """What a model emits for `text`: its ids, then the end-of-turn token."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")] if end else ids
