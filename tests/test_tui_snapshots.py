"""Snapshot tests of the main screen, the detail of a backward node and the graph view.

Deterministic: synthetic events (no timestamps), replay mode, fixed terminal size. Update with
``pytest tests/test_tui_snapshots.py --snapshot-update`` after checking the new SVGs by eye.
"""

from __future__ import annotations

import pytest
from tui_pilot import until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource

pytest.importorskip("pytest_textual_snapshot")

SIZE = (130, 36)


def app(at_origin: bool = False) -> TorchscopeApp:
    """The synthetic recording; from its first step unless ``at_origin`` (a user's default)."""
    return TorchscopeApp(
        ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"), at_origin=at_origin
    )


def detail_shows_row(a: TorchscopeApp, row=None) -> bool:
    """The detail panel shows ``row`` (the timeline's cursor row by default): a row the
    cursor reached without a key press is shown by a throttled refresh (a timer)."""
    main = a.main
    row = row if row is not None else main.timeline.current_row()
    subject = main.detail.subject
    return (
        not main._detail_pending
        and row is not None
        and subject is not None
        and subject[:2] == ("row", row.seq)
    )


def loaded(step: int = 0):
    async def run_before(pilot) -> None:
        a = pilot.app
        await until(pilot, lambda: len(a.store.order) == 3 and a.main.current_step is not None)
        if step != a.main.current_step:
            a.main.show_step(step)
        await until(pilot, lambda: a.main.timeline.row_count() > 0)
        await until(pilot, lambda: detail_shows_row(a), what="the throttled detail refresh")

    return run_before


def on_row(name: str, step: int = 0):
    async def run_before(pilot) -> None:
        await loaded(step)(pilot)
        tl = pilot.app.main.timeline
        index = next(i for i in range(tl.row_count()) if tl.row(i).name == name)
        tl.move_cursor(index, user=True, center=True)
        await until(pilot, lambda: detail_shows_row(pilot.app, tl.row(index)), what="detail")

    return run_before


def test_main_screen(snap_compare):
    assert snap_compare(app(), terminal_size=SIZE, run_before=loaded())


def test_a_recording_opens_paused_at_its_first_origin(snap_compare):
    async def run_before(pilot) -> None:
        a = pilot.app
        await until(pilot, lambda: a.store.stepper.paused is not None)
        await until(pilot, lambda: "NaN first appears" in a.screen_text())
        await until(pilot, lambda: detail_shows_row(a), what="the throttled detail refresh")

    assert snap_compare(app(at_origin=True), terminal_size=SIZE, run_before=run_before)


def test_detail_of_a_backward_node_with_a_none_gradient(snap_compare):
    # blocks.0.fc's AddmmBackward0 sends None to the data input: shown as None, explicitly.
    async def run_before(pilot) -> None:
        await loaded()(pilot)
        tl = pilot.app.main.timeline
        index = max(i for i in range(tl.row_count()) if tl.row(i).name == "AddmmBackward0")
        tl.move_cursor(index, user=True, center=True)
        detail = pilot.app.main.detail
        detail.focus()
        await until(pilot, lambda: detail_shows_row(pilot.app, tl.row(index)) and detail.has_focus)
        await until(pilot, lambda: detail.max_scroll_y > 0, what="the detail laid out")
        detail.scroll_end(animate=False)
        await until(pilot, lambda: detail.scroll_y == detail.max_scroll_y, what="scrolled")

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_graph_view(snap_compare):
    assert snap_compare(
        app(), terminal_size=SIZE, run_before=on_row("torch.nn.functional.gelu"), press=["g"]
    )


def test_alert_step_and_help(snap_compare):
    assert snap_compare(app(), terminal_size=SIZE, run_before=loaded(1), press=["question_mark"])


# -- a live job, paused (a FakeJob: scripted events, simulated stepper) ----------------------


def paused_app(pause_name: str, phase: str = "after", **kw) -> TorchscopeApp:
    from torchscope.tui.demo.fakejob import FakeJob

    trace = make_trace(2, 2, **kw)
    seq = next(e["seq"] for e in trace if (e.get("name") or e.get("node")) == pause_name)
    job = FakeJob(trace, pause_at=seq, phase=phase, breakpoints=[{"op": pause_name}])
    a = TorchscopeApp(job)
    a.rate.rate = lambda now=None: 0.0  # events per second depend on timing
    return a


def when_paused(*keys: str):
    async def run_before(pilot) -> None:
        a = pilot.app
        await until(pilot, lambda: a.main.timeline.paused_index() is not None)
        for key in keys:
            await pilot.press(key)
        if keys:
            await until(pilot, lambda: a.main.values is not None and a.main.values.result)
        await until(
            pilot,
            lambda: (
                detail_shows_row(a)
                and (not keys or a.main.detail.values_version == a.main.values.version)
            ),
            what="the detail of the pause",
        )

    return run_before


def test_paused_before_a_backward_node(snap_compare):
    # The pending row (the node has not run), the gradient that arrived, the call stack.
    assert snap_compare(
        paused_app("AddmmBackward0", phase="before"),
        terminal_size=SIZE,
        run_before=when_paused(),
    )


def test_paused_after_an_op_with_values(snap_compare):
    assert snap_compare(
        paused_app("torch.nn.functional.gelu", batch=64),
        terminal_size=SIZE,
        run_before=when_paused("v"),
    )


# -- every terminal size: the docs' pictures come from these (python docs/generate.py) -------


def test_main_screen_at_80x24(snap_compare):
    assert snap_compare(app(), terminal_size=(80, 24), run_before=loaded(1))


def test_main_screen_at_200x50(snap_compare):
    assert snap_compare(
        app(), terminal_size=(200, 50), run_before=on_row("torch.nn.functional.linear", 1)
    )


# -- focus and colours at 256 and 16 colours (tmux without COLORTERM, TERM=screen) -----------
# snap_compare exports truecolor SVGs (App.export_screenshot); this app quantises every
# colour of the screenshot as Rich does for such a terminal (Color.downgrade), so the SVG shows
# what the terminal gets: unfocused borders and titles, the focused panel, the cursor rows.


def downgraded_app(system: str) -> TorchscopeApp:
    import io
    from pathlib import Path

    from rich.color import ColorSystem
    from rich.console import Console
    from rich.segment import Segment
    from rich.style import Style

    from torchscope.tui import app as app_module

    color_system = {"256": ColorSystem.EIGHT_BIT, "16": ColorSystem.STANDARD}[system]
    cache: dict[Style, Style] = {}

    def downgrade(style: Style) -> Style:
        if style not in cache:
            cache[style] = style + Style(
                color=style.color.downgrade(color_system) if style.color else None,
                bgcolor=style.bgcolor.downgrade(color_system) if style.bgcolor else None,
            )
        return cache[style]

    class Quantised:
        def __init__(self, renderable) -> None:
            self.renderable = renderable

        def __rich_console__(self, console, options):
            for seg in console.render(self.renderable, options):
                if seg.style is not None and not seg.control:
                    seg = Segment(seg.text, downgrade(seg.style), seg.control)
                yield seg

    class DowngradedApp(TorchscopeApp):
        CSS_PATH = Path(app_module.__file__).with_name("app.tcss")

        def export_screenshot(self, *, title: str | None = None, simplify: bool = False) -> str:
            width, height = self.size
            console = Console(
                width=width,
                height=height,
                file=io.StringIO(),
                force_terminal=True,
                color_system="truecolor",
                record=True,
                legacy_windows=False,
                safe_box=False,
            )
            update = self.screen._compositor.render_update(
                full=True, screen_stack=self._background_screens, simplify=simplify
            )
            console.print(Quantised(update))
            return console.export_svg(title=title or self.title)

    return DowngradedApp(
        ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"), at_origin=False
    )


@pytest.mark.parametrize("system", ["256", "16"])
def test_main_screen_colours(snap_compare, system):
    # the timeline has the focus: accent border, bold title, bright cursor row; the steps and
    # the alerts do not: grey border, plain title, muted cursor row
    assert snap_compare(downgraded_app(system), terminal_size=SIZE, run_before=loaded(1))
