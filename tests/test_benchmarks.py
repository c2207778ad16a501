"""The benchmark scripts keep running (tiny settings: these check that they work and print
their tables, not what they measure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
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
    # the round-to-round spread beside the full collections (a job that stutters shows there)
    header = next(x for x in out.splitlines() if x.startswith("| configuration |"))
    assert header.endswith("| full collections per 1000 steps | slowest round / median round |")


def test_overhead_refuses_an_unknown_row():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), "--only", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown rows nope" in proc.stderr


def test_floor_prints_every_layer_and_torchscope():
    out = run("floor.py", "--steps", "1", "--repeats", "1", "--clock", "cpu")
    assert "cpu clock" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "untraced",
        "mode",
        "+ forward stats",
        "+ node hooks",
        "+ grad stats",
        "+ event records",
        "torchscope",
        "torchscope, trace() defaults",
    ]
    assert "torchscope trace(keep=False) / floor (`+ grad stats`)" in out
    assert "event records alone / floor" in out


def test_the_floors_event_records_hold_what_the_step_computed():
    """The `+ event records` row builds real records (not just their cost): each traced call
    and node, its name, and the stats of what it produced."""
    import sys

    import torch

    sys.path.insert(0, str(BENCH))
    try:
        import floor
    finally:
        sys.path.remove(str(BENCH))
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = torch.tensor([4.0, 5.0, 6.0])
    with floor.floor(4) as mode:
        (w * x).sum().backward()
    ops = [r for r in mode.records if r["kind"] == "op"]
    grads = {r["node"]: r for r in mode.records if r["kind"] == "grad"}
    assert [op["name"] for op in ops] == ["Tensor.mul", "Tensor.sum"]
    assert ops[0]["outputs"][0]["stats"]["max"] == 18.0
    assert ops[0]["outputs"][0]["stats"]["mean"] == pytest.approx(32 / 3)
    assert ops[0]["source"].startswith(__file__ + ":")  # the line of this test that made it
    # MulBackward0 sends d(sum)/dw = x on to w's AccumulateGrad.
    sent = grads["MulBackward0"]["grad_inputs"]
    assert [s["stats"]["min"] for s in sent] == [4.0] and sent[0]["stats"]["norm"] == pytest.approx(
        float(x.norm())
    )
    assert grads["torch::autograd::AccumulateGrad"]["grad_inputs"] == []  # w's: a sink


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


def test_overhead_headline_rows_count_frames_and_print_the_per_event_cost():
    out = run(
        "overhead.py",
        "--workload",
        "policy",
        "--only",
        "user_trace,run,run_ui,run_record,traced",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "1",
    )
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for label in (
        "as run: untraced",
        "as run: trace()",
        "as run: run --steps all (live, no UI)",
        "as run: run --steps all, one UI reading",
        "untraced",
        "torchscope traced (summaries)",
    ):
        assert label in rows, label
    assert "**Headline: as a user runs it**" in out and "**Controlled**" in out

    def cells(label: str, table: str) -> list[str]:
        section = out.split(table, 1)[1]
        line = next(x for x in section.splitlines() if x.startswith(f"| {label} |"))
        return [c.strip() for c in line.split("|")[2:-1]]

    # No UI: events reach the publisher, and no frame is encoded or sent.
    no_ui = cells("as run: run --steps all (live, no UI)", "No work for absent readers")
    assert float(no_ui[0]) > 0 and no_ui[1] == "0.00" and no_ui[2] == "0.00"
    # A recording alone: the file grows, the publisher still encodes nothing.
    rec = cells("as run: run --record F --steps all (live, no UI)", "No work for absent readers")
    assert rec[1] == "0.00" and float(rec[4]) > 0
    # One UI: frames are encoded and it receives the events made after it subscribed.
    ui = cells("as run: run --steps all, one UI reading", "No work for absent readers")
    assert float(ui[1]) > 0 and float(ui[3]) >= 0.9 * float(ui[0])
    per_event = out.split("### Per-event cost", 1)[1]
    assert "| policy | 25 |" in per_event


def test_gpu_check_skips_in_one_line_without_cuda():
    """``gpu_check.py`` runs its table only on a CUDA machine; here it says it skipped."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the real check runs (minutes), not the skip")
    lines = run("gpu_check.py").splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped: no CUDA device"), lines


def test_instruction_counts_say_so_in_one_line_without_valgrind():
    import os

    out = run("instructions.py", "--steps", "1", env={**os.environ, "PATH": ""})  # no valgrind
    assert out.splitlines() == [
        "instructions.py: valgrind not found (apt-get install valgrind); nothing counted"
    ]


def test_instruction_counts_run_every_rows_loop():
    """What valgrind runs for each row (the counting itself takes minutes: not here)."""
    for row in ("base", "floor", "traced", "trace"):
        out = run("instructions.py", "--inner", row, "--steps", "1")
        assert out == ""


def test_watch_catch_times_the_traced_window_after_a_nan_it_could_not_name():
    out = run("watch_catch.py", "--steps", "17", "--bad", "3", "--repeats", "1")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["plain", "before", "window", "after"]
    assert "The window's extra time" in out
