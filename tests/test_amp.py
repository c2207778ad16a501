"""Mixed precision as users train with it: ``torch.autocast`` with and without a
``GradScaler``, fp16 and bf16, under ``torchscope run`` (dormant, watched, recorded).

The job (``jobs/amp_nan.py``) starts its scaler at 2**24 with a short growth interval, so
steps 0-7, 10 and 16 overflow in fp16 and are skipped by the scaler: normal AMP, never an alarm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tui_pilot import sync, until

pytest.importorskip("torch")

JOB = Path(__file__).parent / "jobs" / "amp_nan.py"
# The scaler skips these steps of the healthy job (fp16, init_scale 2**24): its overflows.
OVERFLOWS = [0, 1, 2, 3, 4, 5, 6, 7, 10, 16]


def origin_line(bug: str) -> str:
    """``amp_nan.py:N``: the line of the bug's origin."""
    needle = {"log": "torch.log(h)", "sqrt": "torch.sqrt(h - h.detach())"}[bug]
    (n,) = [i for i, s in enumerate(JOB.read_text().splitlines(), 1) if needle in s]
    return f"{JOB}:{n}"


def run(*args: str, cwd: Path, script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torchscope", "run", *args, str(JOB), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=240)


def plain(*script_args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(JOB), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=240)


def steps(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines()]


def watch_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The watch's report lines (what it found), not the run's own start and end lines."""
    return [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("torchscope:")
        and any(w in line for w in ("appears", "enters", " in the loss", " in the gradients"))
    ]


def dump_jsonl(path: Path, *kinds: str) -> list[dict]:
    args = [sys.executable, "-m", "torchscope", "dump", "--format", "jsonl", str(path)]
    for kind in kinds:
        args += ["--kind", kind]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> dict:
    """The healthy fp16 job with its scaler: plain, dormant, watched, recorded."""
    cwd = tmp_path_factory.mktemp("amp")
    return {
        "cwd": cwd,
        "plain": plain(cwd=cwd),
        "run": run(cwd=cwd),
        "watch": run("--watch", "nan", "--on-nan", "stop", cwd=cwd),
        "record": run("--record", "amp.tsc", cwd=cwd),
    }


def test_a_healthy_scaled_job_is_bit_identical_and_its_overflows_are_no_alarm(healthy):
    base = healthy["plain"]
    assert base.returncode == 0, base.stderr
    assert [s["step"] for s in steps(base) if s["skipped"]] == OVERFLOWS
    for mode in ("run", "watch", "record"):
        proc = healthy[mode]
        assert proc.returncode == 0, (mode, proc.stderr)
        assert proc.stdout == base.stdout, mode  # losses, scales and weights, bit for bit
        assert watch_lines(proc) == [], (mode, proc.stderr)
        assert "internal error" not in proc.stderr
    # Steps are the loop's iterations, skipped ones included.
    assert "24 step(s) seen" in healthy["run"].stderr


def test_a_recording_marks_the_scalers_overflows_and_holds_one_origin_per_real_nan(healthy):
    import torchscope
    from torchscope.analysis.trace import job_origins

    alerts = torchscope.load(healthy["cwd"] / "amp.tsc").alerts
    # Every overflow step's Inf is marked as the scaler's, none is an origin.
    assert {a.step for a in alerts} == set(OVERFLOWS)
    assert {a["where"] for a in alerts} == {"overflow"}
    assert all("the loss scaler's overflow" in a["message"] for a in alerts)
    assert job_origins({0: alerts}) == []
    cwd = healthy["cwd"]
    bad = run("--record", "bad.tsc", cwd=cwd, script_args=("--bad", "12"))
    assert bad.returncode == 0, bad.stderr
    (origin,) = job_origins({0: torchscope.load(cwd / "bad.tsc").alerts})
    where = (origin["step"], origin["name"], origin["source"])
    assert where == (12, "torch.log", origin_line("log"))


def test_the_recorded_history_keeps_the_unscaled_loss_the_scale_and_the_skips(healthy):
    events = dump_jsonl(healthy["cwd"] / "amp.tsc", "history")
    points = {p["step"]: p for e in events for p in e.get("points", ())}
    job = {s["step"]: s for s in steps(healthy["plain"])}
    assert sorted(points) == sorted(job)
    for step, line in job.items():
        point = points[step]
        assert point["loss"] == line["loss"], step  # as the job computed it, before scaling
        assert point["scale"] == line["scale"], step
        assert bool(point.get("skipped")) == line["skipped"], step


def test_a_one_off_nan_is_named_in_its_step_and_stops_before_its_update(tmp_path):
    proc = run("--watch", "nan", "--on-nan", "stop", cwd=tmp_path, script_args=("--bad", "12"))
    assert proc.returncode == 3, proc.stderr
    (line,) = watch_lines(proc)
    # Step 12 of the loop; the optimizer has updated only 3 times (9 overflows skipped).
    assert line == (
        "torchscope: NaN first appears at step 12 (optimizer step 3) in aten.log.default "
        f"inside torch.log (forward) in model.blocks.1 (Block) at {origin_line('log')} — replayed"
    )
    assert [s["step"] for s in steps(proc)] == list(range(12))  # stopped before step 12's end
    assert "Traceback" not in proc.stderr


def test_a_nan_the_gradients_make_under_the_scaler_is_an_origin_not_an_overflow(tmp_path):
    """sqrt's gradient at 0 is Inf whatever the scale: a real origin, in the backward."""
    args = ("--bad", "12", "--bug", "sqrt")
    proc = run("--watch", "nan", "--on-nan", "stop", cwd=tmp_path, script_args=args)
    assert proc.returncode == 3, proc.stderr
    (line,) = watch_lines(proc)
    assert "at step 12 (optimizer step 3)" in line
    assert "SqrtBackward0 (backward) in model.blocks.1 (Block)" in line
    assert origin_line("sqrt") in line


def test_a_persistent_nan_is_reported_once_and_the_scalers_skips_are_said(tmp_path):
    args = ("--bad", "4", "--persist", "--steps", "30", "--dtype", "fp16")
    base = plain(*args, cwd=tmp_path)
    proc = run("--watch", "nan", cwd=tmp_path, script_args=args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == base.stdout
    job = steps(base)
    assert all(s["skipped"] for s in job[4:])  # the classic AMP failure: no update from 4 on
    (line,) = watch_lines(proc)
    assert line.startswith("torchscope: NaN first appears at step 4 ") and "torch.log" in line
    (skips,) = [s for s in proc.stderr.splitlines() if "skipped 20 steps in a row" in s]
    # the early overflows (steps 0-3) and the NaN steps after them: one stretch
    assert "the loss is nan" in skips and "(steps 0-19 made no update)" in skips
    assert "NaN/Inf from step 4 lasted 26 checked steps" in proc.stderr


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_without_a_scaler_is_watched_as_a_plain_job(tmp_path, dtype):
    healthy = ("--dtype", dtype, "--no-scaler", "--steps", "8")
    base = plain(*healthy, cwd=tmp_path)
    watched = run("--watch", "nan", cwd=tmp_path, script_args=healthy)
    assert watched.stdout == base.stdout and watch_lines(watched) == []
    bad = (*healthy, "--bad", "5")
    proc = run("--watch", "nan", "--on-nan", "stop", cwd=tmp_path, script_args=bad)
    assert proc.returncode == 3, proc.stderr
    (line,) = watch_lines(proc)
    assert line == (
        "torchscope: NaN first appears at step 5 in aten.log.default inside torch.log "
        f"(forward) in model.blocks.1 (Block) at {origin_line('log')} — replayed"
    )


@sync
async def test_the_ui_history_says_the_scale_and_the_skipped_updates(healthy):
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.screens.history import HistoryScreen
    from torchscope.tui.sources.file import FileSource

    app = TorchscopeApp(FileSource(healthy["cwd"] / "amp.tsc"), at_origin=False)
    job = {s["step"]: s for s in steps(healthy["plain"])}
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: len(app.store.history) == len(job), what="the history")
        await pilot.press("H")
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen), what="H")
        plot = app.screen.plot
        for step in (OVERFLOWS[-1], OVERFLOWS[-1] + 1):
            plot.cursor = step
            await until(pilot, lambda s=step: plot.cursor == s, what=f"the cursor at {step}")
            text = plot.readout()
            assert f"scale {job[step]['scale']:g}" in text, text
            assert ("update skipped by the scaler" in text) == job[step]["skipped"], text
