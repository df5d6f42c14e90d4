"""SFT: the assistant-token mask of a rendered chat, and a short run that lowers the NLL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trainer.config import load_config
from trainer.fsdp import init_distributed
from trainer.sft import chat_row, expected_match, run_sft

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_loss_mask_covers_assistant_tokens_and_end_of_turn_only(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    row = chat_row(tok, CHAT)
    trained = [t if m else None for t, m in zip(row.token_ids, row.loss_mask, strict=True)]
    spans, cur = [], []
    for t in trained:
        if t is None and cur:
            spans.append(tok.decode(cur))
            cur = []
        elif t is not None:
            cur.append(t)
    if cur:
        spans.append(tok.decode(cur))
    # each assistant turn: its content and <|im_end|>; the "\n" bridge after it and the prompts stay 0
    assert spans == ["Hello!<|im_end|>", "4<|im_end|>"]
    assert tok.decode(row.token_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_sft_run_lowers_nll(dist_env: None, tiny_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(4)) + "\n")
    cfg = load_config(
        None,
        {
            "mode": "sft",
            "model": str(tiny_model),
            "out": str(tmp_path / "out"),
            "sft_data": str(data),
            "sft_epochs": 4,
            "sft_batch_sequences": 2,
            "lr": 1e-2,
            "checkpoint_every": 100,
        },
    )
    run_sft(cfg, init_distributed(force_cpu=True))
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 8  # 4 chats x 4 epochs / 2 per step
    assert records[-1]["nll"] < 0.7 * records[0]["nll"], [r["nll"] for r in records]
    assert (tmp_path / "out" / "weights" / "sft-final" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "checkpoints" / "step_00000008").is_dir()  # the last step is always saved


def test_expected_match_is_the_probability_of_sampling_the_reply(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rows = [chat_row(tok, CHAT[:3]), chat_row(tok, CHAT)]
    # by hand: P(reply) = prod over loss tokens of softmax(logits)[token], one full forward pass per row
    want = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
            want.append(float(torch.exp((picked * torch.tensor(r.loss_mask[1:], dtype=torch.float32)).sum())))
    model.train()
    got = expected_match(model, rows, torch.device("cpu"), max_tokens=8192)
    assert got == pytest.approx(sum(want) / 2, rel=1e-4)
    assert 0 < got < 1
    assert model.training  # restored


def test_sft_stops_once_the_expected_match_is_reached(dist_env: None, tiny_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    short = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    data.write_text("\n".join(json.dumps({"messages": short}) for _ in range(8)) + "\n")
    cfg = load_config(
        None,
        {
            "mode": "sft", "model": str(tiny_model), "out": str(tmp_path / "out"), "sft_data": str(data),
            "sft_epochs": 50, "sft_batch_sequences": 4, "lr": 1e-2, "checkpoint_every": 1000,
            "sft_stop_at_match": 0.5, "sft_eval_every": 2,
        },
    )  # fmt: skip
    run_sft(cfg, init_distributed(force_cpu=True))
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    probes = [r["probe_match"] for r in records if "probe_match" in r]
    assert len(records) < 100, "never stopped"  # 50 epochs x 8 chats / 4 per step = 100 steps without the stop
    assert probes[-1] >= 0.5 and all(p < 0.5 for p in probes[:-1]), probes
    assert len(records) % 2 == 0  # it stops only on a measured step
    assert (tmp_path / "out" / "weights" / "sft-final" / "model.safetensors").is_file()


def test_bad_jsonl_names_the_line(tiny_model: Path, tmp_path: Path) -> None:
    from trainer.sft import rows_from_jsonl

    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"chat": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        rows_from_jsonl(data, AutoTokenizer.from_pretrained(tiny_model))


def test_session_rows_follow_turn_chains() -> None:
    from trainer.sft import session_rows

    # t1: prompt [1, 2] -> completion [3, 4]; t2 extends t1: prompt [1, 2, 3, 4, 5] (bridge 5) -> [6];
    # t3 starts a new chain: prompt [7] -> [8, 9], but its client disconnected (trains nothing).
    # Leaves t2 and t3: rows [1, 2, 3, 4, 5, 6] with mask on t1's and t2's completions = [0, 0, 1, 1, 0, 1],
    # and [7, 8, 9] with mask [0, 0, 0].
    session = {"turns": [
        {"id": "t1", "parent_id": None, "prompt_ids": [1, 2], "completion_ids": [3, 4]},
        {"id": "t2", "parent_id": "t1", "prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [6]},
        {"id": "t3", "parent_id": None, "prompt_ids": [7], "completion_ids": [8, 9], "client_disconnected": True},
    ]}  # fmt: skip
    rows = session_rows(session)
    assert [(r.token_ids, r.loss_mask) for r in rows] == [([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1]),
                                                          ([7, 8, 9], [0, 0, 0])]  # fmt: skip
