"""The run's history in the UI: the store takes ``history`` events (live, replies, files), the
step list holds every step of the run, the plot draws loss and |g| in braille (cells, log
scale, zoom, pan, cursor), the heatmap names the first module to blow up, and the history
screen posts ArmAtStep/ArmWhen. The screen is pushed by a small harness app here (the main
screen's wiring comes separately); snapshots at 80x24 and 200x50 as in test_tui_snapshots.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from textual import events, on
from textual.app import App, ComposeResult
from tui_pilot import sync, until

from torchscope.protocol.history import HISTORY, RunHistory, StepPoint
from torchscope.session.items import HistoryBatch, Reply, WholeStep
from torchscope.session.rows import prepare
from torchscope.session.store import EventStore
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.screens.history import NEEDS_LIVE, ArmAtStep, ArmWhen, HistoryScreen
from torchscope.tui.sources.scripted import ScriptedSource
from torchscope.tui.widgets.history_plot import (
    BRAILLE,
    DOTS,
    GUTTER,
    HistoryPlot,
    bin_series,
    draw,
    scale_of,
)
from torchscope.tui.widgets.module_heatmap import ModuleHeatmap, first_blow_up
from torchscope.tui.widgets.step_list import StepList

TCSS = Path(__file__).resolve().parents[1] / "torchscope" / "tui" / "app.tcss"
MODULES = [f"blocks.{i}.fc" for i in range(6)]


# -- data ----------------------------------------------------------------------------------------
def points_wire(steps, loss=lambda s: 1.0 + s, norm=lambda s: 0.5, **kw) -> list[dict]:
    return [StepPoint(s, loss=loss(s), grad_norm=norm(s), **kw).to_wire() for s in steps]


def history_event(points: list[dict], seq: int, buckets: list[dict] | None = None) -> dict:
    return {"kind": HISTORY, "seq": seq, "step": points[-1]["step"] if points else 0,
            "points": points, "buckets": buckets or []}  # fmt: skip


def run_history(n: int = 2000, blow: int = 1500, keep: int = 1500) -> RunHistory:
    """A deterministic run: the loss decays, |g| wobbles; at ``blow`` blocks.3.fc's norm (and
    the global one) jumps to 1e5, three steps later it and |g| are Inf/NaN and the loss NaN.
    Steps older than ``keep`` are folded into 50-step buckets."""
    h = RunHistory(keep=keep, bucket=50)
    for i in range(n):
        loss = 2.5 * math.exp(-i / 400) + 0.1 + 0.02 * math.sin(i / 7)
        g = 1 + 0.3 * math.sin(i / 13)
        mods = {m: 0.1 * (k + 1) * (1 + 0.2 * math.sin(i / (5 + k))) for k, m in enumerate(MODULES)}
        if i >= blow:
            late = i >= blow + 3
            mods["blocks.3.fc"] = math.nan if late else 1e5
            g = math.inf if late else 1e5
            loss = math.nan if late else loss
        h.add(StepPoint(i, loss=loss, grad_norm=g, module_norms=mods, traced=i % 500 == 0))
    return h


def store_with(hist: RunHistory, *, live: bool = True) -> EventStore:
    store = EventStore(live=live)
    store.take_history(hist.to_wire())
    return store


# -- harnesses -----------------------------------------------------------------------------------
class ScreenHarness(App[None]):
    """Pushes the history screen over a store; keeps the messages it posts."""

    CSS_PATH = str(TCSS)
    ENABLE_COMMAND_PALETTE = False

    def __init__(
        self,
        store: EventStore,
        *,
        live: bool = True,
        job_step: int | None = None,
        step: int | None = None,
    ):
        super().__init__()
        self.store = store
        self.live = live
        self.job_step = job_step
        self.step = step
        self.armed: list[tuple[str, object]] = []

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return TorchscopeApp.get_theme_variable_defaults(self)  # type: ignore[arg-type]

    def on_mount(self) -> None:
        self.push_screen(
            HistoryScreen(self.store, live=self.live, job_step=self.job_step, step=self.step)
        )

    @on(ArmAtStep)
    def _at(self, message: ArmAtStep) -> None:
        self.armed.append(("at", message.step))

    @on(ArmWhen)
    def _when(self, message: ArmWhen) -> None:
        self.armed.append(("when", message.condition))


class WidgetHarness(App[None]):
    """One widget at an exact size, no border (cells are where the tests expect them)."""

    CSS_PATH = str(TCSS)

    def __init__(self, widget, width: int, height: int) -> None:
        super().__init__()
        self.widget = widget
        widget.styles.width = width
        widget.styles.height = height
        widget.styles.min_height = 0  # exactly ``height``, even below the widget's minimum
        self.moved: list[int] = []
        self.views: list[tuple[int, int]] = []
        self.blow_ups: list[tuple[int, str]] = []

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return TorchscopeApp.get_theme_variable_defaults(self)  # type: ignore[arg-type]

    def compose(self) -> ComposeResult:
        yield self.widget

    def on_mount(self) -> None:
        self.widget.focus()

    @on(HistoryPlot.CursorMoved)
    def _moved(self, message: HistoryPlot.CursorMoved) -> None:
        self.moved.append(message.step)

    @on(HistoryPlot.ViewChanged)
    def _view(self, message: HistoryPlot.ViewChanged) -> None:
        self.views.append((message.start, message.end))

    @on(ModuleHeatmap.BlowUpSelected)
    def _blow_up(self, message: ModuleHeatmap.BlowUpSelected) -> None:
        self.blow_ups.append((message.step, message.module))


def lines(widget) -> list[str]:
    return [widget.render_line(y).text for y in range(widget.size.height)]


# -- the store -----------------------------------------------------------------------------------
def test_the_store_takes_history_events_replies_and_file_loads():
    store = EventStore(live=True)
    ch = store.ingest([history_event(points_wire(range(0, 5)), seq=1)])
    assert ch.history and ch.steps_added and store.history_version == 1
    assert [p.step for p in store.history.points] == [0, 1, 2, 3, 4]
    assert store.history.points[2].loss == 3.0 and store.history.points[2].grad_norm == 0.5
    assert store.order == [] and store.steps == {}  # not a step's event: no step row of its own
    assert store.history_index.steps == [0, 1, 2, 3, 4]

    # the next live batch appends, and the index follows it
    store.ingest([history_event(points_wire(range(5, 8)), seq=2)])
    assert store.history_index.steps == list(range(8))
    assert store.history_index.loss.xs == list(range(8))

    # the attach reply (the whole history) after live events: merged by step, in order
    reply = {"points": points_wire(range(0, 10), loss=lambda s: 10.0 + s), "buckets": []}
    ch = store.apply([Reply(7, HISTORY, {}, reply)])
    assert ch.history
    assert [p.step for p in store.history.points] == list(range(10))
    assert store.history.points[3].loss == 13.0  # the newer word on a step wins
    assert store.history_index.steps == list(range(10))

    # a source's HistoryBatch item (a file's count pass) and a loaded step of a file
    store.apply([HistoryBatch({"points": points_wire([10, 11])})])
    trace = make_trace(1, 1)
    items = prepare([history_event(points_wire([12]), seq=3), *trace])
    store.apply([WholeStep(0, items)])
    assert store.history_index.steps == list(range(13))
    # the step loaded again (evicted, then viewed): its history is held already, no rebuild
    index, version = store.history_index, store.history_version
    ch = store.apply([WholeStep(0, prepare([history_event(points_wire([12]), seq=3), *trace]))])
    assert not ch.history and store.history_index is index and store.history_version == version
    counted = [e for e in trace if e["kind"] != "session"]
    assert store.steps[0].n_events == len(counted)  # the history event is not the step's


def test_the_history_index_follows_folding_and_rewrites():
    store = EventStore(live=True)
    store.history = RunHistory(keep=50, bucket=10)
    for first in range(0, 120, 15):
        store.take_history({"points": points_wire(range(first, first + 15))})
    index, hist = store.history_index, store.history
    assert index.steps == [p.step for p in hist.points] == list(range(70, 120))
    assert index.loss.xs == index.steps and index.loss.ys == [1.0 + s for s in index.steps]
    assert index.buckets is hist.buckets and index.first_step == 0 and index.last_step == 119
    # the newest point sent again with its norm (the watch's comes later): replaced, not added
    store.take_history({"points": points_wire([119], norm=lambda s: math.nan)})
    assert index.steps[-1] == 119 and len(index.steps) == 50
    assert index.grad_norm.bad_xs == [119] and 119 not in index.grad_norm.xs


def test_module_series_keep_only_the_history_window():
    store = EventStore()
    store.history = RunHistory(module_keep=100)
    store.take_history({"points": points_wire(range(300), module_norms={"a": 1.0})})
    assert store.history_index.module_series()["a"].xs == list(range(200, 300))
    store.take_history({"points": points_wire(range(300, 350), module_norms={"a": 2.0})})
    a = store.history_index.module_series()["a"]
    assert a.xs == list(range(250, 350)) and a.ys[-1] == 2.0


# -- the step list -------------------------------------------------------------------------------
GAPPY = {0: 151, 1: 152, 2: 164, 3: 165, 4: 167}


def gappy_trace() -> list:
    out = []
    for ev in make_trace(len(GAPPY), 2):
        if ev.get("kind") != "session":
            ev["step"] = GAPPY[ev["step"]]
        out.append(ev)
    return out


def row_text(steps: StepList, index: int, width: int = 40) -> str:
    return "".join(t for t, _ in steps.render_row(index, width))


@sync
async def test_the_step_list_holds_the_history_steps_with_their_values():
    # History for 0..160 but 100..104 (say the agent lost them), the trace 151..167.
    have = [s for s in range(161) if not 100 <= s <= 104]
    hist = history_event(points_wire(have, norm=lambda s: 2.0 if s != 152 else 7.5), seq=10_000)
    app = TorchscopeApp(ScriptedSource([*gappy_trace(), hist], mode="replay"))
    async with app.run_test(size=(120, 40)) as pilot:
        steps = app.main.steps
        await until(pilot, lambda: len(app.store.order) == 5 and app.store.history_version > 0)
        # 154 history rows (156 points, 2 of them traced), 5 traced, 3 gaps
        await until(pilot, lambda: steps.row_count() == 162, what="the rows")
        # 0..99 history, gap of 5, 105..150 history, 151 152 traced, 153..160 history,
        # gap of 3, 164 165 traced, gap of 1, 167
        kinds = []
        for i in range(steps.row_count()):
            if steps.gap_at(i) is not None:
                kinds.append(("gap", steps.gap_at(i)))
            elif steps.step_at(i) is not None:
                kinds.append(("traced", steps.step_at(i)))
            else:
                kinds.append(("history", steps.history_at(i).step))
        assert kinds[:101] == [("history", s) for s in range(100)] + [("gap", 5)]
        assert kinds[101:147] == [("history", s) for s in range(105, 151)]
        assert kinds[147:149] == [("traced", 151), ("traced", 152)]
        assert kinds[149:157] == [("history", s) for s in range(153, 161)]
        assert kinds[157:] == [("gap", 3), ("traced", 164), ("traced", 165), ("gap", 1),
                               ("traced", 167)]  # fmt: skip
        text = row_text(steps, 42)
        assert text.split()[:2] == ["42", "43"] and text.split()[2].startswith("2")
        assert "not traced" in text
        assert steps.row_step(42) == 42 and steps.step_at(42) is None
        # a traced step the trace gave no |g| for shows the history's
        assert app.store.steps[152].grad_norm is None
        assert "7.5" in row_text(steps, 148)
        assert "not traced" not in row_text(steps, 148)
        # a jump lands on the traced step's row; the cursor can rest on a history row
        app.main.show_step(164)
        await until(pilot, lambda: steps.cursor == 158, what="the cursor on 164")
        steps.focus()
        await until(pilot, lambda: steps.has_focus)
        await pilot.press("up")  # over the gap row, onto history step 160
        await until(pilot, lambda: steps.cursor == 156, what="the cursor on 160")
        assert steps.history_at(steps.cursor).step == 160
        assert app.main.current_step == 164  # nothing to show for a step never traced

        # live: the next history event adds rows at the end
        app.source.feed([history_event(points_wire([168, 169]), seq=10_001)])
        await until(pilot, lambda: steps.row_count() == 164, what="two more rows")
        assert steps.history_at(steps.row_count() - 1).step == 169


@sync
async def test_the_cursor_stays_on_its_step_and_in_view_when_history_rows_come_before_it():
    # A recording opened on a late step: its rows come first, the run's history after.
    app = TorchscopeApp(ScriptedSource(gappy_trace(), mode="replay"))
    async with app.run_test(size=(120, 40)) as pilot:
        steps = app.main.steps
        await until(pilot, lambda: len(app.store.order) == 5, what="the traced steps")
        app.main.show_step(164)
        await until(pilot, lambda: steps.current_step == 164, what="the cursor on 164")
        app.source.feed([history_event(points_wire(range(161)), seq=10_000)])
        await until(pilot, lambda: steps.row_count() > 160, what="the history's rows")
        assert steps.current_step == 164 and app.main.current_step == 164
        await until(pilot, steps.cursor_visible, what="164's row in view")


def test_the_step_list_sees_each_history_that_replaces_the_last():
    # Out of order, a history is merged into a fresh index each time: two of them between
    # two looks at the list still change its rows.
    store = EventStore()
    steps = StepList()
    steps.bind_store(store)
    store.take_history({"points": points_wire(range(50, 60))})
    assert steps.row_count() == 10
    for k in range(1, 20):
        store.take_history({"points": points_wire([50 - 2 * k + 1])})
        store.take_history({"points": points_wire([50 - 2 * k])})
        assert steps.row_count() == 10 + 2 * k
        assert steps.row_step(0) == 50 - 2 * k


@sync
async def test_the_step_list_shows_folded_buckets_as_ranges_and_stays_fast():
    store = EventStore(live=True)
    store.history = RunHistory(keep=100_000, bucket=100)
    n = 150_000
    pts = [StepPoint(s, loss=2.0, grad_norm=1.0 if s != 20_050 else math.nan) for s in range(n)]
    store.history.buckets.clear()
    wire = {"points": [p.to_wire() for p in pts]}
    t = time.perf_counter()
    store.take_history(wire)
    taken = time.perf_counter() - t
    steps = StepList()
    app = WidgetHarness(steps, 60, 20)
    async with app.run_test(size=(80, 24)) as pilot:
        steps.bind_store(store)
        t = time.perf_counter()
        count = steps.row_count()
        built = time.perf_counter() - t
        steps.refresh_rows()
        await pilot.pause()
        folded = len(store.history.buckets)
        assert folded == 500 and count == folded + 100_000
        assert len(steps._segs) == folded + 1  # one run for the 100k steps: no row objects
        b = steps.bucket_at(200)
        assert (b.first, b.last) == (20_000, 20_099)
        text = row_text(steps, 200, 60)
        assert text.startswith("▤ 20000..20099") and "loss 2..2" in text and "nan" in text
        assert steps.history_at(folded).step == 50_000
        assert steps.history_at(count - 1).step == n - 1
        print(f"take_history {taken * 1000:.0f} ms, step list layout {built * 1000:.1f} ms")


# -- the plot ------------------------------------------------------------------------------------
def cell(*dots: tuple[int, int]) -> str:
    """The braille character with dots (x, y) set."""
    return chr(BRAILLE + sum(DOTS[x][y] for x, y in dots))


RAMP = "⠀⠀" + cell((0, 3), (1, 2)) + cell((0, 1), (1, 0))  # top row of an 8-step ramp
RAMP_LOW = cell((0, 3), (1, 2)) + cell((0, 1), (1, 0)) + "⠀⠀"  # its bottom row


def plot_of(values: list[float], **kw) -> HistoryPlot:
    store = EventStore()
    store.take_history({"points": [StepPoint(s, loss=v, **kw).to_wire() for s, v in
                                   enumerate(values)]})  # fmt: skip
    return HistoryPlot(store.history_index)


@sync
async def test_the_plot_maps_values_to_braille_dots():
    # 8 steps, loss = step: 4 cells (8 dot columns, one a step) by 2 rows (8 dot rows, linear:
    # the value k on dot row 7 - k), so the ramp climbs one dot per step, two per cell.
    plot = plot_of([float(k) for k in range(8)])
    app = WidgetHarness(plot, GUTTER + 4, 4)
    async with app.run_test(size=(40, 10)) as pilot:
        await until(pilot, lambda: plot.size.width == GUTTER + 4 and plot.cursor == 7)
        text = lines(plot)
        assert text[0].startswith("step 7")  # the readout, cut to the width
        assert text[1] == "      7┤" + RAMP
        assert text[2] == "      0┤" + RAMP_LOW
        assert text[3].split() == ["0", "7"]  # the step axis
        assert plot.logs == {"loss": False}


def test_columns_bin_steps_show_ranges_and_mark_nan():
    store = EventStore()
    store.history = RunHistory(keep=6, bucket=4)
    values = [1.0, 5.0, 2.0, 3.0, 4.0, math.nan, 6.0, 7.0, 8.0, 9.0]
    store.take_history({"points": [StepPoint(s, loss=v).to_wire() for s, v in enumerate(values)]})
    index = store.history_index
    assert [(b.first, b.last) for b in index.buckets] == [(0, 3)] and index.steps[0] == 4
    cols = bin_series(index.loss, index.buckets, "loss", 0, 10, 5)
    # two steps a column; steps 0-3 come from the bucket (min 1, max 5: a range)
    assert [(c.lo, c.hi, c.bad, c.folded) for c in cols] == [
        (1.0, 5.0, False, True),
        (1.0, 5.0, False, True),
        (4.0, 4.0, True, False),
        (6.0, 7.0, False, False),
        (8.0, 9.0, False, False),
    ]
    lo, hi, log, floor = scale_of(cols, "auto")
    assert (lo, hi, log) == (1.0, 9.0, False)
    # the bucket's two dot columns: 5 down to 1 is dot rows 4 to 7 (of 8), every dot there
    bits = draw(cols[:2], 2, lo, hi, log, floor)
    assert bits == [[0x00], [0xFF]]

    # a NaN folded into a bucket: somewhere in its steps, so one mark where the bucket starts
    store = EventStore()
    store.history = RunHistory(keep=4, bucket=8)
    values = [1.0, 2.0, math.nan, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    store.take_history({"points": [StepPoint(s, loss=v).to_wire() for s, v in enumerate(values)]})
    index = store.history_index
    assert [(b.first, b.last) for b in index.buckets] == [(0, 7)]
    cols = bin_series(index.loss, index.buckets, "loss", 0, 12, 6)
    assert [c.bad for c in cols] == [True, False, False, False, False, False]
    # the bucket keeps NaN as its max: what is left finite is its min and last (both 1)
    assert (cols[1].lo, cols[1].hi) == (1.0, 1.0)


@sync
async def test_the_plot_goes_log_past_two_decades_and_l_toggles_it():
    # 1e-2 .. 1e5 over 8 steps: one decade a step, a straight line on a log scale
    plot = plot_of([10.0 ** (k - 2) for k in range(8)])
    app = WidgetHarness(plot, GUTTER + 4, 4)
    async with app.run_test(size=(40, 10)) as pilot:
        await until(pilot, lambda: plot.size.width == GUTTER + 4 and plot.cursor == 7)
        text = lines(plot)
        assert plot.logs == {"loss": True}
        assert text[1] == "  1e+05┤" + RAMP and text[2] == "   0.01┤" + RAMP_LOW
        await pilot.press("l")
        await until(pilot, lambda: plot.log_mode == "linear" and plot.logs == {"loss": False})
        # linear: 0.01..1e3 all on the bottom dot row, 1e4 one above, 1e5 at the top (its
        # column joined down to 1e4's)
        low = lines(plot)[2][GUTTER:]
        assert low == cell((0, 3), (1, 3)) * 3 + cell((0, 2), (1, 0), (1, 1))
        await pilot.press("l")
        await until(pilot, lambda: plot.logs == {"loss": True})
        assert lines(plot)[1:3] == text[1:3]


@sync
async def test_zoom_and_pan_by_keys_and_mouse_change_the_steps_shown():
    plot = plot_of([1.0 + (s % 10) for s in range(1000)], grad_norm=1.0)
    app = WidgetHarness(plot, GUTTER + 50, 12)
    async with app.run_test(size=(80, 20)) as pilot:
        await until(pilot, lambda: plot.size.width == GUTTER + 50 and plot.view == (0, 1000))
        assert plot.cursor == 999
        await pilot.press("home")
        await until(pilot, lambda: plot.cursor == 0)
        await pilot.press("plus")  # zoom in around the cursor: it stays where it was
        await until(pilot, lambda: plot.view == (0, 500), what="zoomed in")
        await pilot.press("right_square_bracket")  # pan a quarter of the view on
        await until(pilot, lambda: plot.view == (125, 625), what="panned")
        assert plot.cursor == 0  # panning moves the view, not the cursor
        await pilot.press("minus")
        await until(pilot, lambda: plot.view[1] - plot.view[0] == 1000, what="zoomed out")
        assert plot.view == (0, 1000)  # clamped to the run
        await pilot.press("plus", "plus", "0")
        await until(pilot, lambda: plot.view == (0, 1000), what="the whole run again")
        assert (0, 250) in app.views  # ViewChanged messages said so

        # the wheel zooms around the step under the mouse: step 500 stays under x
        x = GUTTER + 25
        under = plot.step_at_x(x)
        plot.post_message(events.MouseScrollUp(plot, x, 3, 0, 1, 0, False, False, False))
        await until(pilot, lambda: plot.view[1] - plot.view[0] == 500, what="wheel zoom")
        assert abs(plot.step_at_x(x) - under) <= 10
        before = plot.view
        # a drag to the left by 10 cells shows later steps (10 cells of 10 steps)
        await pilot.mouse_down(plot, offset=(x, 3))
        await pilot.hover(plot, offset=(x - 10, 3))
        await pilot.mouse_up(plot, offset=(x - 10, 3))
        await until(pilot, lambda: plot.view == (before[0] + 100, before[1] + 100), what="drag")
        # a click puts the cursor on the step under it
        await pilot.click(plot, offset=(GUTTER + 5, 3))
        await until(pilot, lambda: plot.cursor == plot.view[0] + 5 * 10, what="click")


@sync
async def test_the_cursor_moves_by_columns_and_reads_its_step():
    values = [1.0 + s / 100 for s in range(400)]
    plot = plot_of(values, grad_norm=3.0)
    app = WidgetHarness(plot, GUTTER + 40, 10)
    async with app.run_test(size=(80, 20)) as pilot:
        await until(pilot, lambda: plot.size.width == GUTTER + 40 and plot.cursor == 399)
        await pilot.press("home")
        await until(pilot, lambda: plot.cursor == 0)
        await pilot.press("right", "right")  # a cell is 10 steps here
        await until(pilot, lambda: plot.cursor == 20)
        await pilot.press("shift+right")
        await until(pilot, lambda: plot.cursor == 21)
        assert app.moved[-1] == 21
        assert lines(plot)[0] == "step 21 · loss 1.21 · |g| 3 · not traced".ljust(GUTTER + 40)
        assert plot.x_of_step(21) == 2


@sync
async def test_nan_steps_are_marked_and_found():
    values = [1.0] * 40
    values[25] = math.nan
    plot = plot_of(values)
    app = WidgetHarness(plot, GUTTER + 20, 6)
    async with app.run_test(size=(40, 10)) as pilot:
        await until(pilot, lambda: plot.size.width == GUTTER + 20 and plot.cursor == 39)
        top = lines(plot)[1][GUTTER:]
        assert top.index("!") == plot.x_of_step(25) == 12 and top.count("!") == 1
        await pilot.press("exclamation_mark")
        await until(pilot, lambda: plot.cursor == 25)
        assert "loss nan" in lines(plot)[0]


@sync
async def test_the_plot_draws_100k_points_in_a_few_milliseconds():
    store = EventStore()
    pts = [
        StepPoint(s, loss=2 + math.sin(s / 100), grad_norm=1.0 + s % 7).to_wire()
        for s in range(100_000)
    ]
    store.take_history({"points": pts})
    plot = HistoryPlot(store.history_index)
    app = WidgetHarness(plot, 200, 48)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: plot.size.width == 200 and plot.view == (0, 100_000))
        costs = []
        for _ in range(5):
            t = time.perf_counter()
            frame = plot.frame(*plot.size)
            costs.append((time.perf_counter() - t) * 1000)
        assert len(frame) == 48 and plot.logs == {"loss": False, "|g|": False}
        print(f"plot frame, 100k points at 200x48: {min(costs):.1f} ms (best of 5)")
        assert min(costs) < 500  # ~15 ms here; generous for a loaded machine


# -- the heatmap ---------------------------------------------------------------------------------
def test_the_first_blow_up_is_the_earliest_module_past_100x_or_nonfinite():
    store = store_with(run_history())
    found = first_blow_up(store.history_index.module_series())
    assert found is not None
    assert (found.step, found.module, found.value) == (1500, "blocks.3.fc", 1e5)
    assert "first blow-up: blocks.3.fc at step 1,500" in found.describe()
    # a NaN at the same step as another module's jump: the NaN comes first, the other is named
    h = RunHistory()
    for s in range(100):
        mods = {"a": 1.0, "b": 2.0, "c": 3.0}
        if s == 60:
            mods.update(a=500.0, b=math.nan)
        if s == 40:
            mods["c"] = 250.0  # 83x its median: no blow-up
        h.add(StepPoint(s, loss=1.0, module_norms=mods))
    found = first_blow_up(store_with(h).history_index.module_series())
    assert (found.step, found.module, found.others) == (60, "b", ("a",))
    assert "1 more module that step" in found.describe()
    calm = RunHistory()
    for s in range(10):
        calm.add(StepPoint(s, loss=1.0, module_norms={"a": 1.0 + s}))
    assert first_blow_up(store_with(calm).history_index.module_series()) is None


@sync
async def test_the_heatmap_names_the_blow_up_and_marks_nan_cells():
    store = store_with(run_history(n=400, blow=300, keep=400))
    heat = ModuleHeatmap(store.history_index)
    app = WidgetHarness(heat, 60, 9)
    async with app.run_test(size=(80, 12)) as pilot:
        heat.view = (0, 400)
        await until(pilot, lambda: heat.size.width == 60)
        text = lines(heat)
        assert text[0].startswith("first blow-up: blocks.3.fc at step 300 (1e+05")
        assert [t[:11] for t in text[1:7]] == MODULES
        name_w = 15  # width // 4
        row3 = text[4][name_w + 1 :]
        # 44 columns over 400 steps: the NaN from step 303 on marks the columns after 300
        first_nan = row3.index("!")
        assert first_nan == (303 * 44) // 400 and set(row3[first_nan:]) == {"!"}
        assert set(row3[:first_nan]) == {"█"} and "!" not in text[3][name_w + 1 :]
        assert text[-1].startswith("1-6 of 6")
        await pilot.press("b")
        await until(pilot, lambda: app.blow_ups == [(300, "blocks.3.fc")], what="BlowUpSelected")


# -- the screen: arming --------------------------------------------------------------------------
def small_history(n: int = 1000) -> RunHistory:
    h = RunHistory()
    for s in range(n):
        h.add(StepPoint(s, loss=2.0 - s / n, grad_norm=10.0 + s % 3))
    return h


@sync
async def test_arm_at_a_future_step_posts_arm_at_step():
    app = ScreenHarness(store_with(small_history()), live=True, job_step=1000)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await until(pilot, lambda: isinstance(screen, HistoryScreen) and screen.plot.cursor == 999)
        box = screen.query_one("#history-input")
        await pilot.press("a")
        await until(pilot, lambda: box.display and box.has_focus, what="the input")
        assert box.value == "1001"  # the cursor is in the past: the next step
        await pilot.press("enter")
        await until(pilot, lambda: app.armed == [("at", 1001)], what="ArmAtStep(1001)")
        assert not box.display
        # a step that has passed, then not a number: one line says why, nothing is posted
        await pilot.press("a")
        await until(pilot, lambda: box.display and box.has_focus)
        box.value = "500"
        await pilot.press("enter")
        error = screen.query_one("#history-error")
        await until(pilot, lambda: error.display, what="the error line")
        assert "has passed" in str(error.render())
        box.value = "soon"
        await pilot.press("enter")
        await until(pilot, lambda: "not a step number" in str(error.render()))
        box.value = "2,500"
        await pilot.press("enter")
        await until(pilot, lambda: app.armed[-1] == ("at", 2500))
        assert len(app.armed) == 2


@sync
async def test_arm_when_posts_a_valid_condition_and_rejects_bad_ones():
    app = ScreenHarness(store_with(small_history()), live=True)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await until(pilot, lambda: isinstance(screen, HistoryScreen) and screen.plot.cursor == 999)
        box = screen.query_one("#history-input")
        error = screen.query_one("#history-error")
        await pilot.press("w")
        await until(pilot, lambda: box.display and box.has_focus)
        assert box.value == "gradnorm>10"  # from the cursor's |g| (step 999: 10 + 0)
        for bad in ("gradnorm>>3", "loss>lots", "temperature>3", "loss>nan"):
            box.value = bad
            await pilot.press("enter")
            await until(pilot, lambda b=bad: repr(b) in str(error.render()), what=bad)
            assert error.display and len(str(error.render()).splitlines()) == 1
        assert app.armed == []
        box.value = "gradnorm>1e3"
        await pilot.press("enter")
        await until(pilot, lambda: app.armed == [("when", "gradnorm>1e3")])
        assert not error.display
        await pilot.press("w")
        await until(pilot, lambda: box.display and box.has_focus)
        box.value = " nonfinite "
        await pilot.press("enter")
        await until(pilot, lambda: app.armed[-1] == ("when", "nonfinite"))
        # escape closes an open input, then the screen
        await pilot.press("w")
        await until(pilot, lambda: box.display)
        await pilot.press("escape")
        await until(pilot, lambda: not box.display and screen.plot.has_focus)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HistoryScreen), what="closed")
        assert len(app.armed) == 2


@sync
async def test_a_recording_cannot_arm():
    app = ScreenHarness(store_with(small_history(), live=False), live=False)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await until(pilot, lambda: isinstance(screen, HistoryScreen) and screen.plot.cursor == 999)
        note = screen.query_one("#history-note")
        for key in ("a", "w"):
            await pilot.press(key)
            await until(pilot, lambda: note.display, what="the note")
            assert str(note.render()) == NEEDS_LIVE
            assert not screen.query_one("#history-input").display
        assert app.armed == []


@sync
async def test_the_screen_follows_a_growing_history_and_hides_an_empty_heatmap():
    store = store_with(small_history(100))
    app = ScreenHarness(store, live=True, step=40)  # opened from the step list's row 40
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        await until(pilot, lambda: isinstance(screen, HistoryScreen) and screen.plot.cursor == 40)
        assert screen.plot.view == (0, 100) and not screen.heatmap.display  # no module norms
        store.take_history({"points": points_wire(range(100, 150), loss=lambda s: 1.0)})
        await until(pilot, lambda: screen.plot.view == (0, 150), what="the whole run, grown")
        assert screen.heatmap.view == (0, 150)


# -- snapshots -----------------------------------------------------------------------------------
pytest.importorskip("pytest_textual_snapshot")


def snapshot_app() -> ScreenHarness:
    return ScreenHarness(store_with(run_history()), live=True)


async def at_the_blow_up(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: isinstance(app.screen, HistoryScreen))
    screen = app.screen
    await until(pilot, lambda: screen.plot.cursor == 1999 and screen.heatmap.display)
    await pilot.press("exclamation_mark")  # the first NaN step
    await until(pilot, lambda: screen.plot.cursor == 1503)
    await pilot.press("left")
    await until(pilot, lambda: screen.plot.cursor < 1503)
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_history_screen_snapshot(snap_compare, size):
    assert snap_compare(snapshot_app(), terminal_size=size, run_before=at_the_blow_up)
