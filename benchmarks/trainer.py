"""Trainer benchmark: the real FSDP2 step against a plain PyTorch loop, and weight-publish time.

    python benchmarks/trainer.py                  # tiny and ~100M-parameter Qwen2 configs
    python benchmarks/trainer.py --sizes tiny --reps 5

1. Training tokens/s: `trainer.step.rl_step` on the FSDP2-wrapped model (world size 1; gloo on CPU,
   NCCL + bf16 on GPU) against a plain single-process loop on an unwrapped copy of the same model doing the
   same passes over the same micro-batches: forward + PPO loss + backward per micro-batch, gradient clipping
   and one AdamW step. With one optimizer step per batch neither does a separate no-grad proximal forward: the
   proximal logprobs are the forward's own, detached (the weights have not moved yet). Target: FSDP >= 85%
   of plain.
2. Publish: `trainer.checkpoint.export_hf` (gather the full state dict, write safetensors + config +
   tokenizer files, fsync, atomic rename) against `save_file` + `load_file` of the same tensors.
   Target: <= 1.5x.

Prints a table, then one JSON line with every figure.

    python benchmarks/trainer.py --memory         # 3. and 4. instead: memory per token
    python benchmarks/trainer.py --memory --memory-part long --long-lengths 8192,16384,32768

3. Memory: the peak memory one training pass of a micro-batch adds (forward with entropy, PPO loss,
   backward), per micro-batch token, at vocabulary 151,936 (Qwen2's) and the trainer's default
   `micro_batch_tokens`, for the three ways of getting logprobs: `full` (the model's (B, T, V) logits, then a
   whole-vocabulary float32 log-softmax: the trainer before chunking), `chunked` (the model's logits, then
   `token_logprobs` a chunk of tokens at a time) and `fused` (`forward_logprobs`: the lm_head applied a chunk
   at a time too; what the trainer does now). Each (way, size) runs in a fresh process on the CPU, float32,
   no FSDP, with a small Qwen2 (hidden 256, 2 layers) so that the vocabulary dominates: peak = the process's
   VmHWM after the pass minus its VmRSS before it, VmHWM reset just before (torch's CPU allocations are
   invisible to tracemalloc); the model and a small warm-up pass come first. A size whose peak, extrapolated from the same way's largest run, would pass
   `--max-gib` is not run and is shown extrapolated (the peak is linear in tokens).

4. Long rows (benchmarks/trainer_memory.py): activation memory per token of one row of 8k, 16k and 32k tokens
   on a 4-layer model, with and without activation checkpointing (and under a dense (L, L) mask, for contrast),
   the step time checkpointing costs, and the longest row that fits `--budget-gib` of activations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks import trainer_memory
from benchmarks.trainer_models import SIZES, make_model, make_rows
from trainer.batching import MicroBatch, Row, collate, micro_batches, plan_step
from trainer.checkpoint import export_hf, full_state_dict, save_dtype
from trainer.config import TrainConfig
from trainer.fsdp import init_distributed, load_sharded_model, shutdown
from trainer.loss import PolicyInputs, PPOParams, full_token_logprobs, ppo_loss, token_logprobs
from trainer.step import forward_logprobs, fused_head, rl_step


def logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    return forward_logprobs(model, mb)[0]  # the trainer's own (its fused head works on a plain module too)


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, micro: list, normalizer: float,
               params: PPOParams) -> None:  # fmt: skip
    """The plain loop: same passes, no FSDP, no trainer bookkeeping."""
    opt.zero_grad(set_to_none=True)
    for mb in micro:
        logp = logprobs(model, mb)
        inp = PolicyInputs(
            logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.loss_mask, mb.token_weight, normalizer
        )
        loss, _ = ppo_loss(inp, params)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_size(size: str, reps: int, root: Path) -> dict[str, float]:
    model_dir = root / f"model-{size}"
    n_params = make_model(size, model_dir)
    info = init_distributed(force_cpu=False)
    device = info.device
    groups = make_rows(size)
    tokens = sum(len(r.token_ids) for g in groups for r in g)
    micro_tokens = 2048 if size == "100m" else 1024
    plan = plan_step(groups, world_size=1, rank=0, optimizer_steps=1, micro_batch_tokens=micro_tokens,
                     loss_agg="token_mean")  # fmt: skip
    params = PPOParams()

    from transformers import AutoModelForCausalLM

    # float32 weights in both; on GPU the plain loop computes under bf16 autocast, as FSDP's policy does
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    micro = [collate(rows, "token_mean", device) for rows in plan[0].micro]
    fsdp = load_sharded_model(str(model_dir), info)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-6)

    # Wall time, and on CPU also this process's CPU time (all its threads, gloo's included): on a machine
    # shared with other jobs, wall time mostly measures the neighbours, CPU time the work done.
    t_plain, t_fsdp, c_plain, c_fsdp = [], [], [], []
    for rep in range(reps + 1):  # the first round warms up; interleaved so machine load hits both alike
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            micro = [collate(rows, "token_mean", device) for rows in plan[0].micro]  # rl_step collates too
            plain_step(plain, plain_opt, micro, plan[0].normalizer, params)
        sync(device)
        t1, c1 = time.perf_counter(), time.process_time()
        rl_step(fsdp, fsdp_opt, plan, params, max_grad_norm=1.0, device=device)
        sync(device)
        t2, c2 = time.perf_counter(), time.process_time()
        if rep:
            t_plain.append(t1 - t0)
            t_fsdp.append(t2 - t1)
            c_plain.append(c1 - c0)
            c_fsdp.append(c2 - c1)
    del plain, plain_opt

    # publish: export_hf vs save_file + load_file of the same tensors
    t_export, t_st = [], []
    for rep in range(3):
        t0 = time.perf_counter()
        dest = export_hf(fsdp, model_dir, root / "weights" / f"v{rep:06d}")
        t_export.append(time.perf_counter() - t0)
        state = full_state_dict(fsdp)
        state.pop("lm_head.weight", None)
        state = {k: v.to(save_dtype(fsdp.config)).contiguous() for k, v in state.items()}
        st = root / f"plain-{rep}.safetensors"
        t0 = time.perf_counter()
        save_file(state, str(st), metadata={"format": "pt"})
        load_file(str(st))
        t_st.append(time.perf_counter() - t0)
        st.unlink()
        file_mb = (dest / "model.safetensors").stat().st_size / 2**20
    shutdown()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)

    # Best of the reps is the headline (a shared machine only ever adds time); the median is kept too.
    med = statistics.median
    return {
        "params_m": n_params / 1e6, "tokens_per_step": tokens, "micro_batches": len(micro),
        "plain_tok_s": tokens / min(t_plain), "fsdp_tok_s": tokens / min(t_fsdp),
        "fsdp_vs_plain": min(t_plain) / min(t_fsdp), "fsdp_vs_plain_median": med(t_plain) / med(t_fsdp),
        "fsdp_vs_plain_cpu_time": med(c_plain) / med(c_fsdp), "plain_cpu_s": c_plain, "fsdp_cpu_s": c_fsdp,
        "export_s": min(t_export), "write_read_s": min(t_st), "publish_ratio": min(t_export) / min(t_st),
        "publish_ratio_median": med(t_export) / med(t_st), "file_mb": file_mb,
        "plain_step_s": t_plain, "fsdp_step_s": t_fsdp, "export_all_s": t_export, "write_read_all_s": t_st,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# 3. memory of the logprobs at a 151,936 vocabulary

MEMORY_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=1024,
                    tie_word_embeddings=True)  # fmt: skip
ROW_TOKENS = 512  # micro-batches of rows of 512 tokens: 16 rows at micro_batch_tokens 8192


def logprobs_full(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=mb.input_ids, use_cache=False).logits
    return full_token_logprobs(logits, mb.targets, mb.temperature, with_entropy=True)


def logprobs_chunked(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=mb.input_ids, use_cache=False).logits
    return token_logprobs(logits, mb.targets, mb.temperature, with_entropy=True)


def logprobs_fused(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    return forward_logprobs(model, mb, with_entropy=True)


WAYS = {"full": logprobs_full, "chunked": logprobs_chunked, "fused": logprobs_fused}


def vm_kib(field: str) -> int:
    """VmRSS (resident memory now) or VmHWM (its peak since the last reset) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0), so that the next peak is the pass's, not model creation's."""
    Path("/proc/self/clear_refs").write_text("5")


def memory_micro_batch(micro_tokens: int, vocab: int, row_tokens: int = ROW_TOKENS) -> MicroBatch:
    """The trainer's first micro-batch of rows of `row_tokens` tokens (the first eighth prompt, the rest
    trained; a temperature that differs per row)."""
    g = torch.Generator().manual_seed(0)
    n_rows = max(1, micro_tokens // row_tokens)
    mask = [0] * (row_tokens // 8) + [1] * (row_tokens - row_tokens // 8)
    rows = [Row(torch.randint(0, vocab, (row_tokens,), generator=g).tolist(), mask, [-11.9] * row_tokens,
                [1.0 if i % 2 else -1.0] * row_tokens, [0.7 + 0.1 * (i % 4)] * row_tokens)
            for i in range(n_rows)]  # fmt: skip
    return collate(micro_batches(rows, micro_tokens)[0])


def train_pass(model: torch.nn.Module, way: str, mb: MicroBatch) -> None:
    """What `run_minibatches` does per micro-batch: logprobs and entropy, PPO loss, backward."""
    logp, entropy = WAYS[way](model, mb)
    normalizer = float(mb.loss_mask.sum())
    inp = PolicyInputs(logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.loss_mask, mb.token_weight,
                       normalizer)  # fmt: skip
    loss, _ = ppo_loss(inp, PPOParams())
    loss.backward()
    assert entropy is not None and torch.isfinite((entropy * mb.loss_mask).sum())


def memory_worker(way: str, micro_tokens: int) -> None:
    """One (way, size) in this fresh process; prints one JSON line."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MEMORY_MODEL)).train()
    assert way != "fused" or fused_head(model)
    vocab = MEMORY_MODEL["vocab_size"]
    train_pass(model, way, memory_micro_batch(32, vocab, row_tokens=32))  # warm-up; makes the .grad buffers
    model.zero_grad(set_to_none=False)
    mb = memory_micro_batch(micro_tokens, vocab)
    reset_peak()
    base = vm_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    train_pass(model, way, mb)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = (vm_kib("VmHWM") - base) * 1024
    print(json.dumps({"way": way, "micro_batch_tokens": micro_tokens, "tokens": mb.n_tokens, "peak_bytes": peak,
                      "bytes_per_token": peak / mb.n_tokens, "baseline_bytes": base * 1024, "pass_s": seconds,
                      "pass_cpu_s": cpu_seconds}))  # fmt: skip


def bench_memory(sizes: list[int], max_gib: float) -> list[dict]:
    results: list[dict] = []
    for way in WAYS:
        per_token = 0.0  # bytes per token of this way's largest run so far
        for size in sorted(sizes):
            if per_token and per_token * size > max_gib * 2**30:
                results.append({"way": way, "micro_batch_tokens": size, "tokens": None, "peak_bytes": None,
                                "bytes_per_token": per_token, "extrapolated": True})  # fmt: skip
                continue
            cmd = [sys.executable, __file__, "--memory-worker", way, str(size)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1]) | {"extrapolated": False}
            per_token = result["bytes_per_token"]
            results.append(result)
    return results


def report_memory(results: list[dict], default_tokens: int) -> None:
    print(f"\nlogprob memory on cpu ({torch.get_num_threads()} threads), vocab {MEMORY_MODEL['vocab_size']:,}, "
          f"hidden {MEMORY_MODEL['hidden_size']}, {MEMORY_MODEL['num_hidden_layers']} layers, float32: "
          "peak added by one training pass of a micro-batch (pass s: its wall time; cpu s: this process's CPU "
          "time, the steadier figure on a shared machine)")  # fmt: skip
    head = f"{'way':>8} {'micro_batch_tokens':>18} {'tokens':>7} {'peak MiB':>10} {'KiB/token':>10} {'pass s':>7} {'cpu s':>6}"
    print(head)
    print("-" * len(head))
    for r in results:
        if r["extrapolated"]:
            peak = f"~{r['bytes_per_token'] * r['micro_batch_tokens'] / 2**20:.0f}"
            per_token = f"~{r['bytes_per_token'] / 1024:.1f}"
            print(f"{r['way']:>8} {r['micro_batch_tokens']:>18} {'':>7} {peak:>10} {per_token:>10}   "
                  "not run (over --max-gib): extrapolated from the run above")  # fmt: skip
        else:
            print(f"{r['way']:>8} {r['micro_batch_tokens']:>18} {r['tokens']:>7} {r['peak_bytes'] / 2**20:>10.0f} "
                  f"{r['bytes_per_token'] / 1024:>10.1f} {r['pass_s']:>7.1f} {r['pass_cpu_s']:>6.1f}")  # fmt: skip
    at_default = {r["way"]: r for r in results if r["micro_batch_tokens"] == default_tokens}
    if "full" in at_default and "fused" in at_default:
        ratio = at_default["full"]["bytes_per_token"] / at_default["fused"]["bytes_per_token"]
        print(f"at the default micro_batch_tokens ({default_tokens}): full / fused = {ratio:.0f}x per token")
    print(json.dumps({"benchmark": "trainer_memory", "device": "cpu", "threads": torch.get_num_threads(),
                      "model": MEMORY_MODEL, "default_micro_batch_tokens": default_tokens,
                      "results": results}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,100m", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--reps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--memory", action="store_true", help="run 3. (logprob memory) instead of 1. and 2.")
    default_tokens = TrainConfig().micro_batch_tokens
    ap.add_argument("--memory-sizes", default=f"1024,2048,{default_tokens}",
                    help="micro_batch_tokens to measure (default: two small ones and the trainer's default)")  # fmt: skip
    ap.add_argument("--max-gib", type=float, default=7.0, help="skip a memory run whose peak would pass this")
    ap.add_argument("--memory-worker", nargs=2, metavar=("WAY", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--memory-part", choices=("all", "logprobs", "long"), default="all",
                    help="--memory: 3. (logprob memory), 4. (long rows, checkpointing) or both")
    ap.add_argument("--long-lengths", default="8192,16384,32768", help="4.: row lengths in tokens")
    ap.add_argument("--dense-max", type=int, default=16384, help="4.: longest row run under a dense mask")
    ap.add_argument("--budget-gib", type=float, default=16.0, help="4.: activation memory for the longest-row line")
    ap.add_argument("--long-device", default="cpu", help="4.: where the long rows run (cuda: the allocator's peak)")
    ap.add_argument("--long-dtype", default="float32", help="4.: the model's dtype (bfloat16 on a GPU)")
    ap.add_argument("--long-worker", nargs=2, metavar=("VARIANT", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--lora", action="store_true", help="instead: step time and memory, full weights vs LoRA")
    ap.add_argument("--publish", action="store_true",
                    help="instead: publish end to end (gateway + engine), full disk vs LoRA adapter, fsync or not")
    ap.add_argument("--lora-worker", nargs=2, metavar=("KIND", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lora_worker or args.lora or args.publish:  # benchmarks/trainer_lora.py
        from benchmarks import trainer_lora

        if args.lora_worker:
            trainer_lora.step_worker(args.lora_worker[0], args.lora_worker[1], args.reps)
            return
        sizes = args.sizes.split(",")
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            steps = {s: trainer_lora.bench_steps(s, args.reps) for s in sizes} if args.lora else None
            publish = ({s: trainer_lora.bench_publish(s, args.reps, Path(tmp) / s) for s in sizes}
                       if args.publish else None)
        trainer_lora.report(steps, publish)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        memory_worker(args.memory_worker[0], int(args.memory_worker[1]))
        return
    if args.long_worker:
        trainer_memory.worker(args.long_worker[0], int(args.long_worker[1]))
        return
    if args.memory:
        if args.memory_part in ("all", "logprobs"):
            sizes = [int(x) for x in args.memory_sizes.split(",")]
            report_memory(bench_memory(sizes, args.max_gib), default_tokens)
        if args.memory_part in ("all", "long"):
            os.environ[trainer_memory.DEVICE_ENV], os.environ[trainer_memory.DTYPE_ENV] = args.long_device, args.long_dtype
            lengths = [int(x) for x in args.long_lengths.split(",")]
            trainer_memory.report(trainer_memory.bench(lengths, args.max_gib, args.dense_max), args.budget_gib)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in args.sizes.split(","):
            results[size] = bench_size(size, args.reps, Path(tmp) / size)
    print(f"\ntrainer benchmark on {device} ({torch.get_num_threads()} threads), best of {args.reps} steps "
          "(median ratio in brackets; cpu = ratio of process CPU time, median)")  # fmt: skip
    head = f"{'model':>6} {'params':>8} {'tok/step':>8} {'plain tok/s':>12} {'FSDP tok/s':>11} {'FSDP/plain':>17} {'cpu':>6} " \
           f"{'export s':>9} {'write+read s':>12} {'publish x':>15} {'file MB':>8}"  # fmt: skip
    print(head)
    print("-" * len(head))
    for size, r in results.items():
        print(f"{size:>6} {r['params_m']:>7.1f}M {r['tokens_per_step']:>8} {r['plain_tok_s']:>12.0f} "
              f"{r['fsdp_tok_s']:>11.0f} {r['fsdp_vs_plain']:>8.1%} ({r['fsdp_vs_plain_median']:>6.1%}) {r['fsdp_vs_plain_cpu_time']:>6.1%} "
              f"{r['export_s']:>9.3f} {r['write_read_s']:>12.3f} {r['publish_ratio']:>6.2f}x "
              f"({r['publish_ratio_median']:>5.2f}x) {r['file_mb']:>8.1f}")  # fmt: skip
    print("targets: FSDP/plain >= 85% at world size 1; publish <= 1.5x write+read")
    print(json.dumps({"benchmark": "trainer", "device": device, "threads": torch.get_num_threads(),
                      "reps": args.reps, "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
