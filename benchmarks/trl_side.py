"""TRL's GRPOTrainer on the demo task, for a wall-clock budget: the baseline side of benchmarks/loop.py.

    python benchmarks/trl_side.py --model DIR --out DIR --budget SECONDS --seed N [--threads N]

Run as its own process by benchmarks/loop.py (so it gets every core, and its torch/TRL imports and thread
settings stay out of the orchestrator). Needs the `bench` extra: `pip install -e '.[bench]'` (trl==1.16.0).

The same learning problem as `rollway demo`'s RL phase: the training tasks of agents/tasks/arithmetic.jsonl as
one-message chats rendered with the model's own chat template, exact-match reward on the stripped reply
(what agents/arithmetic.py computes), 8 prompts x 8 generations = 64 completions per optimizer step, lr 1e-4
constant, advantages divided by the group's reward std, temperature 1, at most 8 new tokens, beta 0 (no KL,
no reference model), one optimizer step per generation batch. Plain `model.generate` in this one process.
Two departures from GRPOConfig's defaults, both to match rollway's trainer on CPU: bf16 off (rollway trains
in float32) and gradient checkpointing off (rollway does not recompute activations; at this size memory is
no concern). epsilon_high is set to rollway's clip_high 0.28 (inert here: with one optimizer step per batch
the ratio is exactly 1). Everything else is TRL's default (printed in config.json).

Writes to --out:
  config.json    the effective settings (every GRPOConfig field that matters here, and the thread count)
  steps.jsonl    one line per optimizer step: end time, reward (mean over the step's 64 completions),
                 frac_reward_zero_std, and the step's time split (generate+score, forward/backward+clip,
                 optimizer, the rest)
  summary.json   t0 (train begin: the first generation is requested right after), t_end, steps, the process's
                 CPU seconds and the machine's busy CPU seconds between the two
  final/         the weights and tokenizer at the end (HF folder), for the held-out evaluation
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# rollway's constants, so both sides read the same numbers (rollway.demo imports no torch)
sys.path.insert(0, str(ROOT))
from rollway.demo import GROUPS_PER_STEP, N_SAMPLES, RL_LR  # noqa: E402

MAX_NEW_TOKENS = 8  # agents/arithmetic.py's max_tokens
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # trainer/config.py's clip_low / clip_high


def machine_busy_s() -> float:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def exact_match(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """agents/arithmetic.py's reward: 1.0 when the reply's content, stripped, equals the answer."""
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(1.0 if (text or "").strip() == ref else 0.0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--budget", required=True, type=float, help="seconds of training from the first generation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core)")
    p.add_argument("--tasks", type=Path, default=ROOT / "agents" / "tasks" / "arithmetic.jsonl")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t["prompt"]}], "answer": t["answer"]}
                                 for t in tasks])
    cfg = GRPOConfig(
        output_dir=str(out / "trl-output"),
        seed=args.seed,
        use_cpu=True,
        bf16=False,  # rollway trains in float32
        gradient_checkpointing=False,  # rollway does not recompute activations
        learning_rate=RL_LR,
        lr_scheduler_type="constant",
        num_generations=N_SAMPLES,
        per_device_train_batch_size=GROUPS_PER_STEP * N_SAMPLES,  # 64 completions = 8 prompts x 8
        gradient_accumulation_steps=1,
        scale_rewards="group",
        temperature=1.0,
        max_completion_length=MAX_NEW_TOKENS,
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        max_steps=10**6,  # the budget stops it
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    budget = args.budget
    state: dict[str, Any] = {"gen_s": 0.0}
    steps_file = open(out / "steps.jsonl", "w", buffering=1)

    class Timed(GRPOTrainer):  # type: ignore[misc]
        """GRPOTrainer, timing its generate + score phase (nothing else changed)."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                state["gen_s"] += time.perf_counter() - t

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, a: Any, s: Any, control: Any, **kw: Any) -> None:
            state.update(t0=time.time(), cpu0=self_cpu_s(), busy0=machine_busy_s(), last_end=time.time())

        def on_step_begin(self, a: Any, s: Any, control: Any, **kw: Any) -> None:
            state.update(step_begin=time.perf_counter(), step_begin_wall=time.time(), gen_s=0.0)

        def on_pre_optimizer_step(self, a: Any, s: Any, control: Any, **kw: Any) -> None:
            state["opt_begin"] = time.perf_counter()

        def on_optimizer_step(self, a: Any, s: Any, control: Any, **kw: Any) -> None:
            state["opt_s"] = time.perf_counter() - state["opt_begin"]

        def on_step_end(self, a: Any, s: Any, control: Any, **kw: Any) -> None:
            now = time.time()
            step_s = time.perf_counter() - state["step_begin"]
            state["row"] = {
                "step": s.global_step, "time": now, "step_s": step_s, "gen_s": state["gen_s"],
                "opt_s": state["opt_s"], "fwd_bwd_s": step_s - state["gen_s"] - state["opt_s"],
                "between_s": state["step_begin_wall"] - state["last_end"],  # logging, data loading
            }
            state["last_end"] = now
            if now - state["t0"] >= budget:
                control.should_training_stop = True
                state.update(t_end=now, cpu1=self_cpu_s(), busy1=machine_busy_s())

        def on_log(self, a: Any, s: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            row = state.pop("row", None)
            if row is None or not logs or "reward" not in logs:
                return
            row.update({k: logs[k] for k in ("reward", "reward_std", "frac_reward_zero_std", "loss", "grad_norm",
                                             "clip_ratio/region_mean", "completions/mean_length",
                                             "num_tokens") if k in logs})
            steps_file.write(json.dumps(row) + "\n")

    trainer = Timed(model=str(args.model), reward_funcs=exact_match, args=cfg, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[Clock()])
    effective = {
        "lr": cfg.learning_rate, "lr_schedule": cfg.lr_scheduler_type, "warmup_steps": cfg.warmup_steps,
        "optimizer": str(getattr(cfg.optim, "value", cfg.optim)), "adam_betas": [cfg.adam_beta1, cfg.adam_beta2], "adam_eps": cfg.adam_epsilon,
        "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm,
        "clip": [cfg.epsilon, trainer.epsilon_high], "loss_type": cfg.loss_type,
        "importance_sampling_level": cfg.importance_sampling_level, "beta_kl": cfg.beta,
        "num_iterations": cfg.num_iterations, "scale_rewards": cfg.scale_rewards,
        "num_generations": cfg.num_generations, "generation_batch_size": cfg.generation_batch_size,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
        "max_completion_length": cfg.max_completion_length, "mask_truncated_completions": cfg.mask_truncated_completions,
        "shuffle_dataset": cfg.shuffle_dataset, "bf16": cfg.bf16, "gradient_checkpointing": cfg.gradient_checkpointing,
        "torch_threads": torch.get_num_threads(), "processes": 1, "generation": "transformers generate (plain)",
        "dtype": str(next(trainer.model.parameters()).dtype), "trl": __import__("trl").__version__,
        "transformers": __import__("transformers").__version__, "torch": torch.__version__,
    }
    (out / "config.json").write_text(json.dumps(effective, indent=2))
    trainer.train()
    steps_file.close()
    if "t_end" not in state:  # ran out of max_steps (never, at 10**6) or stopped otherwise
        state.update(t_end=time.time(), cpu1=self_cpu_s(), busy1=machine_busy_s())
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    summary = {k: state[k] for k in ("t0", "t_end", "cpu0", "cpu1", "busy0", "busy1")}
    summary["steps"] = trainer.state.global_step
    (out / "summary.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
