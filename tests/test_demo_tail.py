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
