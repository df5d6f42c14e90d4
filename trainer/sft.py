"""Supervised fine-tuning on the same machinery (batching, FSDP2, checkpoints, HF export, metrics).

Data: a JSONL file of chats (`{"messages": [...], "tools": [...]?}` per line), or recorded sessions from
`GET /v1/sessions?include_turns=true` (their exact token ids; the model's completions are the loss
tokens). The loss is the NLL of assistant tokens only.

Assistant tokens of a chat are found by rendering prefixes: the tokens between "messages before turn i +
generation prompt" and "messages up to turn i" are turn i's (the end-of-turn token included). A template
for which a prefix does not render as a prefix is refused with the message index, never trained silently.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.batching import Row, collate, micro_batches, plan_step
from trainer.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.client import GatewayClient
from trainer.config import TrainConfig
from trainer.fsdp import DistInfo, broadcast, load_sharded_model
from trainer.metrics import BarTarget, MetricsSink
from trainer.step import forward_logprobs, make_optimizer, sft_step
from trainer.tracking import tracking_for

log = logging.getLogger("trainer")


def _ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """eos id(s) and the ChatML end-of-turn token when the vocabulary has one."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def chat_row(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> Row:
    """Token ids of the whole chat with loss_mask = 1 on what the model would generate for each assistant
    message: its tokens up to and including the end-of-turn token. The template's bridge after it (a
    newline before the next message) stays 0, as in the gateway's recorded samples (docs/architecture.md
    "Continuity and chains")."""
    eot = end_of_turn_ids(tokenizer)
    full = _ids(tokenizer, messages, tools, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = _ids(tokenizer, messages[:i], tools, True)
        upto = _ids(tokenizer, messages[: i + 1], tools, False)
        if full[: len(upto)] != upto or upto[: len(before)] != before:
            raise ValueError(f"chat template does not render message {i} as an extension of the ones before")
        end = len(upto)
        ends = [t for t in range(len(before), len(upto)) if upto[t] in eot]
        if ends:
            end = ends[-1] + 1
        for t in range(len(before), end):
            mask[t] = 1
    n = len(full)
    return Row(full, mask, [0.0] * n, [0.0] * n, [1.0] * n)


def rows_from_jsonl(path: str | Path, tokenizer: Any) -> list[Row]:
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        chat = json.loads(line)
        try:
            rows.append(chat_row(tokenizer, chat["messages"], chat.get("tools")))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    return rows


def session_rows(session: dict[str, Any]) -> list[Row]:
    """One row per chain of a recorded session (docs/architecture.md "Continuity and chains"): the exact ids
    of its last turn, prompt + completion, with loss_mask = 1 on the completion of every turn in the chain
    (a turn whose client disconnected trains nothing). No retokenization: these are the ids the model
    produced."""
    turns = {t["id"]: t for t in session.get("turns") or []}
    parents = {t.get("parent_id") for t in turns.values()}
    rows = []
    for leaf in (t for t in turns.values() if t["id"] not in parents):
        ids = list(leaf["prompt_ids"]) + list(leaf["completion_ids"])
        mask = [0] * len(ids)
        turn: dict[str, Any] | None = leaf
        while turn is not None:
            if not turn.get("client_disconnected"):
                start = len(turn["prompt_ids"])
                for k in range(start, start + len(turn["completion_ids"])):
                    mask[k] = 1
            turn = turns.get(turn.get("parent_id") or "")
        n = len(ids)
        rows.append(Row(ids, mask, [0.0] * n, [0.0] * n, [1.0] * n))
    return rows


def rows_from_sessions(
    client: GatewayClient, state: str, min_reward: float | None, page: int = 100
) -> list[Row]:
    """Every recorded session in `state` (paginated), optionally only those rewarded >= min_reward."""
    rows: list[Row] = []
    after: str | None = None
    seen = kept = 0
    while True:
        d = client.sessions(state=state, after=after, limit=page)
        for s in d.get("data", []):
            seen += 1
            if min_reward is not None and (s.get("reward") is None or s["reward"] < min_reward):
                continue
            kept += 1
            rows += session_rows(s)
        after = d.get("next_after")
        if not after:
            log.info("SFT data: %d of %d %s session(s)%s, %d sequence(s)", kept, seen, state,
                     "" if min_reward is None else f" rewarded >= {min_reward:g}", len(rows))
            return rows


@torch.no_grad()
def expected_match(model: nn.Module, rows: list[Row], device: torch.device, max_tokens: int) -> float:
    """Mean over `rows` of P(sampling at T = 1 reproduces the row's assistant tokens exactly):
    exp(sum of the loss tokens' logprobs), teacher-forced. One forward pass, no generation. Every rank
    scores all rows (FSDP's collectives need every rank in each forward), so every rank gets the same value.
    """
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for micro in micro_batches(rows, max_tokens):
            mb = collate(micro, device=device)
            logp, _ = forward_logprobs(model, mb)
            total += float(torch.exp((logp * mb.loss_mask).sum(-1)).sum())
    finally:
        model.train(was_training)
    return total / max(len(rows), 1)


def run_sft(cfg: TrainConfig, info: DistInfo) -> None:
    from transformers import AutoTokenizer

    out = Path(cfg.out).resolve()
    client = None
    if info.is_main and cfg.gateway:
        client = GatewayClient(cfg.gateway, cfg.resolved_admin_key(), cfg.http_timeout)
    source = cfg.model
    if not source and client:
        source = client.current_weights()[1] or ""
    source = broadcast(source)

    # ---------------- data (rank 0 reads, every rank gets the rows)
    rows: list[Row] | None = None
    if info.is_main:
        if cfg.sft_data:
            rows = rows_from_jsonl(cfg.sft_data, AutoTokenizer.from_pretrained(source))
        else:
            assert client is not None
            rows = rows_from_sessions(client, cfg.sft_session_state, cfg.sft_min_reward)
        rows = [r for r in rows if r.n_loss_tokens > 0]
    rows = broadcast(rows)
    assert rows is not None
    if not rows:
        raise ValueError("SFT: no sequence with assistant tokens in the data")
    rng = random.Random(cfg.seed)
    batches = []
    for _ in range(cfg.sft_epochs):
        order = list(range(len(rows)))
        rng.shuffle(order)
        batches += [
            order[i : i + cfg.sft_batch_sequences] for i in range(0, len(order), cfg.sft_batch_sequences)
        ]
    total = min(len(batches), cfg.steps) if cfg.steps else len(batches)

    # ---------------- model, optimizer, resume
    model = load_sharded_model(source, info, recompute=cfg.activation_checkpointing,
                               recompute_min_tokens=cfg.activation_checkpointing_min_tokens)
    optimizer = make_optimizer(model, cfg)
    step = 0
    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is not None:
        step, _ = load_checkpoint(model, optimizer, ckpt)
    probe = rows[: cfg.sft_probe_sequences] if cfg.sft_stop_at_match > 0 or cfg.sft_report_match else []
    # with a target, the bar shows the measured match against it: that is what ends the run, `total` is a ceiling
    target = BarTarget("probe_match", cfg.sft_stop_at_match, "match") if cfg.sft_stop_at_match > 0 else None
    sink = MetricsSink(out, enabled=info.is_main, total_steps=total, target=target, tracking=tracking_for(cfg, info.is_main))

    # ---------------- loop
    started = time.perf_counter()
    try:
        while step < total:
            t0 = time.perf_counter()
            batch = [[rows[i]] for i in batches[step]]  # each sequence is its own "group" for balancing
            plan = plan_step(
                batch,
                world_size=info.world_size,
                rank=info.rank,
                optimizer_steps=1,
                micro_batch_tokens=cfg.micro_batch_tokens,
                loss_agg=cfg.loss_agg,
            )
            metrics = sft_step(model, optimizer, plan, max_grad_norm=cfg.max_grad_norm, device=info.device)
            step += 1
            metrics["step_time_s"] = time.perf_counter() - t0
            metrics["tokens"] = float(sum(len(r[0].token_ids) for r in batch))
            # every rank decides alike (a collective follows): rank 0's clock decides the time cap
            capped = bool(cfg.sft_max_seconds) and step < total and broadcast(
                time.perf_counter() - started >= cfg.sft_max_seconds)
            reached = False
            if probe and (step % cfg.sft_eval_every == 0 or step == total or capped):
                metrics["probe_match"] = expected_match(model, probe, info.device, cfg.micro_batch_tokens)
                reached = cfg.sft_stop_at_match > 0 and metrics["probe_match"] >= cfg.sft_stop_at_match
            if step % cfg.checkpoint_every == 0 or step == total or reached or capped:
                save_checkpoint(
                    model, optimizer, out / "checkpoints", step=step, version=0, keep=cfg.keep_checkpoints
                )
            sink.log(step, metrics)
            if reached:
                sink.note(
                    f"SFT: expected exact match {metrics['probe_match']:.3f} >= {cfg.sft_stop_at_match} "
                    f"at step {step}; stopping"
                )
                break
            if capped:
                sink.note(f"SFT: time cap of {cfg.sft_max_seconds:.0f} s reached at step {step} of {total}; stopping")
                break
        export_hf(model, source, out / "weights" / "sft-final")
    finally:
        sink.close()
        if client:
            client.close()
