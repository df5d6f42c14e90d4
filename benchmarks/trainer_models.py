"""The models and rows the trainer benchmarks share (benchmarks/trainer.py, trainer_lora.py, publish.py): a
Qwen2 config per size, saved with fixed weights, and groups of two random rows of that size. A module of its
own so that trainer.py and trainer_lora.py, which use each other's parts, do not import each other."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer.batching import Row

SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, rows, min length, max length)
    "tiny": (64, 128, 2, 4, 2, 512, 16, 96, 160),
    "100m": (768, 2048, 12, 12, 4, 32000, 8, 96, 160),
}


def make_model(size: str, path: Path) -> int:
    h, inter, layers, heads, kv, vocab, *_ = SIZES[size]
    config = Qwen2Config(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_rows(size: str, seed: int = 0) -> list[list[Row]]:
    *_, vocab, n_rows, lo, hi = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(n_rows // 2):  # groups of two sequences
        rows = []
        for _ in range(2):
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            mask = [0] * 32 + [1] * (n - 32)
            adv = 1.0 if i % 2 else -1.0
            rows.append(Row(torch.randint(0, vocab, (n,), generator=g).tolist(), mask,
                            [-torch.log(torch.tensor(float(vocab))).item() * m for m in mask],
                            [adv * m for m in mask], [1.0] * n))  # fmt: skip
        groups.append(rows)
    return groups
