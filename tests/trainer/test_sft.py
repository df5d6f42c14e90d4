"""SFT: the assistant-token mask of a rendered chat, and a short run that lowers the NLL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trainer.config import load_config
from trainer.fsdp import init_distributed
from trainer.sft import chat_row, run_sft

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
