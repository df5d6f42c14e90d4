"""The demo's progress reader: each poll gives exactly the metrics rows appended since the last one."""
from __future__ import annotations

import json
from pathlib import Path

from rollway.demo import _read_steps, _StepTail


def test_it_gives_each_appended_row_once_and_waits_for_a_line_to_end(tmp_path: Path) -> None:
    path = tmp_path / "train" / "metrics.jsonl"
    tail = _StepTail(path)
    assert tail.new_rows() == []  # the trainer has not written yet
    path.parent.mkdir()
    rows = [{"step": i, "reward_mean": i / 10} for i in range(1, 6)]
    with open(path, "wb") as f:
        f.write((json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n").encode())
        line = json.dumps(rows[2]).encode()
        f.write(line[:7])  # the trainer is half-way through a line
        f.flush()
        assert tail.new_rows() == rows[:2]
        assert tail.new_rows() == []
        f.write(line[7:] + b"\n")
        f.flush()
        assert tail.new_rows() == [rows[2]]
        f.write(("\n" + json.dumps(rows[3]) + "\n" + json.dumps(rows[4]) + "\n").encode())
        f.flush()
        assert tail.new_rows() == rows[3:]
    assert tail.new_rows() == []
    assert _read_steps(path) == rows


def test_the_progress_table_is_a_few_spans_not_a_row_per_step() -> None:
    from rollway.demo import progress_table

    rows = [{"step": i, "reward_mean": i / 552, "groups_filtered": 1, "loss": 0.01} for i in range(1, 553)]
    lines = progress_table(rows).splitlines()
    assert len(lines) == 1 + 8 and lines[1].split()[0] == "1-69" and lines[-1].split()[0] == "484-552"
    assert sum(int(line.split()[2]) for line in lines[1:]) == 552  # every step counted once
    assert [len(progress_table(rows[:n]).splitlines()) - 1 for n in (1, 3, 8, 9)] == [1, 3, 8, 8]


def test_a_demo_without_an_rl_step_says_why(tmp_path: Path) -> None:
    from rollway.demo import no_step_reason

    (tmp_path / "trainer.log").write_text("rollway train: 1 process(es)\nno trainable group within 5s (filtered 24, "
                                          "stale 0); waiting; all 24 groups had equal rewards\n")
    why = no_step_reason({"trainer_rc": None, "rl_seconds": 61.0}, tmp_path, 1.0)
    assert "ran 61 s (--minutes 1)" in why and "filtered 24" in why and "--minutes" in why
    (tmp_path / "trainer.log").write_text("Traceback ...\nValueError: bad model\n")
    why = no_step_reason({"trainer_rc": 2, "rl_seconds": 3.0}, tmp_path, 6.0)
    assert "exited with status 2 before its first step" in why and "ValueError: bad model" in why
