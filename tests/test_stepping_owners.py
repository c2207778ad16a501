"""Every pause and breakpoint has an owner; a job waiting for anything says so at once.

In-process, like tests/test_stepping.py: the traced "training" runs on a worker thread and
the test thread plays the control thread (client ids are what the publisher passes).
"""

from __future__ import annotations

import time

import torch
from test_stepping import Job, StepperClock

from torchscope.protocol.breakpoints import parse_break_spec


def three_steps() -> list[float]:
    import torchscope

    x = torch.ones(3)
    out = []
    for _ in range(3):
        y = torch.log(x - 2.0)  # NaN every step
        out.append(float(y.sum().nan_to_num()))
        torchscope.step()
    return out


def test_a_command_line_breakpoint_with_no_ui_says_where_at_once_and_is_rate_limited(capsys):
    job = Job(three_steps, breakpoints=[parse_break_spec("nan")], lease=0.3)
    job.start()
    point = job.wait_paused()
    err = capsys.readouterr().err
    assert "paused at torch.log (after) at " in err and "by breakpoint 1" in err
    assert "resumes in 0.3 s" in err
    job.finish()
    err = capsys.readouterr().err
    # One 0.3 s stall, then the breakpoint is quiet while nobody is attached: the two next
    # NaN steps run through.
    assert job.stepper.auto_resumed == 1
    assert "with no UI attached, breakpoint 1 pauses again at most once every 60 s" in err
    assert point["by"] == "command line"


def test_hold_waits_for_a_ui_past_the_lease(capsys, monkeypatch):
    job = Job(three_steps, breakpoints=[parse_break_spec("nan")], lease=0.2)
    job.stepper.hold = True
    clock = StepperClock(job, monkeypatch)
    job.start()
    point = job.wait_paused()
    assert "waits for a UI (--hold)" in capsys.readouterr().err
    clock.pass_time(0.6)  # three leases
    assert job.stepper.paused is not None and job.stepper.auto_resumed == 0
    job.stepper.contact(b"ui")
    job.stepper.request_continue(b"ui")
    job.wait_running(point)
    job.stepper.detach()
    job.finish()


def test_wait_says_it_waits_then_runs_once_a_ui_connects(capsys, monkeypatch):
    job = Job(three_steps, wait=True, lease=0.2)
    clock = StepperClock(job, monkeypatch)
    job.start()
    point = job.wait_paused()
    assert point["reason"] == "waiting for a UI"
    assert "waiting for a UI before the first op (--wait)" in capsys.readouterr().err
    clock.pass_time(0.5)  # the lease does not apply before a UI came
    assert job.stepper.paused is not None
    job.stepper.contact(b"ui")  # a UI connects: the job runs, no continue needed
    assert job.finish() == [0.0, 0.0, 0.0]


def test_a_pause_belongs_to_the_ui_that_asked_and_goes_with_it():
    job = Job(three_steps, stepping=True, lease=30)
    job.stepper.contact(b"ui-a")
    job.stepper.contact(b"ui-b")
    job.stepper.request_pause(b"ui-a")
    job.start()
    point = job.wait_paused()
    assert point["by"] == "a UI"
    job.stepper.contact(b"ui-b")  # another UI is alive: not the owner's lease
    job.stepper.release(b"ui-b")  # that one leaving changes nothing
    # the paused thread still runs what its owner asks: had ui-b's leaving ended the pause,
    # the task would be refused ("the job went on before it ran")
    task = job.stepper.run_at_pause(lambda p: {"at": p.reason}, b"ui-a", wait=60)
    assert task.finished.is_set() and task.result == {"at": "paused"}, vars(task)
    assert job.stepper.paused is not None
    job.stepper.release(b"ui-a")  # the owner leaves: its pause ends
    job.finish()
    resumes = [e for e in job.tracer.trace.events if e.kind == "resume"]
    assert [e.by for e in resumes] == ["left"]


def test_a_pause_lasts_as_long_as_its_owner_talks_not_anyone_else():
    job = Job(three_steps, stepping=True, lease=0.3)
    job.stepper.contact(b"ui-a")
    job.stepper.request_pause(b"ui-a")
    job.start()
    job.wait_paused()
    deadline = time.monotonic() + 30  # the 0.3 s lease runs out
    while time.monotonic() < deadline and job.stepper.paused is not None:
        job.stepper.contact(b"ui-b")  # a second UI pinging does not keep ui-a's pause
        time.sleep(0.05)
    assert job.stepper.paused is None and job.stepper.auto_resumed == 1
    job.stepper.detach()
    job.finish()


def test_op_durations_exclude_time_spent_paused():
    job = Job(three_steps, breakpoints=[parse_break_spec("op:^torch.log$")], lease=0.4)
    job.start()
    job.finish()
    logs = [e for e in job.tracer.trace.ops if e.name == "torch.log"]
    assert job.stepper.auto_resumed >= 1
    assert logs and all(e.duration_us < 100_000 for e in logs), [e.duration_us for e in logs]


def test_the_job_says_on_stderr_when_a_ui_pauses_it_and_when_it_goes_on():
    """Once per pause a UI holds (not at each op it steps over), and when the UI lets go."""
    import threading

    from torchscope.tracer.stepper import PausePoint, Stepper

    notes: list[str] = []
    stepper = Stepper(lease_seconds=30, note=notes.append)
    stepper.contact(b"ui")

    def point(reason: str) -> PausePoint:
        return PausePoint("before", {"kind": "op", "name": "F.relu", "seq": 7}, {}, [], reason)

    results: list[str] = []
    for reason, let_go in (
        ("paused", lambda: stepper.request_step(b"ui")),
        ("step", lambda: stepper.request_continue(b"ui")),
    ):
        t = threading.Thread(target=lambda r=reason: results.append(stepper.at_point(point(r))))
        t.start()
        deadline = time.monotonic() + 60
        while stepper.paused is None and time.monotonic() < deadline:
            time.sleep(0.01)
        let_go()
        t.join(60)
    assert results == ["step", "continue"]
    assert len(notes) == 1 and notes[0].startswith("paused at ")
    assert notes[0].endswith("at a UI's request (a UI holds it)")  # not "by paused"
    # the pause by "step" was the UI's own stepping: said nothing, and its end neither
    t = threading.Thread(target=lambda: results.append(stepper.at_point(point("breakpoint 1"))))
    t.start()
    deadline = time.monotonic() + 60
    while stepper.paused is None and time.monotonic() < deadline:
        time.sleep(0.01)
    stepper.request_continue(b"ui")
    t.join(60)
    assert notes[1:] == [notes[1], "resumed: the UI continued"]
    assert notes[1].endswith("by breakpoint 1 (a UI holds it)")
