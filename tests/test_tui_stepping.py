"""Step-through debugging in the UI: keys, the paused view, breakpoints, values, refusals.

Most tests drive the app with Pilot against a FakeJob (a scripted job with a simulated
stepper: commands are recorded, replies and pause/resume events simulated); one runs a real
traced job that stops where a NaN appears.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input
from tui_pilot import SIZE, notes_of, shows, sync, until

from torchscope.protocol.breakpoints import parse_break_spec
from torchscope.session.stepper_view import (
    REPLAY_REFUSAL,
    StepperView,
    spec_from_event,
    spec_text,
    tensor_choices,
)
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.screens.breakpoints import BreakHereScreen, BreakpointsScreen
from torchscope.tui.sources.base import CommandRefused
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.live import LiveSource
from torchscope.tui.sources.scripted import ScriptedSource


def paused(app: TorchscopeApp) -> dict | None:
    return app.store.stepper.paused


def paused_name(app: TorchscopeApp) -> str | None:
    p = paused(app)
    if p is None:
        return None
    ev = p["event"]
    return ev.get("name") or ev.get("node")


def detail_text(app: TorchscopeApp) -> str:
    """The detail panel's text, unwrapped (the screen wraps its long lines)."""
    d = app.main.detail
    return "\n".join(str(w.render()) for w in (d.body, d.stack_box, d.values_box) if w.display)


async def click_text(pilot, text: str) -> None:
    """Click the first place on the screen that shows ``text``."""
    pilot.app.clear_notifications()  # a toast over the text would take the click
    await pilot.pause()
    lines = pilot.app.screen_text().splitlines()
    y = next(i for i, line in enumerate(lines) if text in line)
    await pilot.click(offset=(lines[y].index(text) + 1, y))


def cmds(job: FakeJob) -> list[str]:
    return [c for c, _ in job.received]


TRACE = make_trace(2, 2)


def first_seq(name: str, step: int = 0) -> int:
    return next(
        e["seq"]
        for e in TRACE
        if e["step"] == step and (e.get("name") == name or e.get("node") == name)
    )


GELU0 = first_seq("torch.nn.functional.gelu")  # the first gelu of step 0 (seq 3)


# -- keys ------------------------------------------------------------------------------------


@sync
async def test_space_pauses_before_the_next_op_then_s_runs_it():
    # The job has run to the first gelu (its linear is the newest event) and keeps going.
    job = FakeJob(TRACE, start=next(i for i, e in enumerate(TRACE) if e["seq"] == GELU0))
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() == 1, what="first op")
        assert "space pause" in app.screen_text()  # the key bar of a live session
        await pilot.press("space")
        await until(pilot, lambda: paused(app) is not None, what="pause")
        assert cmds(job) == ["pause"]
        tl = app.main.timeline
        row = tl.current_row()
        assert row.pending and row.name == "torch.nn.functional.gelu"
        assert tl.cursor == tl.row_count() - 1 == 1
        text = await shows(
            pilot, "⏸ paused: F.gelu · blocks.0.act", "before it runs", "not run yet"
        )
        await until(pilot, lambda: "before this op runs" in detail_text(app), what="the detail")
        assert "⏸ paused: F.gelu · blocks.0.act" in text and "before it runs" in text
        assert "not run yet" in text  # the pending row's stat column
        detail = detail_text(app)
        assert "before this op runs" in detail
        assert "outputs not computed yet: paused before the op runs" in detail
        # s from a "before" point: the same op, complete
        await pilot.press("s")
        await until(pilot, lambda: paused(app) and paused(app)["reason"] == "step")
        assert cmds(job) == ["pause", "step"]
        assert paused(app)["phase"] == "after" and paused(app)["event"]["seq"] == GELU0
        assert tl.pending is None and tl.paused_key == ("op", GELU0)
        assert tl.current_row().seq == GELU0
        await shows(pilot, "⏸ stepped: F.gelu · blocks.0.act")


@sync
async def test_step_next_continue_follow_the_job_and_the_highlight_clears():
    job = FakeJob(TRACE, pause_at=GELU0)
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.main.timeline.paused_key == ("op", GELU0))
        tl = app.main.timeline
        assert tl.current_row().seq == GELU0
        await pilot.press("s")  # from an "after" point: the after of the next op
        await until(pilot, lambda: paused_name(app) == "torch.nn.functional.layer_norm")
        assert tl.current_row().name == "torch.nn.functional.layer_norm"
        await pilot.press("n")  # the first point of step 1: before its first op
        await until(pilot, lambda: paused(app) and paused(app)["reason"] == "next step")
        assert app.main.current_step == 1 and paused(app)["phase"] == "before"
        assert tl.current_row().pending
        await pilot.press("c")  # no breakpoint: runs to the end
        await until(pilot, lambda: paused(app) is None, what="resume")
        await until(pilot, lambda: app.store.info(1).n_ops > 5)
        assert tl.paused_key is None and tl.pending is None
        text = await shows(pilot, gone=("PAUSED", "⏸"))
        assert "PAUSED" not in text and "⏸" not in text
        assert cmds(job) == ["step", "next", "continue"]
        assert app.sent == [("step", {}), ("next", {}), ("continue", {})]


@sync
async def test_a_breakpoint_stops_continue_and_space_when_already_paused_says_so():
    job = FakeJob(TRACE, pause_at=GELU0, breakpoints=[{"op": "^AddmmBackward0$"}])
    app = TorchscopeApp(job)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        await pilot.press("space")
        assert "already paused" in notes[-1] and job.received == []
        await pilot.press("c")
        await until(pilot, lambda: paused_name(app) == "AddmmBackward0")
        p = paused(app)
        assert p["phase"] == "before" and p["reason"] == "breakpoint 1"
        row = app.main.timeline.current_row()
        assert row.pending and row.kind == "grad"
        await shows(pilot, "1 breakpoint")
        await until(pilot, lambda: "before this node runs" in detail_text(app), what="the detail")
        # before a node runs: the gradient that arrived, and what it will send is not known
        text = detail_text(app)
        assert "before this node runs" in text and "grad_outputs — what arrived" in text
        assert "not computed yet: paused before the node runs" in text
        await pilot.press("s")
        await until(pilot, lambda: paused(app)["phase"] == "after")
        await until(pilot, lambda: "grad_inputs — what it sends on" in detail_text(app))
        text = detail_text(app)
        assert "grad_inputs — what it sends on" in text and "not computed" not in text
        assert paused(app)["event"]["seq"] == first_seq("AddmmBackward0")


@sync
async def test_paused_detail_shows_the_call_stack_innermost_first(tmp_path: Path):
    # A job whose source file is here: the stack shows each line's text.
    script = tmp_path / "train.py"
    script.write_text("".join(f"line {i}\n" for i in range(1, 130)))
    events = [dict(e) for e in TRACE]
    for e in events:
        if isinstance(e.get("source"), str):
            e["source"] = e["source"].replace("/work/job/train.py", str(script))
    job = FakeJob(events, pause_at=GELU0)
    job_stack = None
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        job_stack = paused(app)["stack"]
        stack = app.main.detail.stack_box
        await until(pilot, lambda: stack.display and "call stack" in str(stack.render()))
        text = str(stack.render())
    assert job_stack[0][0] == str(script) and job_stack[0][1] == 21
    lines = text.splitlines()
    assert "call stack" in lines[0] and "innermost first" in lines[0]
    assert "train.py:21 in forward" in lines[1] and "▶" in lines[1]
    assert lines[2].strip() == "line 21"
    assert "train.py:88 in train_step" in text and "train.py:120 in <module>" in text
    assert text.index(":21 in") < text.index(":88 in") < text.index(":120 in")


@sync
async def test_refusals_from_the_job_are_notifications_not_crashes():
    job = FakeJob(TRACE, pause_at=GELU0, refuse={"step": "the job is not paused"})
    app = TorchscopeApp(job)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        await pilot.press("s")
        await until(pilot, lambda: notes, what="a notification")
        assert notes == ["step: the job is not paused"]
        assert app.is_running and paused(app) is not None
        app.command("break_delete", bp=42)
        await until(pilot, lambda: len(notes) == 2)
        assert notes[1] == "break_delete: no breakpoint 42"
        await pilot.press("c")
        await until(pilot, lambda: paused(app) is None)
        await pilot.press("v")  # nothing paused: nothing to fetch
        assert "values come from a paused job" in notes[-1]
        assert app.is_running and app.fatal is None


# -- values ----------------------------------------------------------------------------------


@sync
async def test_inspect_values_on_demand_and_paging_through_a_big_tensor():
    trace = make_trace(1, 2, batch=64)  # [64, 32] activations: 2048 values, three pages
    gelu = next(e["seq"] for e in trace if e.get("name") == "torch.nn.functional.gelu")
    job = FakeJob(trace, pause_at=gelu)
    app = TorchscopeApp(job)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        await until(pilot, lambda: "v: fetch" in app.screen_text(), what="the values hint")
        assert job.received == []  # on demand only

        def shown(start: int) -> bool:
            v = app.main.values
            return v is not None and v.result is not None and v.result["start"] == start

        await pilot.press("v")
        await until(pilot, lambda: shown(0), what="first slice")
        assert job.received[-1] == (
            "inspect",
            {"group": "outputs", "index": 0, "start": 0, "count": 1000},
        )
        await until(pilot, lambda: "[0:1,000] of 2,048" in app.screen_text(), what="shown")
        text = app.screen_text()
        assert "outputs[0] [64,32] float32 · 2,048 values" in text
        assert "[0:1,000] of 2,048" in text and "0.8415" in text  # sin(1)
        await click_text(pilot, "next ▶")  # the "buttons" are links in the text
        await until(pilot, lambda: shown(1000))
        await pilot.press("full_stop")
        await until(pilot, lambda: shown(2000))
        assert len(app.main.values.result["values"]) == 48
        await until(pilot, lambda: "[2,000:2,048] of 2,048" in app.screen_text(), what="shown")
        n = len(job.received)
        await pilot.press("greater_than_sign")  # no page after the last
        assert "last slice" in notes[-1] and len(job.received) == n
        await pilot.press("less_than_sign")
        await until(pilot, lambda: shown(1000))
        # v again: the next tensor (after the outputs: back to the inputs), first page
        await pilot.press("v")
        await until(pilot, lambda: shown(0) and app.main.values.label() == "inputs[0]")
        starts = [(f["group"], f["start"]) for c, f in job.received if c == "inspect"]
        assert starts == [
            ("outputs", 0),
            ("outputs", 1000),
            ("outputs", 2000),
            ("outputs", 1000),
            ("inputs", 0),
        ]
        # A step ends the pause: its values go with it.
        await pilot.press("s")
        await until(pilot, lambda: paused(app) and paused(app)["reason"] == "step")
        await until(
            pilot,
            lambda: app.main.values is None or app.main.values.result is None,
            what="the old pause's values to go",
        )


# -- breakpoints -----------------------------------------------------------------------------


@sync
async def test_b_makes_a_breakpoint_from_the_selected_event():
    job = FakeJob(TRACE, pause_at=GELU0)
    app = TorchscopeApp(job)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        await pilot.press("b")
        assert isinstance(app.screen, BreakHereScreen)
        text = app.screen_text()
        assert "Breakpoint at F.gelu" in text
        assert "op:^torch\\.nn\\.functional\\.gelu$" in text
        assert "module:^blocks\\.0\\.act$" in text and "line:train.py:21" in text
        await pilot.press("enter")  # the first choice: same op name
        await until(pilot, lambda: len(job.breakpoints) == 1)
        assert not isinstance(app.screen, BreakHereScreen)
        await pilot.press("b", "down", "n", "enter")  # same module AND nan
        await pilot.press("b", "down", "down", "enter")  # same source line
        await pilot.press("b", "escape")  # cancelled: nothing sent
        await until(pilot, lambda: len(job.breakpoints) == 3)
        await shows(pilot, "3 breakpoints")  # the three replies reached the store
        adds = [f for c, f in job.received if c == "break_add"]
        assert adds == [
            {"op": "^torch\\.nn\\.functional\\.gelu$"},
            {"module": "^blocks\\.0\\.act$", "nan": "nan"},
            {"source": "/work/job/train.py:21"},
        ]
        assert notes[0] == "breakpoint 1: op:^torch\\.nn\\.functional\\.gelu$"
        assert "3 breakpoints" in app.screen_text()
        # c: the breakpoints stop the job again, at the next gelu (its name), then before its
        # backward node (its line). A node's module is that of the op that made it.
        await pilot.press("c")
        await until(pilot, lambda: paused(app)["event"].get("module") == "blocks.1.act")
        await pilot.press("c")
        await until(pilot, lambda: paused_name(app) == "GeluBackward0")
        assert paused(app)["reason"] == "breakpoint 3"
        await pilot.press("b")
        text = app.screen_text()
        assert "Breakpoint at GeluBackward0" in text and "op:^GeluBackward0$" in text
        assert "module:^blocks\\.1\\.act$" in text
        await pilot.press("escape")


@sync
async def test_breakpoint_list_add_toggle_delete_and_bad_conditions():
    job = FakeJob(TRACE, pause_at=GELU0, breakpoints=[{"nan": "nan"}])
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        await pilot.press("B")
        assert isinstance(app.screen, BreakpointsScreen)
        screen = app.screen
        await until(pilot, lambda: app.store.stepper.breakpoints, what="break_list")
        await until(pilot, lambda: re.search(r"│\s+1\s+✓\s+1\s+nan\s", app.screen_text()))
        text = app.screen_text()
        assert "condition" in text and "hits" in text
        assert re.search(r"│\s+1\s+✓\s+1\s+nan\s", text)  # id, enabled, hits, condition
        assert cmds(job) == ["break_list"]
        # bad input: the one-line error, nothing sent
        assert screen.query_one(Input).has_focus  # typing goes to the box from the start
        await pilot.press(*"op:(", "enter")
        await until(pilot, lambda: "bad op" in str(screen.query_one("#bpl-error").render()))
        error = str(screen.query_one("#bpl-error").render())
        assert "bad op regex '('" in error
        box = screen.query_one(Input)
        box.value = "bogus"  # (typing is tested above; each key press costs a frame)
        await pilot.press("enter")
        await until(
            pilot,
            lambda: (
                "bad breakpoint condition 'bogus'" in str(screen.query_one("#bpl-error").render())
            ),
        )
        assert cmds(job) == ["break_list"]
        # a good one
        box.value = "module:^blocks\\.1\\.,nan"
        await pilot.press("enter")
        await until(pilot, lambda: len(app.store.stepper.breakpoints) == 2)
        # space in the (now empty) box acts on the list, as the hint says; in a box with
        # text it is a character
        assert box.has_focus and box.value == ""
        await pilot.press("space")
        await until(pilot, lambda: app.store.stepper.breakpoints[0]["enabled"] is False)
        box.value = "op:x"
        box.cursor_position = len(box.value)
        await pilot.press("space")
        await until(pilot, lambda: box.value == "op:x ")
        box.value = ""
        await pilot.press("space")
        await until(pilot, lambda: app.store.stepper.breakpoints[0]["enabled"] is True)
        screen.query_one("#bpl-table").focus()
        await pilot.pause()  # the focus moves (a message)
        assert ("break_add", {"module": "^blocks\\.1\\.", "nan": "nan"}) in job.received
        await shows(pilot, "nan,module:^blocks\\.1\\.")
        assert str(screen.query_one("#bpl-error").render()) == ""
        # toggle (the cursor is on the first), then delete it
        await pilot.press("space")
        await until(pilot, lambda: app.store.stepper.breakpoints[0]["enabled"] is False)
        await until(pilot, lambda: re.search(r"│\s+1\s+✗\s+1\s+nan\s", app.screen_text()))
        await pilot.press("space")
        await until(pilot, lambda: app.store.stepper.breakpoints[0]["enabled"] is True)
        await pilot.press("delete")  # asks first
        await until(
            pilot,
            lambda: (
                "delete breakpoint 1 (nan)? delete again"
                in str(screen.query_one("#bpl-error").render())
            ),
        )
        assert "break_delete" not in cmds(job)
        await pilot.press("delete")
        await until(pilot, lambda: [b["id"] for b in app.store.stepper.breakpoints] == [2])
        assert job.received[-1] == ("break_delete", {"bp": 1})
        assert [c for c, _ in job.received if c == "break_enable"] == ["break_enable"] * 4
        await pilot.press("ctrl+z")  # undo: the same condition again
        await until(pilot, lambda: len(app.store.stepper.breakpoints) == 2)
        assert job.received[-1] == ("break_add", {"nan": "nan"})
        await pilot.press("escape")
        assert not isinstance(app.screen, BreakpointsScreen)
        await shows(pilot, "2 breakpoints")


@sync
async def test_breakpoint_list_letters_go_to_the_box_never_to_the_list():
    # The review: with the list focused, "step:2" + enter disabled breakpoint 2 (e) and
    # "gradnorm:100,step:3" deleted one (d). Letters now always land in the input box.
    job = FakeJob(TRACE, pause_at=GELU0, breakpoints=[{"nan": "nan"}, {"op": "^gelu$"}])
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None)
        await pilot.press("B")
        screen = app.screen
        assert isinstance(screen, BreakpointsScreen)
        await until(pilot, lambda: len(app.store.stepper.breakpoints) == 2)
        screen.query_one("#bpl-table").focus()
        await pilot.pause()
        await pilot.press(*"gradnorm:100,step:3", "enter")
        await until(pilot, lambda: len(app.store.stepper.breakpoints) == 3)
        assert job.received[-1] == ("break_add", {"grad_norm": 100.0, "step": 3})
        assert [c for c, _ in job.received if c in ("break_enable", "break_delete")] == []
        assert all(b.get("enabled", True) for b in app.store.stepper.breakpoints)


# -- replay ----------------------------------------------------------------------------------


@sync
async def test_replay_still_refuses_what_needs_the_job():
    app = TorchscopeApp(ScriptedSource(make_trace(1, 1), mode="replay"))
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0)
        await pilot.press("space")  # pauses the recording at the selected row
        await until(pilot, lambda: paused(app) is not None, what="the cursor placed")
        for key in ("v", "at", "E"):
            await pilot.press(key)
        assert notes[0] == REPLAY_REFUSAL and all("needs a live job" in n for n in notes[1:])
        assert len(notes) == 3
        assert app.screen is app.main and app.sent == [] and app.is_running
    with pytest.raises(CommandRefused, match="replay: the job is not running"):
        FileSource("nowhere.tsc").command("pause")
    with pytest.raises(CommandRefused):
        ScriptedSource([]).command("step")


@sync
async def test_a_recording_steps_like_a_live_job(tmp_path):
    """A recording with alerts opens paused at its first origin; a nan breakpoint and c land
    on it again; s / S move one event; a name breakpoint, then c, lands on its next hit and C
    back on the one before; n goes to the next step's first event."""
    from test_tui_replay_stepping import NAN_STEP, record

    path = record(tmp_path / "run.tsc")
    app = TorchscopeApp(FileSource(path))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: paused(app) is not None, timeout=60, what="opened paused")
        assert paused_name(app) == "torch.sqrt" and app.main.current_step == NAN_STEP
        assert paused(app)["reason"] == "origin"
        await until(pilot, lambda: "NaN first appears: torch.sqrt" in app.screen_text())
        origin = paused(app)["event"]["seq"]
        tl = app.main.timeline
        await until(pilot, lambda: tl.current_row() is not None and tl.current_row().seq == origin)
        await pilot.press("S", "S")
        await until(pilot, lambda: paused(app)["event"]["seq"] != origin, what="back")
        await add_breakpoint(pilot, app, "nan")
        await pilot.press("c")
        await until(pilot, lambda: paused(app)["event"]["seq"] == origin, what="at the origin")
        assert paused_name(app) == "torch.sqrt" and app.main.current_step == NAN_STEP
        await until(pilot, lambda: tl.current_row() is not None and tl.current_row().seq == origin)
        await pilot.press("s")
        await until(pilot, lambda: paused(app)["event"]["seq"] != origin, what="one step")
        assert paused(app)["reason"] == "step"
        after = paused(app)["event"]["seq"]
        assert tl.current_row().seq == after
        await pilot.press("S")
        await until(pilot, lambda: paused(app)["event"]["seq"] == origin, what="one back")
        # a breakpoint on the loss's op, with the nan one off
        await add_breakpoint(pilot, app, "op:^Tensor\\.mean$")
        await pilot.press("B")
        await until(pilot, lambda: isinstance(app.screen, BreakpointsScreen), what="B")
        await pilot.press("space")  # the box is empty: toggles the first (nan) breakpoint
        await until(pilot, lambda: not app.store.stepper.breakpoints[0]["enabled"])
        await pilot.press("escape")
        await pilot.press("c")
        await until(pilot, lambda: paused_name(app) == "Tensor.mean", what="the hit")
        assert paused(app)["reason"] == "breakpoint 2" and app.main.current_step == NAN_STEP
        await pilot.press("c")
        await until(pilot, lambda: app.main.current_step == NAN_STEP + 1, what="the next hit")
        assert paused_name(app) == "Tensor.mean"
        await pilot.press("C")
        await until(pilot, lambda: app.main.current_step == NAN_STEP, what="back")
        await pilot.press("n")
        await until(pilot, lambda: app.main.current_step == NAN_STEP + 1, what="next step")
        assert paused(app)["reason"] == "next step"
        assert ("break_add", {"op": "^Tensor\\.mean$"}) in app.sent


async def add_breakpoint(pilot, app: TorchscopeApp, text: str) -> None:
    """Through the B screen, as a user adds one."""
    await pilot.press("B")
    await until(pilot, lambda: isinstance(app.screen, BreakpointsScreen), what="B")
    n = len(app.store.stepper.breakpoints)
    app.screen.query_one(Input).value = text
    await pilot.press("enter")
    await until(pilot, lambda: len(app.store.stepper.breakpoints) == n + 1, what="added")
    await pilot.press("escape")
    await until(pilot, lambda: app.screen is app.main, what="back")


# -- the live source's command path (a fake client) ------------------------------------------


class FakeClient:
    """SessionClient's surface: records requests; the job is paused from the start."""

    calls: list[tuple[str, dict]] = []
    alive = True

    def connect(self, target, timeout):
        return {"session": {"pid": 7, "kind": "session", "seq": 0}, "step": 0}

    def snapshot(self, n, timeout):
        return {"events": [dict(e) for e in TRACE[:5]]}

    def recv(self, timeout_ms):
        time.sleep(timeout_ms / 1000)
        return []

    def request(self, cmd: str, timeout: float = 2.0, **fields: Any) -> dict:
        from torchscope.protocol.client import SessionRefused

        self.calls.append((cmd, fields))
        if cmd == "ping":
            return {"t": 0.0}
        if cmd == "break_add":
            raise SessionRefused("break_add: bad op regex '(': missing ), unterminated subpattern")
        ev = dict(TRACE[4])  # the first layer_norm: the newest event of the snapshot
        paused = {"phase": "after", "event": ev, "reason": "paused", "stack": [], "since": 1.0}
        return {"state": {"paused": paused, "mode": "run", "breakpoints": []}}

    def close(self):
        pass


@sync
async def test_live_source_asks_state_on_connect_pings_and_relays_refusals():
    FakeClient.calls = []
    source = LiveSource("ipc://job", client_factory=FakeClient, recv_timeout_ms=10)
    source.ping_seconds = 0.1
    app = TorchscopeApp(source)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        # Paused before the UI came: known from the state asked right after connecting.
        await until(pilot, lambda: paused(app) is not None, what="state on connect")
        assert FakeClient.calls[0] == ("state", {})
        await until(pilot, lambda: app.main.timeline.paused_key == ("op", TRACE[4]["seq"]))
        await until(pilot, lambda: source.pings >= 3, what="pings")
        app.command("break_add", op="(")
        await until(pilot, lambda: notes)
        assert notes == ["break_add: bad op regex '(': missing ), unterminated subpattern"]
        await pilot.press("c")
        await until(pilot, lambda: ("continue", {}) in FakeClient.calls)
        await pilot.press("q")
    names = {c for c, _ in FakeClient.calls}
    # arm on connect (the UI holds the job traced) and ask its run's history, disarm on quit
    assert names == {"state", "arm", "history", "ping", "break_add", "continue", "disarm"}
    assert FakeClient.calls[-1] == ("disarm", {})


def test_live_source_refuses_commands_while_not_connected():
    from torchscope.session.inbox import Inbox
    from torchscope.session.items import Refused

    class Never:
        def connect(self, target, timeout):
            raise ConnectionError("no session")

        def close(self):
            pass

    import threading

    source = LiveSource("ipc://nowhere", client_factory=Never, retry_seconds=0.02)
    inbox, stop = Inbox(), threading.Event()
    token = source.command("pause")
    worker = threading.Thread(target=source.run, args=(inbox, stop))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        refused = []
        while not refused and time.monotonic() < deadline:
            refused = [i for i in inbox.drain() if isinstance(i, Refused)]
            time.sleep(0.01)
    finally:
        stop.set()
        worker.join(30)
    assert refused == [Refused(token, "pause", {}, "not connected to the job at ipc://nowhere")]


# -- the UI-side model -----------------------------------------------------------------------


def test_spec_text_reads_back_with_parse_break_spec():
    specs = [
        {"nan": "nan"},
        {"op": "^torch\\.log$", "nan": "inf"},
        {"module": "^blocks\\.3\\.", "source": "train.py:20", "step": 2},
        {"grad_norm": 1000.0, "from_step": 5, "nan": "anynan"},
    ]
    for spec in specs:
        assert parse_break_spec(spec_text(spec)) == spec
    ev = {"kind": "op", "name": "torch.log", "module": "", "source": "/j/x.py:5"}
    assert spec_from_event(ev, "op", nan=True) == {"op": "^torch\\.log$", "nan": "nan"}
    assert spec_from_event(ev, "module") is None
    assert spec_from_event(ev, "source") == {"source": "/j/x.py:5"}
    node = {"kind": "grad", "node": "AddmmBackward0", "source": None}
    assert spec_from_event(node, "op") == {"op": "^AddmmBackward0$"}
    assert spec_from_event(node, "source") is None


def test_tensor_choices_follow_the_phase():
    s = {"shape": [2], "dtype": "float32"}
    op = {"kind": "op", "inputs": [s, s], "outputs": [s]}
    grad = {"kind": "grad", "grad_outputs": [s], "grad_inputs": [None, s]}
    choices = tensor_choices({"phase": "after", "event": op})
    assert [(g, i) for g, i, _ in choices] == [("inputs", 0), ("inputs", 1), ("outputs", 0)]
    assert [(g, i) for g, i, _ in tensor_choices({"phase": "before", "event": op})] == [
        ("inputs", 0),
        ("inputs", 1),
    ]
    after = tensor_choices({"phase": "after", "event": grad})
    assert [(g, i) for g, i, _ in after] == [("grad_outputs", 0), ("grad_inputs", 1)]


def test_stepper_view_orders_stream_events_and_ignores_stale_replies():
    view = StepperView()
    ev = {"kind": "op", "name": "torch.log", "seq": 4}
    pause = {"kind": "pause", "seq": 10, "step": 0, "phase": "after", "event": ev}
    assert view.on_pause_event({**pause, "reason": "breakpoint 1", "since": 1.0})
    # a state reply composed an instant before the job recorded the pause says "not paused"
    assert view.on_state({"paused": None, "mode": "run", "breakpoints": []}) == (False, False)
    assert view.paused is not None
    # the same pause seen again (a snapshot overlapping the stream): nothing changes
    assert not view.on_pause_event({**pause, "since": 1.0})
    assert view.on_resume_event({"kind": "resume", "seq": 11, "by": "continue"})
    assert view.paused is None and view.resumed_by == "continue"
    # a reply still showing the pause that just ended is stale
    old = {"phase": "after", "event": ev, "reason": "breakpoint 1", "since": 1.0}
    assert view.on_state({"paused": old}) == (False, False)
    assert view.paused is None
    # a pause only a reply knows of (the UI joined late) is taken, and dropped by the next
    # reply that says the job runs
    new = {**old, "since": 2.0}
    assert view.on_state({"paused": new, "breakpoints": [{"id": 1, "nan": "nan"}]}) == (
        True,
        True,
    )
    assert view.on_state({"paused": None}) == (True, False) and view.paused is None


# -- a real job ------------------------------------------------------------------------------

NAN_JOB = """\
import torch
torch.manual_seed(0)
x = torch.randn(4, 3, requires_grad=True)
for step in range(3):
    y = torch.log(x - 10.0)
    y.sum().backward()
print("finished", flush=True)
"""


@sync
async def test_a_real_job_paused_at_a_nan_step_then_continue(tmp_path: Path):
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    script = tmp_path / "nanjob.py"
    script.write_text(NAN_JOB)
    run = ["run", "--break-on", "nan", "--lease", "60", str(script)]
    job = subprocess.Popen(
        [sys.executable, "-m", "torchscope", *run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        app = TorchscopeApp(LiveSource(str(job.pid), retry_seconds=0.1))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: paused(app) is not None, timeout=60, what="the NaN pause")
            await until(pilot, lambda: app.main.timeline.paused_key is not None)
            assert paused_name(app) == "torch.log" and paused(app)["phase"] == "after"
            text = await shows(
                pilot,
                "⏸ NaN first appears: torch.log · nanjob.py:5 · ",
                "y = torch.log(x - 10.0)",
                "call stack",
            )
            assert "⏸ NaN first appears: torch.log · nanjob.py:5 · " in text
            assert "nanjob.py:5" in text and "y = torch.log(x - 10.0)" in text
            assert "call stack" in text
            first = paused(app)["since"]
            await pilot.press("s")
            await until(pilot, lambda: paused(app) and paused(app)["since"] != first, timeout=30)
            assert paused_name(app) == "Tensor.sum" and paused(app)["reason"] == "step"
            assert app.main.timeline.current_row().name == "Tensor.sum"
            # c: the NaN comes again in each of the 3 iterations; continue until the job ends
            for _ in range(6):
                since = paused(app)["since"] if paused(app) else None
                await pilot.press("c")
                await until(
                    pilot,
                    lambda since=since: (
                        job.poll() is not None
                        or (paused(app) is not None and paused(app)["since"] != since)
                    ),
                    timeout=30,
                )
                if job.poll() is not None:
                    break
            out, err = job.communicate(timeout=30)
            assert job.returncode == 0, err[-2000:]
            assert "finished" in out
            await until(pilot, lambda: app.status.get("state") == "ended", timeout=10)
            assert paused(app) is None and app.main.timeline.paused_key is None
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(60)


def test_the_pause_story_says_why_and_where_in_one_line():
    from torchscope.session.stepper_view import StepperView, pause_story

    view = StepperView()
    view.breakpoints = [{"id": 1, "nan": "nan"}, {"id": 2, "op": "^torch\\.sqrt$"}]

    def summary(value, nan=0):
        return {"shape": [], "values": [value], "stats": {"norm": abs(value), "nan": nan}}

    sqrt = {
        "kind": "op",
        "name": "torch.sqrt",
        "module": "blocks.0.attn",
        "source": "/home/u/job.py:29",
        "inputs": [summary(-84.0)],
        "outputs": [summary(float("nan"), nan=1)],
    }
    pause = {"reason": "breakpoint 1", "phase": "after", "event": sqrt}
    assert pause_story(pause, view) == (
        "NaN first appears: torch.sqrt · blocks.0.attn · job.py:29 · -84 → nan NaN:1"
    )
    # NaN in and out: the value arrived, it was not made here
    carried = dict(sqrt, inputs=[summary(float("nan"), nan=1)])
    assert pause_story(dict(pause, event=carried), view).startswith("NaN here: torch.sqrt")
    by_name = {"reason": "breakpoint 2", "phase": "before", "event": sqrt}
    assert pause_story(by_name, view) == (
        "breakpoint 2 (op:^torch\\.sqrt$): torch.sqrt · blocks.0.attn · job.py:29 · before it runs"
    )
    node = {
        "kind": "grad",
        "node": "MulBackward0",
        "grad_outputs": [summary(2.0)],
        "grad_inputs": [summary(4.0)],
    }
    assert pause_story({"reason": "step", "phase": "after", "event": node}) == (
        "stepped: MulBackward0 · 2 → 4"
    )


def test_a_nan_pause_says_so_before_the_ui_has_the_jobs_breakpoints():
    """The pause carries the breakpoint that made it: the first words are right even when
    the state reply with the job's list of breakpoints has not arrived."""
    from torchscope.session.stepper_view import StepperView, pause_story

    log = {
        "kind": "op",
        "name": "torch.log",
        "source": "/home/u/job.py:5",
        "inputs": [{"shape": [], "values": [-10.0], "stats": {"norm": 10.0}}],
        "outputs": [{"shape": [], "values": [float("nan")], "stats": {"nan": 1}}],
    }
    pause = {"reason": "breakpoint 1", "phase": "after", "event": log}
    assert pause_story(pause, StepperView()).startswith("breakpoint 1: torch.log")
    told = {**pause, "breakpoint": {"id": 1, "nan": "nan"}}
    assert pause_story(told, StepperView()).startswith("NaN first appears: torch.log")
