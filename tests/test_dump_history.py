"""`torchscope dump FILE --kind history`: the recorded run's history, one line per step, as
`torchscope history PID` prints a live job's (not one line per batch the recorder wrote)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torchscope.protocol.tracefile import TraceWriter
from torchscope.tui.demo.synthetic import make_trace


def _point(step: int, traced: bool = False) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "grad_norm": 2.0, "traced": traced}


def test_dump_kind_history_is_one_line_per_step(tmp_path: Path):
    events = make_trace(1, 1)
    seq = max(e["seq"] for e in events) + 1
    for i, steps in enumerate(([0, 1], [2, 3, 4])):
        events.append(
            {"kind": "history", "seq": seq + i, "step": None, "points": [_point(s) for s in steps]}
        )
    with TraceWriter(tmp_path / "t.tsc") as w:
        w.write(events)
    res = subprocess.run(
        [sys.executable, "-m", "torchscope", "dump", "t.tsc", "--kind", "history"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["STEP", "LOSS", "GRAD"]
    assert [line.split()[0] for line in lines[1:]] == ["0", "1", "2", "3", "4"]
    assert lines[3].split()[1] == "0.333333"  # step 2's loss
