"""Long rows: activation memory per token with and without activation checkpointing (`trainer.py --memory`).

Each (length, variant) runs in a fresh process on the CPU, float32, no FSDP: a Qwen2 of 8 decoder layers (hidden
256, vocabulary 32,000, the fused head as the trainer runs it), one row of `length` tokens (the
first eighth prompt, the rest trained), a training step as the trainer runs it (`forward_logprobs` with entropy,
PPO loss, backward, AdamW step). The model, its gradients and the optimizer state are made by a short warm-up step
first, so the peak the long step adds (VmHWM after it minus VmRSS before it, VmHWM reset just before) is its
activation memory: what autograd keeps from the forward for the backward, plus the backward's transients (one
layer's recomputed activations and their gradients, the head's chunks, the allocator's slack). The first is also
counted exactly (`saved`: the distinct storages autograd saves, parameters left out), since the peak on a shared
CPU includes what glibc keeps. Variants:

- `causal`: the trainer's path for a long row (unpacked, causal attention, no mask), no checkpointing;
- `checkpointed`: the same with each decoder layer's activations recomputed in the backward
  (`activation_checkpointing`, trainer/recompute.py);
- `dense mask`: the same row under an explicit (L, L) boolean mask, the packed layout's attention
  (`trainer.batching.pack`), which the trainer no longer uses for rows over PACK_MAX_LEN: shown to say why.

From each variant's bytes per token, the longest row that fits a given memory (`--budget-gib`, beside the model
and optimizer state) is printed. Targets (issue: one GPU and long trajectories): checkpointing >= 3x less
activation memory for <= 1.4x the step time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

LONG_MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32_000, max_position_embeddings=65_536,
                  tie_word_embeddings=True)  # fmt: skip
VARIANTS = ("causal", "checkpointed", "dense mask")
DEVICE_ENV, DTYPE_ENV = "ROLLWAY_LONG_DEVICE", "ROLLWAY_LONG_DTYPE"
"""`--long-device cuda --long-dtype bfloat16` (benchmarks/trainer.py): the workers run there, and the activation
memory is the CUDA allocator's peak over the step minus what it held before (model, gradients, AdamW state)."""


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(variant: str, length: int) -> None:
    """One (variant, length) in this fresh process; prints one JSON line."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer import recompute
    from trainer.batching import Row, collate
    from trainer.fsdp import decoder_layers
    from trainer.loss import PolicyInputs, PPOParams, ppo_loss
    from trainer.step import forward_logprobs

    device = torch.device(os.environ.get(DEVICE_ENV, "cpu"))
    dtype = getattr(torch, os.environ.get(DTYPE_ENV, "float32"))
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**LONG_MODEL, attn_implementation="sdpa")).to(device, dtype).train()
    recompute.install(model, decoder_layers(model), "on" if variant == "checkpointed" else "off", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)

    def batch(n: int):  # one row: the first eighth prompt, the rest trained
        mask = [0] * (n // 8) + [1] * (n - n // 8)
        return collate([Row(torch.randint(0, LONG_MODEL["vocab_size"], (n,), generator=g).tolist(), mask,
                            [-2.0] * n, [1.0] * n, [1.0] * n)], device=device)  # fmt: skip

    def step(n: int) -> None:
        mb = batch(n)
        with recompute.active(model, mb.n_tokens):
            if variant == "dense mask":
                t = mb.input_ids.shape[1]
                mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None, None]
                mb.packed = None
                original = model.forward
                model.forward = lambda **kw: original(**kw, attention_mask=mask)  # type: ignore[method-assign]
                logp, _ = forward_logprobs(model, mb, with_entropy=True)
                model.forward = original  # type: ignore[method-assign]
            else:
                logp, _ = forward_logprobs(model, mb, with_entropy=True)
            inp = PolicyInputs(logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                               mb.token_weight, float(mb.loss_mask.sum()))  # fmt: skip
            loss, _ = ppo_loss(inp, PPOParams())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    step(64)  # gradients and AdamW state exist from here on
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device) // 1024
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _vm_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(length)
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if cuda:  # wall time is the step's time on a GPU (the CPU only launches kernels)
        cpu = seconds
        peak = torch.cuda.max_memory_allocated(device) - base * 1024
    else:
        peak = (_vm_kib("VmHWM") - base) * 1024
    print(json.dumps({"variant": variant, "tokens": length, "activation_bytes": peak,
                      "bytes_per_token": peak / length, "saved_bytes": sum(saved.values()),
                      "saved_per_token": sum(saved.values()) / length, "state_bytes": base * 1024, "step_s": seconds,
                      "step_cpu_s": cpu}))  # fmt: skip


def bench(lengths: list[int], max_gib: float, dense_max: int) -> list[dict]:
    results: list[dict] = []
    for length in sorted(lengths):
        for variant in VARIANTS:
            if variant == "dense mask" and length > dense_max:
                continue
            cmd = [sys.executable, str(Path(__file__).with_name("trainer.py")), "--long-worker", variant, str(length)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                results.append({"variant": variant, "tokens": length, "failed": done.stderr.strip()[-300:]})
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def report(results: list[dict], budget_gib: float) -> None:
    device, dtype = os.environ.get(DEVICE_ENV, "cpu"), os.environ.get(DTYPE_ENV, "float32")
    where = f"cpu ({torch.get_num_threads()} threads)" if device == "cpu" else device
    print(f"\nlong rows on {where}: Qwen2 {LONG_MODEL['num_hidden_layers']} layers, "
          f"hidden {LONG_MODEL['hidden_size']}, vocab {LONG_MODEL['vocab_size']:,}, {dtype}, fused head; one row a "
          "step; activation = the step's peak minus model, gradients and AdamW state")  # fmt: skip
    head = (f"{'tokens':>7} {'variant':>13} {'activation MiB':>15} {'KiB/token':>10} {'saved KiB/token':>16} "
            f"{'step s':>7} {'cpu s':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        if "failed" in r:
            print(f"{r['tokens']:>7} {r['variant']:>13}  failed: {r['failed'][-120:]}")
            continue
        print(f"{r['tokens']:>7} {r['variant']:>13} {r['activation_bytes'] / 2**20:>15.0f} "
              f"{r['bytes_per_token'] / 1024:>10.1f} {r['saved_per_token'] / 1024:>16.1f} {r['step_s']:>7.1f} "
              f"{r['step_cpu_s']:>7.1f}")  # fmt: skip
    ratios = {}
    for length in sorted({r["tokens"] for r in results}):
        by = {r["variant"]: r for r in results if r["tokens"] == length and "failed" not in r}
        if "causal" in by and "checkpointed" in by:
            ratios[length] = {
                "memory_saving": by["causal"]["activation_bytes"] / max(by["checkpointed"]["activation_bytes"], 1),
                "saved_saving": by["causal"]["saved_bytes"] / max(by["checkpointed"]["saved_bytes"], 1),
                "time_cost": by["checkpointed"]["step_cpu_s"] / by["causal"]["step_cpu_s"],
            }
            print(f"{length:>7}: checkpointing keeps 1/{ratios[length]['memory_saving']:.1f} of the peak activation "
                  f"memory (1/{ratios[length]['saved_saving']:.1f} of the saved tensors) for "
                  f"{ratios[length]['time_cost']:.2f}x the step's CPU time")  # fmt: skip
    longest = {}
    for variant in ("causal", "checkpointed"):
        per_token = [r["bytes_per_token"] for r in results if r["variant"] == variant and "failed" not in r]
        if per_token:
            longest[variant] = int(budget_gib * 2**30 / max(per_token))
            print(f"longest row in {budget_gib:g} GiB of activations, {variant}: ~{longest[variant]:,} tokens "
                  "(linear in length at the largest measured bytes per token)")  # fmt: skip
    print("targets: checkpointing >= 3x less activation memory for <= 1.4x the step time")
    print(json.dumps({"benchmark": "trainer_long_memory", "device": device, "dtype": dtype,
                      "threads": torch.get_num_threads(),
                      "model": LONG_MODEL, "results": results, "ratios": ratios, "budget_gib": budget_gib,
                      "longest_row": longest}))  # fmt: skip
