"""Fakes for the trainer tests: a tiny Qwen2 model folder (hidden 64, 2 layers, vocab 512, byte-level
tokenizer with a ChatML template) and a fake gateway (plain http.server in a thread) serving pre-built
groups in the wire format of `rollway_common.wire`."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rollway_common.wire import encode_array

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_model(path: Path, seed: int = 0, tie: bool = True) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=tie,
        bos_token_id=256, eos_token_id=258, pad_token_id=256,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=dict(sorted(vocab.items(), key=lambda kv: kv[1])), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # ids 256, 257, 258
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    fast.save_pretrained(path)
    return path


def make_group(
    group_id: str,
    rewards: list[float],
    rng: random.Random,
    samples_per_session: int = 1,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """A leased group in the wire form: one session per reward, each with prompt + completion tokens."""
    sessions, samples = [], []
    for k, reward in enumerate(rewards):
        sid = f"{group_id}-s{k}"
        sessions.append({"session_id": sid, "reward": reward, "state": "finished"})
        for _ in range(samples_per_session):
            n_prompt, n_completion = rng.randint(3, 8), rng.randint(2, 10)
            n = n_prompt + n_completion
            mask = [0] * n_prompt + [1] * n_completion
            samples.append({
                "group_id": group_id, "session_id": sid, "reward": reward, "temperature": temperature,
                "token_ids": encode_array([rng.randrange(0, 256) for _ in range(n)], "int32"),
                "loss_mask": encode_array(mask, "uint8"),
                "logprobs": encode_array([-rng.uniform(5.0, 7.0) * m for m in mask], "float32"),
                "versions": encode_array([0 if m else -1 for m in mask], "int32"),
                "returns": encode_array([reward * m for m in mask], "float32"),
            })  # fmt: skip
    return {"group_id": group_id, "task": {"q": group_id}, "sessions": sessions, "samples": samples}


class FakeGateway:
    """Serves `groups` (wire dicts) a lease at a time and records every trainer call.

    Semantics the trainer relies on: a lease hands out up to max_groups queued groups (204 when none);
    `ack` closes the named groups of a batch; `POST /v1/weights` bumps the version (409 unless greater)
    and closes the named groups of `batch_id` (none when it is null).
    """

    def __init__(self, groups: list[dict[str, Any]], version: int = 0, model_path: str | None = None) -> None:
        self.queue = list(groups)
        self.version = version
        self.model_path = model_path
        self.calls: list[tuple[str, str, Any]] = []
        self.batches: dict[str, list[str]] = {}
        self.results: dict[str, str] = {}
        self.lease_delays: list[float] = []
        """Seconds the N-th lease call waits before answering (outside the lock, so renewals go on)."""
        self.lock = threading.Lock()
        gw = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with gw.lock:
                    gw.calls.append(("GET", self.path, None))
                    if self.path == "/v1/weights":
                        return self._send(200, {"version": gw.version, "model_path": gw.model_path})
                self._send(404, {"error": {"message": "no such path", "type": "not_found_error"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/v1/batches":
                    with gw.lock:
                        n = sum(1 for c in gw.calls if c[1] == "/v1/batches")
                    if n < len(gw.lease_delays):
                        time.sleep(gw.lease_delays[n])
                with gw.lock:
                    gw.calls.append(("POST", self.path, body))
                    status, reply = gw.handle(self.path, body)
                self._send(status, reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/v1/batches":
            if not self.queue:
                return 204, None
            take, self.queue = self.queue[: body["max_groups"]], self.queue[body["max_groups"] :]
            batch_id = f"b{len(self.batches)}"
            self.batches[batch_id] = [g["group_id"] for g in take]
            return 200, {"batch_id": batch_id, "expires_at": 0, "groups": take, "dropped_stale": 0}
        if path.endswith("/renew"):
            return 200, {"ok": True}
        if path.endswith("/ack"):
            self.results.update(body["results"])
            return 200, {"ok": True}
        if path == "/v1/weights":
            if body["version"] <= self.version:
                return 409, {"error": {"message": "old version", "type": "conflict_error", "code": None}}
            self.version, self.model_path = body["version"], body["model_path"]
            self.results.update(body["results"])
            return 200, {"version": self.version}
        return 404, {"error": {"message": f"no {path}", "type": "not_found_error"}}

    def calls_to(self, prefix: str) -> list[Any]:
        return [b for m, p, b in self.calls if m == "POST" and p.startswith(prefix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
