"""The benchmark scripts keep running (tiny settings: these check that they work and print
their tables, not what they measure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_overhead_prints_its_table_for_the_chosen_rows():
    out = run(
        "overhead.py",
        "--workload",
        "mlp",
        "--only",
        "traced,idle",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "1",
    )
    assert "| untraced |" in out and "| torchscope traced (summaries) |" in out
    assert "| torchscope, untraced step |" in out and "detect_anomaly" not in out
    assert "µs per event" in out


def test_overhead_refuses_an_unknown_row():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), "--only", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown rows nope" in proc.stderr


def test_floor_prints_every_layer_and_torchscope():
    out = run("floor.py", "--steps", "1", "--repeats", "1")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "untraced",
        "mode",
        "+ forward stats",
        "+ node hooks",
        "+ grad stats",
        "torchscope",
    ]


def test_attach_benchmark_prints_its_rows_and_the_attach_latency():
    out = run(
        "attach.py",
        "--workload",
        "mlp",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--attach-trials",
        "1",
    )
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:5] == ["untraced", "dormant (serve)", "armed, then dormant", "armed (a UI holds)"]
    assert "## Attach latency" in out and "Median:" in out
