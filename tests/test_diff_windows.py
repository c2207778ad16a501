"""`torchscope diff` on what a user compares first: a run against one where NaNs appear (the
drift table says so, never 0) and two windows of the same job (aligned by position)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

from torchscope.analysis.diff import Options, compare, render
from torchscope.protocol.tracefile import TraceWriter
from torchscope.tui.demo.synthetic import make_trace


def _shift(events: list, first: int) -> list:
    """The same events as steps ``first``, ``first + 1``, ... (a window of a long job)."""
    out = copy.deepcopy(events)
    for ev in out:
        if isinstance(ev.get("step"), int):
            ev["step"] += first
    return out


def _with_nans(events: list, step: int) -> list:
    """NaN in every op output of ``step`` (what a bad batch does downstream)."""
    out = copy.deepcopy(events)
    for ev in out:
        if ev.get("step") == step and ev.get("kind") == "op":
            for s in ev.get("outputs") or ():
                if isinstance(s, dict) and isinstance(s.get("stats"), dict):
                    s["stats"].update(nan=4, norm=float("nan"))
    return out


def test_the_drift_table_marks_nan_on_one_side_not_zero():
    a = make_trace(3, 2)
    res = compare(a, _with_nans(a, 2))
    assert not res.same
    at_2 = {m: v for (m, s), v in res.drift.items() if s == 2}
    assert at_2 and all(v == float("inf") for v in at_2.values())
    report = "\n".join(render(res))
    table = report[report.index("drift by module and step") :]
    top = next(line for line in table.splitlines() if "(top level)" in line)
    assert top.split()[-1] == "NaN/Inf", table  # step 2's column
    assert top.split()[-2] == "0"  # step 1: identical


def test_two_windows_of_one_job_are_said_apart_and_align_by_position():
    run = make_trace(3, 2)
    a, b = _shift(run, 1290), _shift(run, 1298)
    res = compare(a, b)
    assert res.matched == 0
    report = "\n".join(render(res))
    assert "A and B share no step (A: 1290-1292, B: 1298-1300)" in report
    assert "--align relative" in report
    rel = compare(a, b, Options(align="relative"))
    assert rel.same and rel.matched > 0
    assert "B's step 1298 with A's step 1290" in "\n".join(render(rel))


def test_diff_align_relative_on_the_command_line(tmp_path: Path):
    run = make_trace(3, 2)
    for name, first in (("a.tsc", 1290), ("b.tsc", 1298)):
        with TraceWriter(tmp_path / name) as w:
            w.write(_shift(run, first))

    def diff(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torchscope", "diff", "a.tsc", "b.tsc", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    plain = diff()
    assert plain.returncode == 1 and "--align relative" in plain.stdout
    rel = diff("--align", "relative")
    assert rel.returncode == 0 and "same: no divergence" in rel.stdout, rel.stdout
    bad = diff("--align", "sideways")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
