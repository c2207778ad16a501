"""The history view as a user reaches it in the real app: a live job is asked for its run's
history when it says hello, ``H`` opens the view, and arming from it goes to the job."""

from __future__ import annotations

from test_tui_history import history_event, points_wire
from tui_pilot import sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.screens.history import HistoryScreen
from torchscope.tui.sources.scripted import ScriptedSource

SIZE = (120, 40)


def sent(app: TorchscopeApp, cmd: str) -> list[dict]:
    return [fields for c, fields in app.sent if c == cmd]


@sync
async def test_a_live_job_is_asked_for_its_history_and_H_arms_it_at_a_step():
    trace = make_trace(2, 2)
    # the job ran 80 steps before this UI attached; the agent's history holds them
    job = FakeJob(trace, history=points_wire(range(80)))
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0, what="the job's events")
        # asked as the job said hello, before anything of its history was known
        await until(pilot, lambda: job.queries == [("history", {})], what="history asked")
        await until(pilot, lambda: len(app.store.history) == 80, what="the reply taken")
        assert app.store.history.latest().loss == 80.0  # points_wire: loss = 1 + step
        await pilot.press("H")
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen), what="H")
        await pilot.press("a")
        await until(pilot, lambda: app.screen.query("Input").first().display, what="the input")
        field = app.screen.query("Input").first()
        field.value = "150"
        await pilot.press("enter")
        await until(pilot, lambda: sent(app, "arm") != [], what="arm sent")
        assert sent(app, "arm") == [{"at_step": 150}]
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what="back")


@sync
async def test_H_on_a_recording_shows_its_history_and_says_arming_needs_a_job():
    trace = make_trace(2, 2)
    seq = max(e["seq"] for e in trace) + 1
    trace.append(history_event(points_wire(range(3)), seq))
    app = TorchscopeApp(ScriptedSource(trace, mode="replay"))
    notes: list[str] = []
    app.notify = lambda message, *a, **k: notes.append(str(message))  # type: ignore[method-assign]
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(app.store.history) == 3, what="the recorded history")
        await pilot.press("H")
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen), what="H")
        await pilot.press("a")
        await pilot.pause()
        assert sent(app, "arm") == []
        assert "needs a live job" in app.screen_text() + " ".join(notes)
