"""What the NaN watch does when its replay cannot name the op and line, when the step was
traced live, and when a stopped step is run again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from torchscope.tracer.watch.nan_watch import NanWatch, WatchStop  # noqa: E402

JOB = Path(__file__).parent / "jobs" / "amp_nan.py"


def line_of(needle: str) -> str:
    (n,) = [i for i, s in enumerate(JOB.read_text().splitlines(), 1) if needle in s]
    return f"{JOB}:{n}"


def run(*args: str, cwd: Path, job: tuple[str, ...]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torchscope", "run", *args, str(JOB), *job]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=240)


def said(proc: subprocess.CompletedProcess) -> list[str]:
    return [s for s in proc.stderr.splitlines() if s.startswith("torchscope:")]


# The loss made NaN by the loop's own code (outside every module call), from step 12 on; the
# scaler skips each such step, so the weights stay finite and the NaN comes back.
LOOP_NAN = ("--bad", "12", "--bug", "loop", "--persist", "--steps", "16")
# A NaN record in a batch buffer that the loop refills before backward(), from step 12 on: the
# replay sees the next batch, not the one the step ran on, and cannot name it.
PREFETCH_NAN = ("--bad", "12", "--bug", "prefetch", "--persist", "--steps", "16")


def test_a_loop_code_nan_is_named_at_the_step_it_happens_with_nothing_traced(tmp_path):
    proc = run("--watch", "nan", cwd=tmp_path, job=LOOP_NAN)
    assert proc.returncode == 0, proc.stderr
    lines = said(proc)
    assert lines[1] == (
        "torchscope: NaN first appears at step 12 (optimizer step 3) in torch.sqrt (forward) "
        f"at {line_of('torch.sqrt(loss - 2.0)')}, in the training loop's code — seen as the "
        "step ran"
    )
    assert not any("tracing the next" in s for s in lines)
    assert lines[-1] == "torchscope: 16 step(s) seen, 0 traced"


def test_a_nan_it_cannot_replay_is_caught_live_the_next_time(tmp_path):
    proc = run("--watch", "nan", cwd=tmp_path, job=PREFETCH_NAN)
    assert proc.returncode == 0, proc.stderr
    lines = said(proc)
    first = next(i for i, s in enumerate(lines) if "first appears at step 12" in s)
    assert lines[first + 1].startswith("torchscope: tracing the next 10 steps in full")
    # The next step, traced, names the op and the loop's line; then tracing ends.
    assert lines[first + 2] == (
        "torchscope: NaN first appears at step 13 (optimizer step 3) in Tensor.__setitem__ "
        f"(forward) at {line_of('x[0, 0] = float(')} — traced live"
    )
    assert lines[-1] == "torchscope: 16 step(s) seen, 1 traced"


def test_a_one_off_loop_code_nan_is_named_and_its_weights_are_no_new_origin(tmp_path):
    """No scaler: the bad update is made. The detection names the loop's op and line; the
    weights that update wrote are what its gradients did, not the NaN come back."""
    job = ("--no-scaler", *LOOP_NAN[:4], "--steps", "16")  # once, not --persist
    proc = run("--watch", "nan", cwd=tmp_path, job=job)
    assert proc.returncode == 0, proc.stderr
    lines = said(proc)
    assert lines[1] == (
        "torchscope: NaN first appears at step 12 in torch.sqrt (forward) at "
        f"{line_of('torch.sqrt(loss - 2.0)')}, in the training loop's code — seen as the step ran"
    )
    assert not any("traced live" in s or "enters" in s for s in lines)
    assert "torchscope: NaN/Inf from step 12 lasted 4 checked steps" in lines[2]


def test_a_job_that_stops_gets_the_command_that_names_a_one_off(tmp_path):
    proc = run("--watch", "nan", "--on-nan", "stop", cwd=tmp_path, job=PREFETCH_NAN)
    assert proc.returncode == 3, proc.stderr
    hint = (
        f"torchscope: to name its op and line: torchscope run --record trace.tsc --steps 12 "
        f"{JOB} {' '.join(PREFETCH_NAN)} (the steps before it run dormant)"
    )
    assert hint in said(proc)
    assert not any("tracing the next" in s for s in said(proc))


def test_pause_in_a_traced_step_stops_at_the_origin_and_reports_one_origin(tmp_path):
    """on_nan=pause while the steps are traced live (a UI attached, --steps): the job pauses
    where the NaN first appears, and the recording holds that one origin, no second alert."""
    import torchscope

    job = ("--bad", "12", "--steps", "14")
    proc = run(
        "--steps", "0-", "--record", "t.tsc", "--watch", "nan", "--on-nan", "pause",
        "--lease", "1", cwd=tmp_path, job=job,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = said(proc)
    origin = line_of("torch.log(h)")
    (paused,) = [s for s in lines if s.startswith("torchscope: paused at")]
    assert paused.startswith(f"torchscope: paused at torch.log (after) at {origin} by breakpoint")
    assert (
        "torchscope: NaN first appears at step 12 (optimizer step 3) in torch.log (forward) in "
        f"model.blocks.1 (Block) at {origin} — traced live"
    ) in lines
    alerts = [a for a in torchscope.load(tmp_path / "t.tsc").alerts if a["where"] != "overflow"]
    assert [(a.step, a.name, a["where"]) for a in alerts] == [(12, "torch.log", "forward")]


class Sqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.fc(x) - 100.0).sum()


def test_stop_refuses_the_same_bad_update_every_time_it_is_run_again():
    """A notebook runs a stopped cell again: the same step, the same NaN, stopped again."""
    torch.manual_seed(0)
    model = Sqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(2, 4)
    lines: list[str] = []
    with NanWatch(on_nan="stop", report=lines.append):
        for attempt in range(3):
            opt.zero_grad()
            model(x).backward()
            with pytest.raises(WatchStop) as stopped:
                opt.step()
            assert stopped.value.exit_code == 3, attempt
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert lines[0].startswith("torchscope: NaN first appears at step 0 in ")
    # The stopped update did not end its step: the same step, refused again.
    assert (
        lines[1:3]
        == ["torchscope: still NaN/Inf at step 0 (first at step 0): stopped before the update"] * 2
    )
