"""LoRA on the CPU engine: SGLang's load/unload contract and errors, per-row adapters in one batch, and logprobs
equal to a PEFT-merged model's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.lora import LoRAOptions
from engine.server import create_app
from tests.engine.test_generate import reference_logprobs

PROMPTS = ["37+48=", "The weather in the city is", "def add(a, b):\n    return"]


def _adapter(base_dir: Path, out: Path, seed: int, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"),
             ) -> tuple[Path, PreTrainedModel]:
    """A random (non-zero B) PEFT adapter on the tiny model, and the model with it merged in."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    peft = get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT's random B is small: scale it so the adapter moves the logits visibly
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    peft.save_pretrained(out)
    merged = peft.merge_and_unload().eval()
    return out, merged


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PreTrainedModel]]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": _adapter(tiny_model_dir, root / "a", 1),
        "b": _adapter(tiny_model_dir, root / "b", 2, rank=8, targets=("q_proj", "v_proj", "o_proj")),
        "c": _adapter(tiny_model_dir, root / "c", 3),
        "big": _adapter(tiny_model_dir, root / "big", 4, rank=16),
    }


@pytest.fixture(scope="module")
def lora_app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    options = LoRAOptions(enable_lora=True, lora_target_modules=["q_proj", "v_proj", "o_proj"], max_lora_rank=8,
                          max_loaded_loras=2)
    app = create_app(tiny_model_dir, max_batch_size=8, lora=options)
    yield app
    app.state.engine.scheduler.stop()


@pytest.fixture
async def client(lora_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=lora_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok.encode(p) for p in PROMPTS]


async def _gen(client: httpx.AsyncClient, ids: list[int], lora: str | None, n: int = 12) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _lps(out: dict[str, Any]) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


async def _reset(client: httpx.AsyncClient) -> None:
    """Unload whatever an earlier test left loaded (the failed load's answer lists them, as SGLang's does)."""
    r = await client.post("/load_lora_adapter", json={"lora_name": "probe", "lora_path": "/no/such/folder"})
    assert r.status_code == 400
    for name in r.json()["loaded_adapters"] or {}:
        assert (await client.post("/unload_lora_adapter", json={"lora_name": name})).status_code == 200


async def test_load_unload_contract(client: httpx.AsyncClient, adapters: dict[str, Any]) -> None:
    await _reset(client)
    r = await client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"][0])})
    assert r.status_code == 200 and r.json() == {
        "success": True, "error_message": "", "loaded_adapters": {"a": str(adapters["a"][0])}}
    again = await client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"][0])})
    assert again.status_code == 400 and again.json()["success"] is False
    assert "already loaded" in again.json()["error_message"]
    big = await client.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["big"][0])})
    assert big.status_code == 400 and "--max-lora-rank" in big.json()["error_message"]
    missing = await client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
    assert missing.status_code == 400 and missing.json()["success"] is False
    unknown = await client.post("/generate", json={"input_ids": [5, 6], "lora_path": "nope"})
    assert unknown.status_code == 400
    assert "Got LoRA adapter that has never been loaded: nope" in unknown.json()["error"]["message"]  # SGLang 0.5.23
    gone = await client.post("/unload_lora_adapter", json={"lora_name": "nope"})
    assert gone.status_code == 400 and "does not exist" in gone.json()["error_message"]
    done = await client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert done.status_code == 200 and done.json()["loaded_adapters"] == {}
    # SGLang 0.5.23 (`TokenizerManager._resolve_lora_path`) loads a name it loaded before again, silently.
    after = await client.post("/generate", json={"input_ids": [5, 6], "lora_path": "a",
                                                 "sampling_params": {"max_new_tokens": 1}})
    assert after.status_code == 200, after.text
    reloaded = await client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert reloaded.status_code == 200


async def test_cap_unloads_least_recently_used(client: httpx.AsyncClient, adapters: dict[str, Any],
                                               prompt_ids: list[list[int]]) -> None:
    await _reset(client)
    for name in ("a", "b"):
        assert (await client.post("/load_lora_adapter",
                                  json={"lora_name": name, "lora_path": str(adapters[name][0])})).status_code == 200
    await _gen(client, prompt_ids[0], "a", n=1)  # a is now more recently used than b
    r = await client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"][0])})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "c"}


async def test_batch_of_adapters_matches_each_alone_and_peft_merged(
    client: httpx.AsyncClient, adapters: dict[str, Any], prompt_ids: list[list[int]], tiny_model_dir: Path,
    lora_app: FastAPI,
) -> None:
    await _reset(client)
    for name in ("a", "b"):
        await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[name][0])})
    jobs = [(p, lora) for p in prompt_ids for lora in ("a", "b", None)]
    alone = [await _gen(client, p, lora) for p, lora in jobs]
    stats = lora_app.state.engine.scheduler.stats
    steps, rows = stats.decode_steps, stats.decode_rows
    together = await asyncio.gather(*(_gen(client, p, lora) for p, lora in jobs))
    assert (stats.decode_rows - rows) / (stats.decode_steps - steps) > 3  # rows of several adapters decoded together
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for (p, lora), one, batched in zip(jobs, alone, together, strict=True):
        assert batched["output_ids"] == one["output_ids"], (lora, p)
        assert _lps(batched) == pytest.approx(_lps(one), abs=1e-4)
        reference = base if lora is None else adapters[lora][1]
        assert _lps(one) == pytest.approx(reference_logprobs(reference, p, one["output_ids"], 1.0), abs=1e-4)
    # the adapters really change the model: a's and b's outputs differ from the base model's somewhere
    by_lora = {lora: [o["output_ids"] for (_, x), o in zip(jobs, alone, strict=True) if x == lora]
               for lora in ("a", "b", None)}
    assert by_lora["a"] != by_lora[None] and by_lora["b"] != by_lora[None]
