"""``p`` and ``e`` in the UI: a real job paused at an op (its answers come from the job's
training thread), and a recording (answers from what it kept; ``e`` refused: nothing to
change). Every wait is a condition (``until``), never a fixed sleep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tui_pilot import SIZE, notes_of, sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.live import LiveSource

RELU_JOB = """\
import torch
torch.manual_seed(0)
x = torch.randn(2, 4)
y = torch.relu(x)
print("sum", float((y * 2).sum()), flush=True)
"""


def paused(app: TorchscopeApp) -> dict | None:
    return app.store.stepper.paused


async def ask(pilot, app: TorchscopeApp, notes: list[str], text: str) -> str:
    """Type ``text`` in the open ``p`` box, enter, and wait for the answer's note."""
    n = len(notes)
    app.main.filter.value = text
    await pilot.press("enter")
    await until(pilot, lambda: len(notes) > n and notes[-1].startswith(text), what=text)
    return notes[-1]


@sync
async def test_p_and_e_on_a_live_job_at_its_pause(tmp_path: Path):
    pytest.importorskip("zmq")
    script = tmp_path / "relu_job.py"
    script.write_text(RELU_JOB)
    run = ["run", "--break-on", r"op:^torch\.relu$", "--lease", "60", str(script)]
    job = subprocess.Popen(
        [sys.executable, "-m", "torchscope", *run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        app = TorchscopeApp(LiveSource(str(job.pid), retry_seconds=0.1))
        notes = notes_of(app)
        async with app.run_test(size=SIZE) as pilot:
            main = app.main
            await until(pilot, lambda: paused(app) is not None, what="the pause before relu")
            assert paused(app)["phase"] == "before"
            await pilot.press("p")
            await until(pilot, lambda: main.filter.display and main.filter.mode.name == "evaluate")
            note = await ask(pilot, app, notes, "args[0].shape")
            assert note == "args[0].shape = torch.Size([2, 4])"
            note = await ask(pilot, app, notes, "x.nope")
            assert "AttributeError" in note and "\n" not in main.filter.border_title
            await pilot.press("up", "up")  # the history, newest first
            assert main.filter.value == "args[0].shape"
            await pilot.press("down", "down")
            assert main.filter.value == ""
            await pilot.press("escape")
            # e before the op ran: refused in the box, in one line
            since = paused(app)["since"]
            await pilot.press("s")
            await until(pilot, lambda: paused(app) and paused(app)["since"] != since, what="s")
            assert paused(app)["phase"] == "after"
            tl = main.timeline
            await until(pilot, lambda: tl.current_row() and main.is_paused_row(tl.current_row()))
            await pilot.press("p")
            note = await ask(pilot, app, notes, "out.min()")
            assert note.startswith("out.min() = 0")
            await pilot.press("escape", "e")
            await until(pilot, lambda: main.filter.display and main.filter.mode.name == "edit")
            main.filter.value = "x[0]"
            await pilot.press("enter")
            await until(pilot, lambda: "edit refused" in main.filter.border_title, what="refusal")
            assert "shape [4] is not outputs[0]'s [2, 4]" in main.filter.border_title
            main.filter.value = "x * 0"
            await pilot.press("enter")
            await until(pilot, lambda: any(n.startswith("edited ") for n in notes), what="edit")
            await until(pilot, lambda: len(app.store.edits) == 1, what="the edit event")
            await until(
                pilot,
                lambda: "numbers changed by hand" in main.status_bar.full_text,
                what="the status bar",
            )
            edit = app.store.edits[0]
            assert edit["expr"] == "x * 0" and edit["target"] == "outputs[0]"
            await until(pilot, lambda: edit["at"] in (main.timeline.data.edit_seqs or ()))
            await pilot.press("c")
            out, err = job.communicate(timeout=120)
            assert job.returncode == 0, err[-2000:]
            assert "sum 0.0" in out  # relu's output was zeroed before the next op read it
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


@sync
async def test_p_and_e_on_a_recording(tmp_path: Path):
    script = tmp_path / "relu_job.py"
    script.write_text(RELU_JOB)
    path = tmp_path / "edited.tsc"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torchscope", "run", "--no-live", "--record", str(path)),
            *("--edit", r"op:^torch\.relu$", "out * 0", str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and "sum 0.0" in done.stdout, done.stderr
    dump = subprocess.run(
        [sys.executable, "-m", "torchscope", "dump", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "EDIT  torch.relu at " in dump.stdout and "outputs[0] <- out * 0" in dump.stdout
    plain = tmp_path / "plain.tsc"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torchscope",
            "run",
            "--no-live",
            "--record",
            str(plain),
            str(script),
        ],
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
        check=True,
    )
    diff = subprocess.run(
        [sys.executable, "-m", "torchscope", "diff", str(plain), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert diff.returncode == 1  # diverged: B's relu output was zeroed
    assert "B was changed by hand: step 0 torch.relu outputs[0] <- out * 0" in diff.stdout

    app = TorchscopeApp(FileSource(path), at_origin=False)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await until(pilot, lambda: main.current_step == 0 and main.timeline.row_count() > 0)
        await until(pilot, lambda: len(app.store.edits) == 1, what="the recorded edit")
        await until(pilot, lambda: "numbers changed by hand" in main.status_bar.full_text)
        relu = app.store.edits[0]["at"]
        await pilot.press("colon", *f"#{relu}", "enter")
        await until(pilot, lambda: main.timeline.current_row().seq == relu, what="relu's row")
        assert relu in main.timeline.data.edit_seqs
        await pilot.press("p")
        note = await ask(pilot, app, notes, "out.shape")
        assert note == "out.shape = torch.Size([2, 4])"
        main.filter.value = "out.abs().argmax()"  # needs the tensor: said plainly
        await pilot.press("enter")
        await until(pilot, lambda: "a recording keeps" in main.filter.border_title)
        await pilot.press("escape", "space")  # a recording pauses where the cursor is
        await until(pilot, lambda: paused(app) is not None, what="the replay's pause")
        await pilot.press("e")
        await until(pilot, lambda: any("cannot be changed" in n for n in notes), what="refusal")
        assert not main.filter.display


@sync
async def test_a_breakpoint_with_an_action_from_the_breakpoint_list():
    """``B``, then a condition ending with ``,log:EXPR``: the job gets a breakpoint with an
    action (it logs at each hit instead of pausing), listed as it was typed."""
    from torchscope.session.stepper_view import spec_text
    from torchscope.tui.demo.fakejob import FakeJob
    from torchscope.tui.demo.synthetic import make_trace
    from torchscope.tui.screens.breakpoints import BreakpointsScreen

    job = FakeJob(make_trace(steps=1))
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0, what="rows")
        await pilot.press("B")
        await until(pilot, lambda: isinstance(app.screen, BreakpointsScreen), what="B")
        box = app.screen.query_one("#bpl-input")
        box.value = r"node:^MulBackward0$,log:grad_inputs[0, :8]"
        await pilot.press("enter")
        await until(pilot, lambda: any(c == "break_add" for c, _ in app.sent), what="sent")
        (fields,) = [f for c, f in app.sent if c == "break_add"]
        assert fields["node"] == "^MulBackward0$" and fields["log"] == "grad_inputs[0, :8]"
        assert spec_text(fields) == r"node:^MulBackward0$,log:grad_inputs[0, :8]"
