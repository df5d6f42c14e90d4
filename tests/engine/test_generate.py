"""/generate against the same model run directly: logprobs, greedy output, seeds, batching, stops, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

PROMPTS = [
    "37+48=",
    "The weather in the city is",
    '<tool_call>\n{"name": "search", "arguments": {"query": "',
    "def add(a, b):\n    return",
    "What is 12 + 7? The answer is",
    "x",
]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok.encode(p) for p in PROMPTS]


async def generate(client: httpx.AsyncClient, ids: list[int], **params: Any) -> dict[str, Any]:
    extra = params.pop("extra", {})
    r = await client.post("/generate", json={"input_ids": ids, "sampling_params": params, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def reference_logprobs(model: PreTrainedModel, prompt: list[int], output: list[int], t: float) -> list[float]:
    """log_softmax(logits / T) of each output token from one full forward pass over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]  # (P + O, V)
    scaled = torch.log_softmax(logits[len(prompt) - 1 : -1] / t, dim=-1)  # (O, V): rows predicting outputs
    return scaled.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_match_a_full_forward_pass(
    client: httpx.AsyncClient, hf_model: PreTrainedModel, prompt_ids: list[list[int]], temperature: float
) -> None:
    prompt = prompt_ids[1]
    out = await generate(
        client,
        prompt,
        temperature=temperature,
        max_new_tokens=24,
        ignore_eos=True,
        extra={"return_logprob": True},
    )
    meta = out["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 24
    engine = [e[0] for e in meta["output_token_logprobs"]]
    expected = reference_logprobs(hf_model, prompt, out["output_ids"], temperature or 1.0)
    assert max(abs(a - b) for a, b in zip(engine, expected, strict=True)) <= 1e-4
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(prompt) and meta["weight_version"] == "default"


async def test_greedy_equals_hf_generate(
    client: httpx.AsyncClient, hf_model: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    for prompt in prompt_ids[:3]:
        out = await generate(client, prompt, temperature=0, max_new_tokens=20)
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        assert out["output_ids"] == hf[0, len(prompt) :].tolist()


async def test_sampling_seed_repeats(client: httpx.AsyncClient, prompt_ids: list[list[int]]) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234}
    first = await generate(client, prompt_ids[0], **params)
    second = await generate(client, prompt_ids[0], **params)
    other = await generate(client, prompt_ids[0], **{**params, "sampling_seed": 99})
    assert first["output_ids"] == second["output_ids"]
    assert first["output_ids"] != other["output_ids"]


async def test_batched_greedy_equals_unbatched(
    client: httpx.AsyncClient, prompt_ids: list[list[int]]
) -> None:
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    alone = [(await generate(client, p, **params))["output_ids"] for p in prompt_ids]

    async def staggered(i: int, prompt: list[int]) -> list[int]:
        await asyncio.sleep(0.01 * i)  # rows join a batch that is already decoding
        return (await generate(client, prompt, **{**params, "max_new_tokens": 12 + i}))["output_ids"][:12]

    together = await asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompt_ids)))
    assert list(together) == alone
    assert len({tuple(ids) for ids in alone}) > 1  # the prompts really lead to different outputs


async def test_list_of_prompts_and_n(client: httpx.AsyncClient, prompt_ids: list[list[int]]) -> None:
    r = await client.post(
        "/generate",
        json={
            "input_ids": prompt_ids[:2],
            "rid": ["a", "b"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        },
    )
    body = r.json()
    assert [b["meta_info"]["id"] for b in body] == ["a", "b"]
    r = await client.post(
        "/generate",
        json={"input_ids": prompt_ids[0], "rid": "c", "sampling_params": {"n": 3, "max_new_tokens": 4}},
    )
    assert [b["meta_info"]["id"] for b in r.json()] == ["c_0", "c_1", "c_2"]


async def test_stop_token_ids_and_stop_strings(
    client: httpx.AsyncClient, prompt_ids: list[list[int]]
) -> None:
    free = await generate(client, prompt_ids[3], temperature=0, max_new_tokens=8, ignore_eos=True)
    stop_id = free["output_ids"][2]
    first = free["output_ids"].index(stop_id)
    out = await generate(
        client,
        prompt_ids[3],
        temperature=0,
        max_new_tokens=8,
        stop_token_ids=[stop_id],
        extra={"return_logprob": True},
    )
    assert out["output_ids"] == free["output_ids"][: first + 1]  # the stop token is kept in ids and logprobs
    assert len(out["meta_info"]["output_token_logprobs"]) == first + 1
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}

    text = free["text"]
    stop = text[len(text) // 2 :][:3]
    cut = await generate(client, prompt_ids[3], temperature=0, max_new_tokens=8, ignore_eos=True, stop=stop)
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and text.startswith(cut["text"])


async def test_input_logprobs(
    client: httpx.AsyncClient, hf_model: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    prompt = prompt_ids[1]
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    out = await generate(client, prompt, temperature=0, max_new_tokens=1, extra=extra)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    expected = reference_logprobs(hf_model, prompt[:1], prompt[1:], 1.0)
    assert max(abs(e[0] - x) for e, x in zip(entries[1:], expected, strict=True)) <= 1e-4
    assert len(out["meta_info"]["output_top_logprobs"][0]) == 2


async def test_bad_requests_are_400(client: httpx.AsyncClient, prompt_ids: list[list[int]]) -> None:
    r = await client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    for body in [
        {"input_ids": []},
        {"input_ids": [1], "sampling_params": {"temperature": -1}},
        {"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}},
        {"input_ids": [1] * 5000},
    ]:
        r = await client.post("/generate", json=body)
        assert r.status_code == 400 and "message" in r.json()["error"], body


async def stream_chunks(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    chunks: list[Any] = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return chunks


async def test_streaming_cumulative(client: httpx.AsyncClient, prompt_ids: list[list[int]]) -> None:
    body = {
        "input_ids": prompt_ids[0],
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
    }
    chunks = await stream_chunks(client, body)
    final = await generate(client, prompt_ids[0], **body["sampling_params"], extra={"return_logprob": True})
    assert chunks[-1] == "[DONE]" and len(chunks) >= 3
    events = chunks[:-1]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["output_ids"] == final["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and [e["meta_info"]["completion_tokens"] for e in events] == lengths
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 10


async def test_streaming_incremental(
    tiny_model_dir: Path, client: httpx.AsyncClient, prompt_ids: list[list[int]]
) -> None:
    from engine.server import create_app

    app = create_app(tiny_model_dir, incremental_streaming_output=True)
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    body = {"input_ids": prompt_ids[2], "return_logprob": True, "sampling_params": params}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as inc:
            chunks = (await stream_chunks(inc, body))[:-1]
    finally:
        app.state.engine.scheduler.stop()
    final = await generate(client, prompt_ids[2], **params, extra={"return_logprob": True})
    assert len(chunks) >= 3
    assert [t for c in chunks for t in c["output_ids"]] == final["output_ids"]
    assert "".join(c["text"] for c in chunks) == final["text"]
    logprobs = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert logprobs == final["meta_info"]["output_token_logprobs"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks][-1] == 10
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


async def test_generate_is_served_in_front_of_the_router(
    client: httpx.AsyncClient, engine_app: Any, prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`POST /generate` goes through `GenerateRoute` (not FastAPI's routing), which answers a bug in a step with a
    JSON 500 rather than a dropped connection; other methods and paths still reach the app."""
    import engine.server as server

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "parse_generate", boom)
    r = await client.post("/generate", json={"input_ids": prompt_ids[0]})
    assert r.status_code == 500 and "RuntimeError: a bug" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert (await client.get("/generate")).status_code == 405  # the app's router: a route with POST only
    out = await generate(client, prompt_ids[0], temperature=0, max_new_tokens=2)
    assert len(out["output_ids"]) == 2
