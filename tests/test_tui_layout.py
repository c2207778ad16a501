"""The UI at every terminal size, and the review's defects (issue 12): jumps and pauses land
in view, a restarted job's alerts go, numbers are shortened (never cut), 80x24 folds its side
panels, an empty trailing step is not a step, enter on an op whose backward has not run."""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_pilot import notes_of, shows, sync, until

from torchscope.protocol.events import Event
from torchscope.protocol.tracefile import TraceWriter
from torchscope.session.format import count_text, fit_numbers
from torchscope.session.items import NewSession
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.scripted import ScriptedSource
from torchscope.tui.widgets.op_timeline import Columns

SMALL = (80, 24)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps of a 40-block MLP, NaN at step 4, and the empty step the last
    optimizer.step() opens (a step event and nothing else)."""
    path = tmp_path_factory.mktemp("tsc") / "t.tsc"
    events = make_trace(6, 40, nan_step=4)
    last = max(e["seq"] for e in events)
    events.append(Event(kind="step", seq=last + 1, step=6))
    with TraceWriter(path) as w:
        w.write(events)
    return path


# -- 2: the target row is always in view ------------------------------------------------------


@sync
async def test_alert_jump_in_a_file_lands_with_the_row_in_view(trace_file: Path):
    app = TorchscopeApp(FileSource(str(trace_file)))
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0 and app.store.alerts)
        await pilot.press("a", "enter")
        alert = app.store.alerts[0]
        tl = app.main.timeline

        def landed() -> bool:
            row = tl.current_row()
            return row is not None and row.seq == alert["event_seq"]

        await until(pilot, landed, what="the alert's op selected")

        def in_view() -> bool:  # the scroll follows the cursor at the next refresh
            top = round(tl.scroll_y)
            return top <= tl.cursor < top + tl.page_height

        await until(pilot, in_view, what=f"row {tl.cursor} scrolled into view")
        want = f"event #{alert['event_seq']}"
        await until(pilot, lambda: want in app.screen_text(), what="detail")


@sync
async def test_a_live_pause_in_a_new_step_is_scrolled_into_view_at_80x24():
    trace = make_trace(3, 30)
    seq = [e["seq"] for e in trace if e.get("step") == 2 and e.get("kind") == "op"][-5]
    app = TorchscopeApp(FakeJob(trace, pause_at=seq))
    async with app.run_test(size=SMALL) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: tl.paused_index() is not None and tl.cursor == tl.paused_index())
        await pilot.pause()
        assert app.main.current_step == 2
        top = round(tl.scroll_y)
        assert top <= tl.cursor < top + tl.page_height
        # the status bar keeps the pause and its reason at 80 columns
        status = app.main.status_bar._last
        assert "⏸ " in status and len(status) <= 78


# -- 3: a new run takes the old run's alerts with it ------------------------------------------


@sync
async def test_alerts_of_the_previous_run_go_when_the_job_starts_again():
    app = TorchscopeApp(ScriptedSource(make_trace(2, 2, nan_step=1)))
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: len(app.main.alerts.alerts) == 1)
        app.inbox.put(NewSession())
        await until(pilot, lambda: app.store.alerts == [] and app.main.alerts.option_count == 0)
        assert app.main.alerts.border_subtitle == ""


# -- 4: numbers shortened, never cut; columns from the content --------------------------------


def test_numbers_are_shortened_to_fit_never_cut():
    assert fit_numbers("norm=100.8", 10) == "norm=100.8"
    # the label stays, shortened, while digits go: a bare number reads like a value
    assert fit_numbers("norm=100.8", 8) == "norm=101"
    assert fit_numbers("norm=0.1572", 7) == "n=0.157"
    assert fit_numbers("norm=0.1572", 6) == "n=0.16"
    assert fit_numbers("norm=100.8", 4) == "101"
    assert fit_numbers("norm=nan NaN:16384", 12) == "nan NaN:16k"
    assert fit_numbers("norm=12345678.9", 8) == "n=1.23e7"
    assert count_text(16384) == "16k" and count_text(2_500_000) == "2.5M"
    for width in range(4, 24):  # a shortened number is a whole number, or an ellipsis marks it
        out = fit_numbers("norm=100.8 NaN:16384", width)
        assert len(out) <= width
        assert out.endswith("…") or "NaN:" in out


def test_columns_follow_the_content_and_keep_the_flags():
    natural = {"seq": 5, "name": 12, "module": 13, "shapes": 6, "stat": 15, "flags": 5}
    natural["source"] = 11
    wide = Columns(200, natural)
    assert wide.name == 12 and wide.module == 13 and wide.stat == 15  # no blank padding
    assert wide.spare > 0
    for width in (40, 52, 60, 80, 120):
        c = Columns(width, natural)
        assert c.flags == 5, width  # the NaN/Inf marks never vanish
        used = c.seq + 1 + c.dir + c.name + 1 + c.stat + 1 + c.flags + 1
        used += sum(w + 1 for w in (c.module, c.shapes, c.source) if w)
        assert used <= width


# -- 5: 80x24 -----------------------------------------------------------------------------------


@sync
async def test_80x24_folds_the_side_panels_and_keeps_help_and_quit():
    app = TorchscopeApp(ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"))
    async with app.run_test(size=SMALL) as pilot:
        main = app.main
        await until(pilot, lambda: main.timeline.row_count() > 0)
        assert main.has_class("-compact")
        assert main.steps.region.width == 0 and main.alerts.region.width == 0
        assert main.timeline.region.width >= 76 and main.detail.region.width >= 76
        keys = main.key_bar.text
        assert "? help" in keys and "q quit" in keys and len(keys) <= 78
        await pilot.press("a")  # the alerts column shows alone while it has the focus
        await pilot.pause()
        assert main.has_class("-side") and main.alerts.region.width >= 76
        assert main.timeline.region.width == 0
        await pilot.press("escape")
        await pilot.pause()
        assert not main.has_class("-side") and main.timeline.has_focus
        await pilot.press("plus")  # maximise the timeline
        await pilot.pause()
        assert main.maximised == "center" and main.detail.region.height == 0
        assert main.timeline.region.height >= 20
        await pilot.press("plus")
        await pilot.pause()
        assert main.maximised is None and main.detail.region.height > 0


@sync
async def test_wide_terminal_keeps_three_columns():
    app = TorchscopeApp(ScriptedSource(make_trace(2, 2), mode="replay"))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0)
        main = app.main
        assert not main.has_class("-compact")
        assert main.steps.region.width > 0 and main.detail.region.width > 0
        await pilot.press("tab")  # focus elsewhere, then maximise the detail
        main.detail.focus()
        await pilot.press("plus")
        await pilot.pause()
        assert main.maximised == "detail" and main.detail.region.width >= 196


# -- 6: the empty step the last optimizer.step() opened ---------------------------------------


@sync
async def test_an_empty_trailing_step_is_not_shown(trace_file: Path):
    app = TorchscopeApp(FileSource(str(trace_file)), at_origin=False)
    async with app.run_test(size=(120, 30)) as pilot:
        # the background count finds step 6 empty: it goes from the list
        await until(pilot, lambda: app.store.order == [0, 1, 2, 3, 4, 5], what="steps 0-5")
        assert 6 not in app.store
        await until(
            pilot,
            lambda: (
                "5" in app.main.steps.render_line(6).text
                and "6" not in app.main.steps.render_line(7).text
            ),
            what="the list redrawn without step 6",
        )
        app.main.show_step(app.store.order[-1])
        await until(
            pilot, lambda: app.main.timeline.row_count() > 0 and app.main.timeline.step == 5
        )
        assert "loading" not in await shows(pilot, "Step 5", gone=("loading",))


# -- 7: enter on an op whose backward has not run ---------------------------------------------


@sync
async def test_enter_on_an_op_before_its_backward_stays_and_says_so():
    trace = make_trace(1, 2)
    forward = [e for e in trace if e.get("kind") in ("session", "step", "op")][:6]
    app = TorchscopeApp(ScriptedSource(forward))
    notes = notes_of(app)
    async with app.run_test(size=(120, 30)) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: tl.row_count() >= 3)
        await pilot.press("home")
        row = tl.current_row()
        assert row is not None and app.store.data(0).nodes_of_op(row.seq)
        await pilot.press("enter")
        await pilot.pause()
        assert app.main.center == "timeline" and tl.has_focus
        assert any("backward has not reached" in n for n in notes)


# -- alerts that point at the cause -----------------------------------------------------------


def _knock_on_trace() -> list:
    """The review's recording in small: a NaN made at step 1, then clip_grad_norm_ reading
    the bad gradients (input alerts) and the parameters after the update, steps 1 and 2."""
    trace = make_trace(3, 2, nan_step=1)
    origin = next(e for e in trace if e.get("kind") == "alert")
    seq = max(e["seq"] for e in trace) + 1
    extra = []
    for step, count in ((1, 3), (2, 2)):
        for i in range(count):
            extra.append(
                Event(
                    kind="alert",
                    seq=seq,
                    step=step,
                    what="nan",
                    where="input",
                    event_seq=origin["event_seq"],
                    name=f"parameter blocks.{i}.fc.weight",
                    source=None,
                    message=f"NaN enters as parameter blocks.{i}.fc.weight",
                )
            )
            seq += 1
    return trace + extra


@sync
async def test_the_origin_stands_first_and_knock_on_alerts_are_counted_under_it():
    app = TorchscopeApp(ScriptedSource(_knock_on_trace(), mode="replay"))
    async with app.run_test(size=(120, 30)) as pilot:
        alerts = app.main.alerts
        await until(pilot, lambda: len(app.store.alerts) == 6)
        await pilot.pause()
        assert len(alerts.alerts) == 1 and alerts.option_count == 1
        assert alerts.alerts[0]["where"] == "forward"
        line = str(alerts.get_option_at_index(0).prompt)
        assert "+5 knock-on (steps 1-2)" in line
        tl = app.main.timeline
        await until(pilot, lambda: tl.row_count() >= 2, what="the step's rows")
        # A move made for the user (not by a key) refreshes the detail a little later; going
        # to the alerts meanwhile must keep the alert's detail.
        last = tl.row(tl.row_count() - 1)
        tl.select(last.kind, last.seq)
        await pilot.press("a")
        detail = app.main.detail.body
        await until(pilot, lambda: "knock-on" in str(detail.render()), what="the alert's detail")
        await until(pilot, lambda: not app.main._detail_pending, what="the late detail refresh")
        text = str(detail.render())
        assert "5 knock-on alerts" in text and "step 1 · 3x parameters" in text, text


@sync
async def test_a_late_detail_refresh_leaves_the_graph_nodes_detail_alone():
    # A move made for the user refreshes the detail 0.2 s later. Opening the graph meanwhile
    # (the detail now shows the graph's node) must not bring the timeline row's detail back.
    app = TorchscopeApp(ScriptedSource(make_trace(2, 2), mode="replay"))
    async with app.run_test(size=(130, 36)) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: tl.row_count() > 0, what="the step's rows")
        main = app.main  # the first row's detail (its refresh is throttled: a timer)
        await until(pilot, lambda: main.detail.subject and not main._detail_pending, what="detail")
        gelu = next(tl.row(i) for i in range(tl.row_count()) if tl.row(i).name.endswith("gelu"))
        tl.select(gelu.kind, gelu.seq)
        await pilot.press("g")
        detail = app.main.detail.body
        await until(pilot, lambda: "backward node" in str(detail.render()), what="node detail")
        await until(pilot, lambda: not app.main._detail_pending, what="the late detail refresh")
        assert app.main.center == "graph"
        assert "backward node" in str(detail.render())


@sync
async def test_a_toast_never_covers_the_status_or_key_bar(trace_file: Path):
    """A note (toast) shows above the status bar and the key bar: the pause reason and the
    keys stay readable while it is up."""
    from textual.widgets._toast import Toast

    app = TorchscopeApp(FileSource(str(trace_file)))
    async with app.run_test(size=SMALL, notifications=True) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0)
        app.notify("a note the user reads", timeout=30)

        def ours() -> list:
            text = "a note the user reads"
            return [t for t in app.screen.query(Toast) if text in str(t.render())]

        await until(pilot, lambda: bool(ours()), what="a toast")
        (toast,) = ours()
        await until(pilot, lambda: toast.region.height > 0, what="the toast laid out")
        bars = [app.main.query_one("#status").region, app.main.query_one("#keys").region]
        for shown in app.screen.query(Toast):  # any other note up meanwhile too
            for bar in bars:
                assert not shown.region.overlaps(bar), (shown.region, bar)
