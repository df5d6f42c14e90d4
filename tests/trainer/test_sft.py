"""SFT: the assistant-token mask of a rendered chat, and a short run that lowers the NLL."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from tqdm import TqdmWarning
from transformers import AutoTokenizer

from trainer.config import load_config
from trainer.fsdp import init_distributed
from trainer.metrics import BarTarget, MetricsSink
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


def test_sft_stops_once_the_expected_match_is_reached(
    dist_env: None, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    # the bar's last state: the match that stopped it against the target, the steps against their ceiling
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith(f"match {probes[-1]:.3f}/0.500 |"), last
    assert f"step {len(records)}/100" in last, last


def test_sft_fixed_steps_report_the_match_and_keep_to_a_time_cap(
    dist_env: None, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's warm-up (issue 28): a fixed step count, the match measured (never a stop) and at the last step;
    a time cap ends it early, saying at which step, with the weights exported and the match measured there."""
    data = tmp_path / "chats.jsonl"
    short = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    data.write_text("\n".join(json.dumps({"messages": short}) for _ in range(8)) + "\n")
    base = {"mode": "sft", "model": str(tiny_model), "sft_data": str(data), "sft_epochs": 50,
            "sft_batch_sequences": 4, "lr": 1e-2, "checkpoint_every": 1000, "sft_report_match": True,
            "sft_eval_every": 4}
    run_sft(load_config(None, {**base, "out": str(tmp_path / "fixed"), "steps": 10}), init_distributed(force_cpu=True))
    records = [json.loads(x) for x in (tmp_path / "fixed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))  # every step: the match measured never stops it
    assert [r["step"] for r in records if "probe_match" in r] == [4, 8, 10] and 0 < records[-1]["probe_match"] <= 1
    capsys.readouterr()
    cfg = load_config(None, {**base, "out": str(tmp_path / "capped"), "steps": 100, "sft_max_seconds": 1e-6})
    run_sft(cfg, init_distributed(force_cpu=True))
    records = [json.loads(x) for x in (tmp_path / "capped" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and "probe_match" in records[0]
    assert "time cap of 0 s reached at step 1 of 100; stopping" in capsys.readouterr().out  # tqdm.write
    assert (tmp_path / "capped" / "weights" / "sft-final" / "model.safetensors").is_file()


def _bar_states(err: str) -> list[str]:
    return [x.strip() for x in err.split("\r") if x.strip()]


def test_bar_shows_the_match_against_its_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = BarTarget("probe_match", 0.12, "match")
    sink = MetricsSink(tmp_path, total_steps=1800, tensorboard=False, target=target)
    for step in range(1, 11):
        metrics: dict[str, float | int] = {"loss": 0.5}
        if step % 5 == 0:
            metrics["probe_match"] = {5: 0.085, 10: 0.131}[step]
        with warnings.catch_warnings():
            warnings.simplefilter("error", TqdmWarning)  # a fraction above 1 warns
            sink.log(step, metrics)
        if step == 7:
            assert sink.bar_text().startswith("match 0.085/0.120 |"), sink.bar_text()
            assert "step 7/1800" in sink.bar_text()
    sink.close()
    states = _bar_states(capsys.readouterr().err)
    assert states[0].startswith("match -/0.120 |")  # nothing measured yet: not a measured 0.000
    assert any(x.startswith("match 0.085/0.120 |") and "step 5/1800" in x for x in states), states
    # past the target: the true value is shown and the bar is full (n clamped to the total)
    assert re.match(r"match 0\.131/0\.120 \|[^ |]{10}\|", states[-1]), states[-1]
    assert "step 10/1800, loss=0.5" in states[-1]
    # no step bar, no rate
    assert not any("1800 [" in x or "it/s" in x or "step/s" in x for x in states), states


def test_bar_without_a_target_counts_steps_from_a_resumed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = MetricsSink(tmp_path, total_steps=50, tensorboard=False)
    sink.log(41, {"loss": 0.5})  # resumed from a checkpoint at step 40
    sink.log(42, {"loss": 0.4})
    assert "42/50" in sink.bar_text(), sink.bar_text()
    sink.close()
    err = capsys.readouterr().err
    assert _bar_states(err)[-1].startswith("train:  84%|"), err


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


def test_sft_from_sessions_says_what_it_kept(caplog: pytest.LogCaptureFixture) -> None:
    """`rollway train --mode sft` from recorded sessions said nothing of how many it kept under --sft-min-reward."""
    from trainer.sft import rows_from_sessions

    pages = {None: {"data": [{"id": "a", "reward": 1.0, "turns": []}, {"id": "b", "reward": 0.0, "turns": []}],
                    "next_after": "b"},
             "b": {"data": [{"id": "c", "reward": None, "turns": []}], "next_after": None}}

    class Client:
        def sessions(self, *, state: str, after: str | None, limit: int) -> dict[str, Any]:
            return pages[after]

    with caplog.at_level("INFO", logger="trainer"):
        assert rows_from_sessions(Client(), "finished", 0.5) == []  # type: ignore[arg-type]
    assert "SFT data: 1 of 3 finished session(s) rewarded >= 0.5, 0 sequence(s)" in caplog.text
