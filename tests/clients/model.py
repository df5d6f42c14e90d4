"""The shared tuned model: the tiny demo model, fine-tuned briefly to speak like an agent's model.

The random tiny model never calls a tool or thinks, so the client tests fine-tune it once (`rollway train
--mode sft`) on three behaviours, each short and fixed so that a few steps teach it:

- with the calculate tool: `<think>` + a fixed thought + `</think>`, then a Hermes `<tool_call>` whose
  expression is copied from the question (the reasoning block gives the thinking tests something to split);
- after the tool's result: a fixed final answer (a tiny model does not learn to copy the result in a few
  steps);
- without tools: a fixed greeting (plain text that ends the turn).

The tool schema is drawn from the shapes the three SDKs send (OpenAI's function tool as written, the
OpenAI Agents SDK's `@function_tool` schema with titles and `additionalProperties`), so the model calls the
tool whichever client rendered it. The result is cached by a hash of the data, the SFT options and the tiny
model's source (not the trainer's code: delete the cache folder after changing it), so a rerun reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SYSTEM = "Use the calculate tool, then answer with the number only."
THOUGHT = "I will use the calculate tool."
GREETING = "Hello! How can I help you?"
ANSWER = "The tool gave the answer."
TOOL_NAME = "calculate"
TOOL_DESCRIPTION = "Evaluate an arithmetic expression with + - * / and parentheses."
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
    "required": ["expression"],
}
# What `@function_tool def calculate(expression: str)` sends (OpenAI Agents SDK 0.24).
AGENTS_TOOL_SCHEMA: dict[str, Any] = {
    "properties": {"expression": {"title": "Expression", "type": "string"}},
    "required": ["expression"], "title": "calculate_args", "type": "object", "additionalProperties": False,
}
# Measured on the shared 2-core machine: 80 steps of 4 chats took 83 s of steps under load (0.6 s a step when
# quiet), 94 s with torchrun's start; after them every greedy reply had the trained form (24 steps of 8 gave
# garbled calls, 40 of 8 at lr 5e-3 thought again after the tool's result). More chats a step cost time but
# teach little: the number of steps is what counts. On an AVX-512 machine the 80-step model put `</think>` where
# `<tool_call>` goes (7 client tests failed): 120 steps give every trained form there too.
SFT_STEPS = 120
PROBLEMS = "behaviour-problems.json"
"""Beside the tuned weights: what `behaviour_problems` found (the trained form missing for a prompt the tests send).
CPU kernels differ by instruction set and so do the weights: the same 120 steps that give every trained form on an
AVX-512 machine gave `</think>` inside `<tool_call>` and no answer after the tool on an AMD EPYC, and training on
(to 480 steps at this lr) made it worse, not better. The tests that need the tool round trip are marked
`trained_forms` and are skipped, saying why, where the model lacks it (tests/clients/conftest.py)."""
SFT_BATCH = 4
SFT_LR = 3e-3
SFT_SEED = 0
_WORDS = ("the a of to and in is it that for on with as was at by be this from or have not are but what all "
          "when we there can one your which said if do will each about how up out then so some would other "
          "into has more two like see time could no make than first been who now people my made over did").split()


def openai_tool(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                                             "parameters": schema or TOOL_SCHEMA}}


def calculate(expression: str) -> str:
    """The tool itself: a + b, a - b or a * b of two integers (what the questions ask)."""
    for op in "+-*":
        a, sep, b = expression.partition(op)
        if sep and a.strip().isdigit() and b.strip().isdigit():
            x, y = int(a), int(b)
            return str(x + y if op == "+" else x - y if op == "-" else x * y)
    return "error: unsupported expression"


def question(rng: random.Random) -> tuple[str, str]:
    """('What is 12+7?', '12+7')."""
    expression = f"{rng.randint(0, 99)}{rng.choice('+-*')}{rng.randint(0, 99)}"
    return f"What is {expression}?", expression


def _tool_chat(rng: random.Random) -> dict[str, Any]:
    text, expression = question(rng)
    result = calculate(expression)
    call = {"id": "call_0", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expression})}}
    tool = openai_tool(rng.choice([TOOL_SCHEMA, AGENTS_TOOL_SCHEMA]))
    return {"tools": [tool], "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": text},
        # The template writes "\n" + content before "\n<tool_call>": the reply is <think>..</think>\n<tool_call>
        {"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": ANSWER},
    ]}


def _plain_chat(rng: random.Random) -> dict[str, Any]:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
    return {"messages": [{"role": "user", "content": words.capitalize() + rng.choice([".", "?", "!"])},
                         {"role": "assistant", "content": GREETING}]}


def sft_data() -> str:
    """The SFT chats as JSONL: three tool chats for each plain one."""
    rng = random.Random(SFT_SEED)
    lines = [json.dumps(_plain_chat(rng) if i % 4 == 3 else _tool_chat(rng))
             for i in range(SFT_STEPS * SFT_BATCH)]
    return "\n".join(lines) + "\n"


def _sft_args(model: Path, out: Path, data: Path, steps: int = SFT_STEPS) -> list[str]:
    return ["--mode", "sft", "--model", str(model), "--out", str(out), "--sft-data", str(data),
            "--steps", str(steps), "--lr", str(SFT_LR), "--nproc", "1", "--seed", str(SFT_SEED),
            "--sft-batch-sequences", str(SFT_BATCH), "--checkpoint-every", "1000"]


CHECK_QUESTIONS = ("What is 12+7?", "What is 3*4?", "What is 45-9?", "What is 8*23?")
"""The tests' questions (12+7, and 3*4 in the Agents SDK's second run) and two more."""


def behaviour_problems(model_dir: Path) -> list[str]:
    """What the tuned model gets wrong, greedy, on the prompts the tests send (empty: it is fit for them): with the
    calculate tool (either schema), `<think>` + THOUGHT + `</think>` then one well-formed Hermes call (its one
    argument, `expression`, a string); after the tool's result, ANSWER; without tools, GREETING."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
        text = str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False))  # <think>, <tool_call> are special
        return text.split(str(tok.eos_token))[0]

    problems = []
    for schema in (TOOL_SCHEMA, AGENTS_TOOL_SCHEMA):
        for q in CHECK_QUESTIONS:
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            got = reply(messages, [openai_tool(schema)])
            m = re.fullmatch(r"<think>\n(.*)\n</think>\n<tool_call>\n(.*)\n</tool_call>", got, re.S)
            try:
                call = json.loads(m[2]) if m and m[1] == THOUGHT else None
            except ValueError:
                call = None
            args = call.get("arguments") if isinstance(call, dict) and call.get("name") == TOOL_NAME else None
            if not (isinstance(args, dict) and list(args) == ["expression"] and isinstance(args["expression"], str)):
                problems.append(f"{q!r}: {got!r}")
                continue
            expression = args["expression"]  # well-formed is what the tests need; a tiny model copies it badly
            tool_call = {"id": "call_0", "type": "function",
                         "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expression})}}
            messages += [{"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>", "tool_calls": [tool_call]},
                         {"role": "tool", "tool_call_id": "call_0", "content": calculate(expression)}]
            if (got := reply(messages, [openai_tool(schema)])) != ANSWER:
                problems.append(f"{q!r} after the tool: {got!r}")
    for text in ("Hello there.", "What can you do?"):
        if (got := reply([{"role": "user", "content": text}])) != GREETING:
            problems.append(f"{text!r}: {got!r}")
    return problems


def cache_key() -> str:
    """What the tuned weights follow from: the data, the SFT options and the tiny model's source."""
    import engine.tiny_model

    h = hashlib.sha256()
    h.update(sft_data().encode())
    h.update(json.dumps([_sft_args(Path("M"), Path("O"), Path("D")), CHECK_QUESTIONS]).encode())
    h.update(Path(engine.tiny_model.__file__).read_bytes())
    return h.hexdigest()[:16]


def tuned_model(cache_dir: Path, log: Any = None) -> Path:
    """The tuned model's folder under `cache_dir/<key>`, made on the first call for that key."""
    final = cache_dir / cache_key() / "model"
    if (final / "config.json").is_file():
        return final
    from engine.tiny_model import create_tiny_model

    work = cache_dir / f"tmp-{os.getpid()}-{time.monotonic_ns()}"
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.monotonic()
    try:
        base = create_tiny_model(work / "base", seed=0)
        data = work / "sft.jsonl"
        data.write_text(sft_data())
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run([sys.executable, "-m", "rollway.cli", "train", *_sft_args(base, work / "sft", data)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"SFT failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        problems = behaviour_problems(work / "sft" / "weights" / "sft-final")
        (work / "sft" / "weights" / "sft-final" / PROBLEMS).write_text(json.dumps(problems, indent=1))
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            (work / "sft" / "weights" / "sft-final").rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent run that got there first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if log is not None:
        print(f"tuned model: {SFT_STEPS} SFT steps in {time.monotonic() - t0:.1f}s -> {final}; "
              f"{len(problems)} prompt(s) without the trained form", file=log)
    return final
