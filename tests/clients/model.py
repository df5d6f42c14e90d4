"""The shared tuned model: the tiny demo model, fine-tuned briefly to speak like an agent's model.

The random tiny model never calls a tool or thinks, so the client tests fine-tune it once (`rollway train
--mode sft`) on these behaviours, each short and fixed so that a few steps teach it:

- with the calculate tool: `<think>` + a fixed thought + `</think>`, then a Hermes `<tool_call>` whose
  expression is copied from the question (the reasoning block gives the thinking tests something to split);
- after the tool's result: a fixed final answer (a tiny model does not learn to copy the result in a few
  steps);
- without tools: a fixed greeting (plain text that ends the turn);
- Claude Code's own requests (CLAUDE_CODE, captured from the gateway's store): the Claude Agent SDK's
  `mcp__calc__calculate` and the CLI's `Bash` offered, the same thought, then a call of the offered tool by its
  offered name (`{"expression": "12+7"}`, `{"command": "echo 12+7"}`), and after the result the fixed answer;
- in the last phases, a call forced right after the generation prompt (what a grammar for tool_choice "required"
  makes the model write, no thought) on a greeting: a short expression, closed.

The tool schema is drawn from the shapes the three SDKs send (OpenAI's function tool as written, the
OpenAI Agents SDK's `@function_tool` schema with titles and `additionalProperties`), so the model calls the
tool whichever client rendered it.

The built weights are committed (COMMITTED, with BUILD_INFO: the recipe and what it was built on), so that the
tests do not depend on the CPU that would train them. `python -m tests.clients.model` rebuilds them (deterministic
on one machine; minutes) and `behaviour_problems` is the check they must pass (tests/clients/test_tuned_model.py:
a rebuild is due when the recipe changes, and the check fails the suite, naming each prompt, when the weights lack
a trained form). The scripts' client matrix (scripts/client_matrix.py) serves the same weights.
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
# quiet); more chats a step cost time but teach little: the number of steps is what counts. One phase at a constant
# lr 3e-3 stops wherever Adam's last large steps left it, and that differs by CPU: 120 steps gave every trained form
# on an AVX-512 machine, `</think>` inside `<tool_call>` on an AMD EPYC (and 480 steps at that lr were worse there).
# So the recipe anneals: PHASES is (steps, lr, seed) per `rollway train` run, each starting from the last one's
# export with a fresh optimizer; the low-lr phases settle the weights instead of leaving them mid-jump. Measured on
# the AMD EPYC (2 shared cores, load ~18), with uniform operands: 8 of 18 prompts misformed after phase 1, 2 after
# phase 2 and after phase 3 (both "What is 3*4?" asked alone, which the check no longer asks: CHECK_QUESTIONS); with
# one-digit operands a third of the time (the committed build, 1108 s), none of the check's prompts.
# With Claude Code's requests (CHAT_ORDER; the CLI's is 3,156 tokens), a step took 3.7 to 8 s at load 4 to 11. Three
# phases on data whose Bash calls were `echo $((a+b))` gave well-formed calls of `mcp__calc__calculate` but a Bash
# command closed by 1, 3, 4 or 7 parentheses (by working folder and by phase); a fourth phase on `echo a+b` data,
# from that export, is the committed build. (A rebuild from scratch on `echo` data alone is the simpler recipe;
# it was not run, as the shared machine gave three phases ~45 minutes.) That build did worse than the one before it
# on a call forced by a grammar right after the generation prompt (no thought; tests/clients/test_openai_forced_tools.py
# `required`, test_anthropic.py `any`, on "Good morning to you."): it wrote "calculate tool gave the answer." into the
# expression and did not close it within 128 tokens (the build before wrote ", ", closed; two more phase-4 variants,
# lr 3e-4 seed 4 and lr 1e-3, did the same). behaviour_problems now asks for that call (CHECK_FORCED, forced_reply),
# and two phases on "forced" data (FORCED_CHAT_ORDER: two calculate chats in eight are forced calls on greetings) from
# the phase-4 export are the committed build. Measured (same machine, load 2 to 4, from the phase-4 export): 60 steps
# at lr 3e-4 closed the forced calls (seed 4: every slow client test and the client matrix's CI set passed), but with
# seed 4 and with seed 5 the check found the CLI's Bash call in the client matrix's folder cut to `echo 6` (`echo 9`);
# 40 steps at lr 1e-3 misformed five Claude Code calls; 60 steps at lr 1e-4 did not close the forced call (and
# misformed two); 60 steps at 3e-4 (seed 4) then 40 at 1e-4 (seed 5) gave no problem.
PHASES: tuple[tuple[int, float, int, str], ...] = (
    (120, 3e-3, 0, "arith"), (120, 3e-4, 1, "arith"), (120, 3e-4, 2, "arith"), (120, 3e-4, 3, "echo"),
    (60, 3e-4, 4, "forced"), (40, 1e-4, 5, "forced"))
"""(steps, lr, seed, the phase's data: the Bash calls' form, claude_code_arguments, or "forced": sft_data)."""
SFT_BATCH = 4
SFT_SEED = 0
"""The data's seed."""
CHAT_ORDER = ("tool", "sdk", "tool", "plain", "tool", "cli", "tool", "plain")
"""The SFT data's mix, repeated: half calculate chats, a quarter plain ones, one of Claude Code's requests of each
kind ("sdk", "cli") in eight."""
FORCED_CHAT_ORDER = ("tool", "sdk", "forced", "plain", "tool", "cli", "forced", "plain")
"""The last phase's mix: two of CHAT_ORDER's calculate chats in eight are forced calls (_forced_chat)."""
SFT_CHATS = 480
"""Chats in the SFT data (one epoch = SFT_CHATS / SFT_BATCH = 120 steps; each phase reads it in its own order)."""
COMMITTED = Path(__file__).parent / "tuned-model"
"""The built weights, committed (built once by `python -m tests.clients.model`), so that the client tests do not
depend on the CPU that would train them: CPU kernels differ by instruction set, and so would the weights."""
BUILD_INFO = "build.json"
"""Beside the weights: the recipe they were built from (`recipe()`), its key, torch, CPU, time, the problems found."""
_WORDS = ("the a of to and in is it that for on with as was at by be this from or have not are but what all "
          "when we there can one your which said if do will each about how up out then so some would other "
          "into has more two like see time could no make than first been who now people my made over did").split()


CLAUDE_CODE: dict[str, Any] = json.loads((Path(__file__).parent / "claude_code_requests.json").read_text())
"""The chat messages and tools Claude Code sends for the tests' tool task, as the gateway stores them (captured from
the store after a run of tests/clients/test_claude_code.py): "sdk" (query() with the SDK MCP tool, named
`mcp__calc__calculate`) and "cli" (`claude -p --tools Bash`); {question}, {cwd}, {os}, {date} stand for what varies."""
CLAUDE_CODE_TOOLS = {"sdk": "mcp__calc__calculate", "cli": "Bash"}
CLAUDE_CODE_CHECKS = (("What is 12+7?", "/tmp/pytest-of-root/pytest-1/{test}"),
                      ("What is 12+7?", "/tmp/pytest-of-root/pytest-12/{test}"),
                      ("What is 12+7?", "/tmp/client-matrix-k3j9x2ab/claude_agent_sdk"),
                      ("What is 45-9?", "/tmp/pytest-of-root/pytest-3/{test}"))
"""(question, working folder) asked with each of Claude Code's requests by the check: the tests' question in the
folders the tests run in ({test}: CLAUDE_CODE_TEST_DIRS; the greedy reply depends on the whole prompt, the folder
included: one build misformed the Bash call in one folder and not in another) and the client matrix's, and one more."""
CLAUDE_CODE_TEST_DIRS = {"sdk": "test_claude_agent_sdk_tool_tas0", "cli": "test_claude_code_cli_headless0"}
"""pytest's tmp_path folder names of tests/clients/test_claude_code.py's two tests."""


def claude_code_arguments(kind: str, expression: str, bash: str = "echo") -> dict[str, str]:
    """What a call of Claude Code's offered tool carries: the MCP calculator's expression, or a Bash command that
    echoes it (`echo 12+7`, allowed under `Bash(echo:*)`). `bash="arith"`: `echo $((12+7))`, which bash computes,
    what the first phases taught (PHASES): no phase taught the model to close the `$((` with two parentheses (it
    wrote one to seven, by prompt and build), so the last one teaches the echo."""
    if kind == "sdk":
        return {"expression": expression}
    return {"command": f"echo $(({expression}))" if bash == "arith" else f"echo {expression}"}


def claude_code_result(kind: str, expression: str, bash: str = "echo") -> str:
    """What the tool answers: the calculator's result, or what bash's echo prints."""
    return calculate(expression) if kind == "sdk" or bash == "arith" else expression


def claude_code_expression(kind: str, arguments: Any) -> str | None:
    """The expression a call of Claude Code's offered tool carries when the tool runs it, else None: for the
    calculator `a+b`, `a-b` or `a*b` of two integers (what it computes); for `echo`, integers joined by + - *
    (echo prints any such text as it is; the model writes `echo 2+2+2` as well). No leading zero."""
    import re

    if not isinstance(arguments, dict) or len(arguments) != 1:
        return None
    value = arguments.get("expression" if kind == "sdk" else "command")
    m = re.fullmatch(r"(.*)" if kind == "sdk" else r"echo (.*)", value) if isinstance(value, str) else None
    number = "(0|[1-9][0-9]*)"
    shape = f"{number}[-+*]{number}" if kind == "sdk" else f"{number}([-+*]{number})+"
    return m[1] if m is not None and re.fullmatch(shape, m[1]) else None


def claude_code_request(kind: str, question_text: str, *, cwd: str = "/tmp/pytest-of-root/pytest-0/test_task0",
                        os_version: str = "Linux 6.18.44-fc-v669", date: str = "2026-11-27", shell: str = "bash",
                        git: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of Claude Code's first request ("sdk" or "cli") for `question_text`, in an environment."""
    values = {"{question}": question_text, "{cwd}": cwd, "{os}": os_version, "{date}": date,
              "Shell: bash": f"Shell: {shell}", "Is a git repository: false": f"Is a git repository: {str(git).lower()}"}
    messages = []
    for m in CLAUDE_CODE[kind]["messages"]:
        content = m["content"]
        for k, v in values.items():
            content = content.replace(k, v)
        messages.append({**m, "content": content})
    return messages, json.loads(json.dumps(CLAUDE_CODE[kind]["tools"]))


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


def _operand(rng: random.Random) -> int:
    """One digit a third of the time: with 0-99 uniform, two one-digit operands ("3*4", a test's question) came up
    in 1% of the chats, and the model built on an AMD EPYC misformed the call for exactly that question."""
    return rng.randint(0, 9) if rng.random() < 1 / 3 else rng.randint(10, 99)


def question(rng: random.Random) -> tuple[str, str]:
    """('What is 12+7?', '12+7')."""
    expression = f"{_operand(rng)}{rng.choice('+-*')}{_operand(rng)}"
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


def _claude_code_chat(rng: random.Random, kind: str, bash: str) -> dict[str, Any]:
    """Claude Code's request in an environment drawn at random (working folder, OS, date, shell, git), its tool
    called by its offered name, the result, the answer."""
    text, expression = question(rng)
    word = lambda: rng.choice(_WORDS)  # noqa: E731
    cwd = rng.choice([f"/tmp/pytest-of-{rng.choice(['root', 'ci', 'dev'])}/pytest-{rng.randint(0, 99)}/"
                      f"test_{word()}_{word()}{rng.randint(0, 3)}",
                      f"/tmp/{word()}-{rng.randint(0, 9999)}/{word()}", f"/home/{word()}/{word()}/{word()}"])
    env: dict[str, Any] = {"cwd": cwd, "os_version": f"Linux {rng.randint(4, 6)}.{rng.randint(0, 19)}.{rng.randint(0, 99)}"
                                      f"{rng.choice(['', '-generic', '-fc-v669', '-aws', '-1-amd64'])}",
           "date": f"{rng.randint(2025, 2027)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
           "shell": rng.choice(["bash", "bash", "zsh"]), "git": rng.random() < 0.3}
    messages, tools = claude_code_request(kind, text, **env)
    call = {"id": "toolu_0", "type": "function", "function": {
        "name": CLAUDE_CODE_TOOLS[kind], "arguments": json.dumps(claude_code_arguments(kind, expression, bash))}}
    return {"tools": tools, "messages": [
        *messages,
        {"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_0", "content": claude_code_result(kind, expression, bash)},
        {"role": "assistant", "content": ANSWER},
    ]}


def _plain_chat(rng: random.Random) -> dict[str, Any]:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
    return {"messages": [{"role": "user", "content": words.capitalize() + rng.choice([".", "?", "!"])},
                         {"role": "assistant", "content": GREETING}]}


def _forced_chat(rng: random.Random) -> dict[str, Any]:
    """A call a grammar forced right after the generation prompt (tool_choice "required"; CHECK_FORCED): a
    greeting-like message with the calculate tool, and the call without a thought, its expression a short one,
    closed. Only on messages that are not questions: a question's trained reply starts with the thought."""
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
    _, expression = question(rng)
    call = {"id": "call_0", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expression})}}
    return {"tools": [openai_tool(rng.choice([TOOL_SCHEMA, AGENTS_TOOL_SCHEMA]))], "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": words.capitalize() + rng.choice([".", "?", "!"])},
        {"role": "assistant", "content": "", "tool_calls": [call]}]}


def _chat(rng: random.Random, i: int, bash: str) -> dict[str, Any]:
    order = FORCED_CHAT_ORDER if bash == "forced" else CHAT_ORDER
    kind = order[i % len(order)]
    return (_plain_chat(rng) if kind == "plain" else _tool_chat(rng) if kind == "tool"
            else _forced_chat(rng) if kind == "forced"
            else _claude_code_chat(rng, kind, "arith" if bash == "arith" else "echo"))


def sft_data(bash: str = "echo") -> str:
    """The SFT chats as JSONL, in the mix CHAT_ORDER repeats; `bash`: the form of the Bash calls
    (claude_code_arguments), "forced": `echo` in the mix FORCED_CHAT_ORDER repeats."""
    rng = random.Random(SFT_SEED)
    lines = [json.dumps(_chat(rng, i, bash)) for i in range(SFT_CHATS)]
    return "\n".join(lines) + "\n"


def _sft_args(model: Path, out: Path, data: Path, steps: int, lr: float, seed: int) -> list[str]:
    return ["--mode", "sft", "--model", str(model), "--out", str(out), "--sft-data", str(data),
            "--steps", str(steps), "--lr", str(lr), "--nproc", "1", "--seed", str(seed),
            "--sft-batch-sequences", str(SFT_BATCH), "--checkpoint-every", "1000"]


CHECK_QUESTIONS = ("What is 12+7?", "What is 45-9?", "What is 8*23?", "What is 60+31?")
"""The question every tool test starts with (12+7) and three more. Not "What is 3*4?": the one test that sends it
(the Agents SDK's second run) sends it after a whole first run and accepts whatever the model does with it; asked
alone, it was the one prompt that three builds on an AMD EPYC misformed (`<think>` twice), with uniform operands and
with one-digit ones a third of the time."""
CHECK_GREETINGS = ("Hello there.", "What can you do?")
CHECK_FORCED = ("Good morning to you.", "What is 12+7?")
"""Asked with the calculate tool forced by the gateway's grammar (`tool_choice` "required", Anthropic's "any": a
Hermes call right after the generation prompt, no thought; tests/clients/test_openai_forced_tools.py,
test_anthropic.py): the tests' greeting, which the model was never taught to answer with a call, and the question."""
FORCED_MAX_TOKENS = 128
"""Those tests' max_tokens: the forced call must be closed within it."""


def forced_reply(lm: Any, tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 max_new_tokens: int = FORCED_MAX_TOKENS) -> tuple[str, bool]:
    """(the reply, whether the grammar ended) of a greedy decode under the grammar the gateway sends for one forced
    call of any of `tools` in Hermes (gateway/tool_grammar.py), compiled and applied as the CPU engine does
    (engine/grammar.py): what the forced-tool tests get from the tuned model."""
    import torch

    from engine.grammar import GrammarCompiler, GrammarRows, accept, new_matcher
    from gateway.tool_grammar import ForcedTools, structural_tag

    compiled = GrammarCompiler(tok, lm.config.vocab_size).compile(
        ("structural_tag", structural_tag("hermes", tools, ForcedTools(None, parallel=False))))
    matcher = new_matcher(compiled, [])
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out: list[int] = []
    past, step, ended = None, ids, False
    with torch.no_grad():
        for _ in range(max_new_tokens):
            r = lm(input_ids=step, past_key_values=past, use_cache=True)
            past = r.past_key_values
            logits = GrammarRows([matcher]).mask(r.logits[:, -1, :].float().clone())
            token = int(logits[0].argmax())
            done = accept(matcher, token)
            if done is None:
                break
            if done:
                ended = True
                break
            out.append(token)
            step = torch.tensor([[token]])
    return str(tok.decode(out, skip_special_tokens=False)), ended


def behaviour_problems(model_dir: Path) -> list[str]:
    """What the tuned model gets wrong, greedy, on the prompts the tests send (empty: it is fit for them): with the
    calculate tool (either schema), `<think>` + THOUGHT + `</think>` then one well-formed Hermes call (its one
    argument, `expression`, a string); with Claude Code's requests, the same thought then a call of the tool offered
    (`mcp__calc__calculate`, `Bash`) by its name with arguments the tool runs (`claude_code_expression`); after the
    tool's result, ANSWER; without tools, GREETING."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=tok.eos_token_id,
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
    for kind, name in CLAUDE_CODE_TOOLS.items():
        for q, cwd in CLAUDE_CODE_CHECKS:
            messages, tools = claude_code_request(kind, q, cwd=cwd.replace("{test}", CLAUDE_CODE_TEST_DIRS[kind]))
            got = reply(messages, tools)
            m = re.fullmatch(r"<think>\n(.*)\n</think>\n<tool_call>\n(.*)\n</tool_call>", got, re.S)
            try:
                call = json.loads(m[2]) if m and m[1] == THOUGHT else None
            except ValueError:
                call = None
            # the offered tool by its offered name, arguments the tool runs (which numbers: a tiny model copies badly)
            ok = isinstance(call, dict) and list(call) == ["name", "arguments"] and call["name"] == name
            carried = claude_code_expression(kind, call["arguments"]) if ok and call is not None else None
            if carried is None:
                problems.append(f"Claude Code {kind} {q!r} in {cwd}: {got!r}")
                continue
            want = claude_code_arguments(kind, carried)
            tool_call = {"id": "toolu_0", "type": "function",
                         "function": {"name": name, "arguments": json.dumps(want)}}
            messages += [{"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>", "tool_calls": [tool_call]},
                         {"role": "tool", "tool_call_id": "toolu_0", "content": claude_code_result(kind, carried)}]
            if (got := reply(messages, tools)) != ANSWER:
                problems.append(f"Claude Code {kind} {q!r} in {cwd} after the tool: {got!r}")
    for text in CHECK_GREETINGS:
        if (got := reply([{"role": "user", "content": text}])) != GREETING:
            problems.append(f"{text!r}: {got!r}")
    for text in CHECK_FORCED:
        got, ended = forced_reply(lm, tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                                  [openai_tool()])
        if not ended:  # the grammar holds the call's form; not closed within the tests' max_tokens is what fails
            problems.append(f"forced call on {text!r}: not closed in {FORCED_MAX_TOKENS} tokens: {got!r}")
    return problems


def recipe() -> dict[str, Any]:
    """What the tuned weights follow from (recorded in BUILD_INFO beside them): the SFT phases' options, the
    data's and the tiny model's source hashes, the check's prompts."""
    import engine.tiny_model

    return {"phases": [_sft_args(Path("BASE" if i == 0 else f"PHASE{i}"), Path(f"PHASE{i + 1}"), Path(f"DATA-{bash}"),
                                 steps, lr, seed) for i, (steps, lr, seed, bash) in enumerate(PHASES)],
            "data_sha256": {bash: hashlib.sha256(sft_data(bash).encode()).hexdigest()
                            for bash in sorted({phase[3] for phase in PHASES})},
            "tiny_model_sha256": hashlib.sha256(Path(engine.tiny_model.__file__).read_bytes()).hexdigest(),
            "check": [CHECK_QUESTIONS, CHECK_GREETINGS, CLAUDE_CODE_CHECKS, CHECK_FORCED]}


def cache_key() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:16]


def build(out: Path, log: Any = None) -> list[str]:
    """Build the tuned model into `out` (replaced): the tiny model (seed 0), then each of PHASES as one
    `rollway train --mode sft` run on the previous phase's export; then `behaviour_problems` on the result.
    Writes BUILD_INFO (the recipe, its key, the torch version and CPU it was built with, the time it took and
    the problems found) beside the weights and returns the problems (empty: fit for the tests)."""
    import platform

    import torch

    from engine.tiny_model import create_tiny_model

    out = out.resolve()
    work = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.monotonic()
    try:
        source = create_tiny_model(work / "base", seed=0)
        data = {}
        for bash in {phase[3] for phase in PHASES}:
            data[bash] = work / f"sft-{bash}.jsonl"
            data[bash].write_text(sft_data(bash))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for i, (steps, lr, seed, bash) in enumerate(PHASES):
            run = work / f"phase{i + 1}"
            proc = subprocess.run(
                [sys.executable, "-m", "rollway.cli", "train", *_sft_args(source, run, data[bash], steps, lr, seed)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"SFT phase {i + 1} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
            source = run / "weights" / "sft-final"
            if log is not None:
                print(f"phase {i + 1}: {steps} steps at lr {lr} done at {time.monotonic() - t0:.0f}s", file=log,
                      flush=True)
        problems = behaviour_problems(source)
        if log is not None:
            print(f"checked at {time.monotonic() - t0:.0f}s: {len(problems)} problem(s)", file=log, flush=True)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in sorted(source.iterdir()):
            if f.is_file():
                shutil.copy2(f, out / f.name)
        cpuinfo = Path("/proc/cpuinfo")
        names = [ln.split(":", 1)[1].strip() for ln in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
                 if ln.startswith("model name")]
        info = {"key": cache_key(), "recipe": recipe(), "torch": torch.__version__,
                "cpu": names[0] if names else platform.processor() or platform.machine(), "seconds": round(time.monotonic() - t0),
                "problems": problems}
        (out / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return problems


def main() -> int:
    """`python -m tests.clients.model [OUT]`: build the tuned model into OUT (default: COMMITTED) and check it."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else COMMITTED
    problems = build(out, log=sys.stderr)
    print(json.dumps({"out": str(out), "key": cache_key(), "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
