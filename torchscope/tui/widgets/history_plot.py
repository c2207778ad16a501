"""Loss and gradient norm over the whole run: two braille plots sharing one step axis.

Drawn by hand in braille (each cell 2x4 dots), not with a plotting library (plotext through
textual-plotext is the one Textual has), because:

- what the view needs is narrow and hot: 100k points cut into one bin per dot column, each
  bin's min and max read from the store's flat arrays (``HistoryIndex``: two bisects and a
  ``min``/``max`` over a slice, C loops), so a frame costs the same at 1k or 100k points. A
  library takes the points themselves and lays out every one of them on every frame;
- folded buckets (min-max ranges), NaN marks, a cursor column, per-series log scale and
  zoom/pan by keys and mouse are a few lines each on our own canvas, where a library's figure
  would have to be fought for each;
- the dots are ours, so tests check specific cells of a known series;
- and no new dependency (the UI installs on laptops that only look at a cluster job).

Each dot column shows the range of the values in its steps (its min to its max, joined to the
column before so a line stays a line), so a one-step spike among thousands is still drawn.
Log scale: automatic for a series whose visible values are all positive and span more than two
decades, or forced with ``l``. The widget owns its keys and state (view, cursor, scale) and
says what changed with ``CursorMoved`` and ``ViewChanged``.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip

from torchscope.protocol.history import Bucket, StepPoint
from torchscope.session.history_index import HistoryIndex, SeriesIndex
from torchscope.tui.widgets.history_frame import HistoryFrame
from torchscope.tui.widgets.step_list import short_num

#: Bits of the braille dots, by (x, y) in the 2x4 cell (Unicode's numbering: 1-3 then 7 down
#: the left column, 4-6 then 8 down the right).
DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
BRAILLE = 0x2800
GUTTER = 8  # y labels (7 cells) and the axis line
MIN_SPAN = 4  # the fewest steps a view shows
DECADES = 2.0  # auto log scale past this many decades


def to_log(x: float, floor: float) -> float:
    return math.log10(max(x, floor))


@dataclass
class Column:
    """What one dot column shows: the min and max of its finite values (None: none), whether
    one of its steps was NaN/Inf, and whether only folded buckets fed it."""

    lo: float | None = None
    hi: float | None = None
    bad: bool = False
    folded: bool = False


def bin_series(
    series: SeriesIndex, buckets: list[Bucket], attr: str, start: int, end: int, n: int
) -> list[Column]:
    """``n`` columns over steps ``start`` <= step < ``end``: column ``c`` covers
    ``[start + c*span//n, start + (c+1)*span//n)`` (at least one step, so a view narrower than
    its columns draws each step over several)."""
    span = max(1, end - start)
    lasts = [b.last for b in buckets]
    out: list[Column] = []
    for c in range(n):
        a = start + c * span // n
        b = max(a + 1, start + (c + 1) * span // n)
        col = Column()
        r = series.span(a, b)
        if r is not None:
            col.lo, col.hi = r
        col.bad = series.bad_in(a, b)
        if buckets and a <= lasts[-1]:
            folded = r is None
            k = bisect.bisect_left(lasts, a)
            while k < len(buckets) and buckets[k].first < b:
                bk = buckets[k]
                s = getattr(bk, attr)
                for x in (s.lo, s.hi, s.last):
                    if x is None:
                        continue
                    if not math.isfinite(x):
                        # somewhere in the bucket, no one knows where: one mark, where it
                        # starts (or at the view's edge), not one in every column it spans
                        col.bad |= a <= bk.first < b or (c == 0 and bk.first < a)
                    else:
                        col.lo = x if col.lo is None else min(col.lo, x)
                        col.hi = x if col.hi is None else max(col.hi, x)
                k += 1
            col.folded = folded and col.lo is not None
        out.append(col)
    return out


def scale_of(cols: list[Column], mode: str) -> tuple[float, float, bool, float]:
    """(low, high, log, floor) for the columns: the transformed range the rows span, whether
    it is a log scale (``mode``: "auto", "log" or "linear") and the least positive value
    (what a log scale clips zero and below to)."""
    los = [c.lo for c in cols if c.lo is not None]
    his = [c.hi for c in cols if c.hi is not None]
    if not los:
        return 0.0, 1.0, mode == "log", 1.0
    lo, hi = min(los), max(his)
    positive = [x for x in los if x > 0] or [x for x in his if x > 0]
    floor = min(positive) if positive else 1.0
    if mode == "auto":
        log = lo > 0 and math.log10(hi / lo) > DECADES
    else:
        log = mode == "log" and bool(positive)
    if log:
        lo, hi = to_log(max(lo, floor), floor), to_log(hi, floor)
    if hi - lo <= 0:
        pad = 0.5 if log else (abs(lo) * 0.1 or 1.0)
        lo, hi = lo - pad, hi + pad
    return lo, hi, log, floor


def dot_row(t: float, lo: float, hi: float, rows: int) -> int:
    """The dot row (0 at the top) of transformed value ``t`` on a scale ``lo``..``hi`` over
    ``rows`` dot rows."""
    r = round((hi - t) / (hi - lo) * (rows - 1))
    return max(0, min(rows - 1, r))


def draw(
    cols: list[Column], height: int, lo: float, hi: float, log: bool, floor: float
) -> list[list[int]]:
    """Braille bits, ``height`` cell rows by ``len(cols) // 2`` cells, for the columns."""
    width = len(cols) // 2
    bits = [[0] * width for _ in range(height)]
    rows = height * 4
    prev: tuple[int, int] | None = None
    for c, col in enumerate(cols[: width * 2]):
        if col.lo is None or col.hi is None:
            prev = None
            continue
        tlo = to_log(col.lo, floor) if log else col.lo
        thi = to_log(col.hi, floor) if log else col.hi
        top, bot = dot_row(thi, lo, hi, rows), dot_row(tlo, lo, hi, rows)
        if prev is not None:  # join the column before: a steep step stays one line
            ptop, pbot = prev
            if top > pbot + 1:
                top = pbot + 1
            if bot < ptop - 1:
                bot = ptop - 1
        prev = (top, bot)
        x, bit_col = c // 2, DOTS[c % 2]
        for r in range(top, bot + 1):
            bits[r // 4][x] |= bit_col[r % 4]
    return bits


def axis_text(start: int, end: int, width: int) -> str:
    """The step axis under the plots: the first, middle and last step of the view."""
    last = max(start, end - 1)
    left, right = f"{start:,}", f"{last:,}"
    text = [" "] * width
    text[: len(left)] = left
    if len(left) + len(right) + 1 <= width:
        text[width - len(right) :] = right
    mid = f"{(start + last) // 2:,}"
    m0 = (width - len(mid)) // 2
    if m0 > len(left) + 1 and m0 + len(mid) < width - len(right) - 1:
        text[m0 : m0 + len(mid)] = mid
    return "".join(text)[:width]


SERIES = (("loss", "loss"), ("|g|", "grad_norm"))

#: The marks row under the plots (shown once a step is marked): a spike the watch caught
#: whose update was applied, one whose update it skipped, an update skipped for another
#: reason (the watch's on_nan="skip", a loss scaler). The plot's subtitle is their legend.
SPIKE, SPIKE_SKIPPED, SKIPPED = "▲", "△", "\u00d7"  # (a multiplication sign)
LEGEND = f"{SPIKE} spike  {SPIKE_SKIPPED} spike, update skipped  {SKIPPED} update skipped"


def mark_of(applied: bool, refused: bool, skipped: bool) -> str:
    """One cell of the marks row: the most telling of its steps' marks, else a space."""
    if refused:
        return SPIKE_SKIPPED
    if applied:
        return SPIKE
    return SKIPPED if skipped else " "


class HistoryPlot(HistoryFrame):
    """Loss and global gradient norm over the run (see the module's docstring)."""

    DEFAULT_CSS = """
    HistoryPlot {
        height: 1fr;
        min-height: 6;
    }
    HistoryPlot > .history-plot--loss { color: $accent; }
    HistoryPlot > .history-plot--grad { color: $warning; }
    HistoryPlot > .history-plot--folded { color: $text-muted; }
    HistoryPlot > .history-plot--axis { color: $text-muted; }
    HistoryPlot > .history-plot--cursor { background: $boost; text-style: bold; }
    HistoryPlot > .history-plot--nan { color: $error; text-style: bold; }
    HistoryPlot > .history-plot--readout { text-style: bold; }
    HistoryPlot > .history-plot--spike { color: $error; text-style: bold; }
    HistoryPlot > .history-plot--skipped { color: $warning; }
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "history-plot--loss",
        "history-plot--grad",
        "history-plot--folded",
        "history-plot--axis",
        "history-plot--cursor",
        "history-plot--nan",
        "history-plot--readout",
        "history-plot--spike",
        "history-plot--skipped",
    }

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left", "cursor(-1)", "Cursor left", show=False),
        Binding("right", "cursor(1)", "Cursor right", show=False),
        Binding("shift+left", "step(-1)", "Step back", show=False),
        Binding("shift+right", "step(1)", "Step on", show=False),
        Binding("plus,equals_sign", "zoom(0.5)", "Zoom in", show=False),
        Binding("minus", "zoom(2)", "Zoom out", show=False),
        Binding("0", "reset", "Whole run", show=False),
        Binding("comma,left_square_bracket", "pan(-0.25)", "Pan left", show=False),
        Binding("full_stop,right_square_bracket", "pan(0.25)", "Pan right", show=False),
        Binding("home", "first", "First step", show=False),
        Binding("end", "last", "Last step", show=False),
        Binding("l", "toggle_log", "Log scale", show=False),
        Binding("exclamation_mark", "first_bad", "First NaN", show=False),
    ]

    #: Steps start..end (exclusive) shown.
    view: reactive[tuple[int, int]] = reactive((0, 1))
    #: The step the cursor is on (None: no history yet).
    cursor: reactive[int | None] = reactive(None)
    #: "auto" (log where values span more than two decades), "log" or "linear".
    log_mode: reactive[str] = reactive("auto")

    class CursorMoved(Message):
        """The cursor is on ``step`` now."""

        def __init__(self, plot: HistoryPlot, step: int) -> None:
            super().__init__()
            self.plot = plot
            self.step = step

        @property
        def control(self) -> HistoryPlot:
            return self.plot

    class ViewChanged(Message):
        """Steps ``start``..``end`` (exclusive) are shown now (zoom, pan, new steps)."""

        def __init__(self, plot: HistoryPlot, start: int, end: int) -> None:
            super().__init__()
            self.plot = plot
            self.start = start
            self.end = end

        @property
        def control(self) -> HistoryPlot:
            return self.plot

    def __init__(
        self,
        index: HistoryIndex | None = None,
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(index, name=name, id=id, classes=classes)
        self._whole = True  # the view is the whole run (and grows with it)
        self._drag: tuple[int, tuple[int, int]] | None = None  # (x, view) at mouse down
        self._dragged = False
        self.draw_ms = 0.0  # the last frame's cost (shown nowhere; measured by tests)
        self.logs: dict[str, bool] = {}  # per series: drawn on a log scale in the last frame

    def on_mount(self) -> None:
        self.set_index(self.index)

    # -- data ----------------------------------------------------------------------------------
    @property
    def extent(self) -> tuple[int, int]:
        """The steps the history covers, ``first``..``last + 1``."""
        first, last = self.index.first_step, self.index.last_step
        if first is None or last is None:
            return 0, 1
        return first, last + 1

    def set_index(self, index: HistoryIndex) -> None:
        """Show ``index`` (the store's, which it may replace); keeps the view and cursor where
        they still make sense, and a whole-run view follows the run as it grows."""
        self.index = index
        lo, hi = self.extent
        if self._whole or self.view == (0, 1):
            self.view = (lo, hi)
        else:
            self.view = self._clamp(*self.view)
        if (self.cursor is None or not lo <= self.cursor < hi) and index.last_step is not None:
            self.cursor = index.last_step
        self._frame_key = None
        self.border_subtitle = LEGEND if index.marked else ""
        self.refresh()

    def data_changed(self) -> None:
        """The index grew or changed (the store took history)."""
        self.set_index(self.index)

    def point(self, step: int) -> StepPoint | None:
        return self.index.point(step)

    def bucket(self, step: int) -> Bucket | None:
        """The folded bucket that holds ``step``, if any."""
        buckets = self.index.buckets
        k = bisect.bisect_left([b.last for b in buckets], step)
        return buckets[k] if k < len(buckets) and buckets[k].first <= step else None

    # -- reactive state ------------------------------------------------------------------------
    def _clamp(self, start: int, end: int) -> tuple[int, int]:
        lo, hi = self.extent
        span = max(min(MIN_SPAN, hi - lo), min(end - start, hi - lo))
        start = max(lo, min(start, hi - span))
        return start, start + span

    def validate_view(self, view: tuple[int, int]) -> tuple[int, int]:
        return self._clamp(*view)

    def watch_view(self, view: tuple[int, int]) -> None:
        self._whole = view == self.extent
        self.post_message(self.ViewChanged(self, *view))

    def validate_cursor(self, cursor: int | None) -> int | None:
        if cursor is None:
            return None
        lo, hi = self.extent
        return max(lo, min(hi - 1, cursor))

    def watch_cursor(self, cursor: int | None) -> None:
        if cursor is not None:
            self.post_message(self.CursorMoved(self, cursor))

    # -- geometry ------------------------------------------------------------------------------
    @property
    def plot_width(self) -> int:
        return max(1, self.size.width - GUTTER)

    def step_at_x(self, x: int) -> int:
        """The first step of the dot column at cell ``x`` (widget coordinates)."""
        start, end = self.view
        c = max(0, min(self.plot_width - 1, x - GUTTER)) * 2
        return start + c * (end - start) // (self.plot_width * 2)

    def x_of_step(self, step: int) -> int | None:
        """The plot cell (0: the first after the gutter) that shows ``step``, if in view."""
        start, end = self.view
        if not start <= step < end:
            return None
        n = self.plot_width * 2
        # the column c with start + c*span//n <= step < start + (c+1)*span//n
        c = ((step - start + 1) * n - 1) // (end - start)
        return min(self.plot_width - 1, c // 2)

    # -- actions -------------------------------------------------------------------------------
    def _show(self, step: int) -> None:
        """Pan (not zoom) so that ``step`` is in view."""
        start, end = self.view
        if not start <= step < end:
            span = end - start
            self.view = (step - span // 2, step - span // 2 + span)

    def _move(self, step: int) -> None:
        if self.index.last_step is None:
            return  # no history: nowhere to go
        self.cursor = step
        if self.cursor is not None:
            self._show(self.cursor)

    def action_cursor(self, cells: int) -> None:
        if self.cursor is None:
            return
        start, end = self.view
        per_cell = max(1, (end - start) // self.plot_width)
        self._move(self.cursor + cells * per_cell)

    def action_step(self, steps: int) -> None:
        if self.cursor is not None:
            self._move(self.cursor + steps)

    def zoom(self, factor: float, around: int | None = None) -> None:
        """Show ``factor`` times the steps (0.5: zoom in), keeping ``around`` (the cursor, else
        the view's middle) at the same place on screen."""
        start, end = self.view
        span = end - start
        if around is None or not start <= around < end:
            around = self.cursor if self.cursor is not None and start <= self.cursor < end else None
        if around is None:
            around = (start + end) // 2
        new = max(MIN_SPAN, round(span * factor))
        left = around - round((around - start) * new / span)
        self.view = (left, left + new)

    def action_zoom(self, factor: float) -> None:
        self.zoom(factor)

    def action_pan(self, fraction: float) -> None:
        start, end = self.view
        shift = round((end - start) * fraction) or (1 if fraction > 0 else -1)
        self.view = (start + shift, end + shift)

    def action_reset(self) -> None:
        self.view = self.extent

    def action_first(self) -> None:
        self._move(self.extent[0])

    def action_last(self) -> None:
        self._move(self.extent[1] - 1)

    def action_toggle_log(self) -> None:
        """Log scale on or off (from auto: the other of what auto chose for the loss)."""
        now = self.logs.get("loss", self.logs.get("|g|", False))
        self.log_mode = "linear" if now else "log"

    def first_bad(self) -> int | None:
        """The first step whose loss or gradient norm is NaN/Inf (folded buckets included)."""
        found = [s.bad_xs[0] for s in (self.index.loss, self.index.grad_norm) if s.bad_xs]
        for b in self.index.buckets:
            if any(x is not None and not math.isfinite(x) for x in (b.loss.hi, b.grad_norm.hi)):
                found.append(b.first)
                break
        return min(found) if found else None

    def action_first_bad(self) -> None:
        step = self.first_bad()
        if step is None:
            self.notify("no NaN or Inf in the history", timeout=3)
            return
        self._move(step)

    # -- mouse ---------------------------------------------------------------------------------
    def _x(self, event: events.MouseEvent) -> int | None:
        """The event's column in the content (the border left out), None when outside it."""
        offset = event.get_content_offset(self)
        return None if offset is None else offset.x

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        x = self._x(event)
        if x is not None:
            event.stop()
            self.zoom(0.5, self.step_at_x(x))

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        x = self._x(event)
        if x is not None:
            event.stop()
            self.zoom(2.0, self.step_at_x(x))

    def on_mouse_down(self, event: events.MouseDown) -> None:
        x = self._x(event)
        if x is None:
            return
        self._drag = (x, self.view)
        self._dragged = False
        self.capture_mouse()

    def on_mouse_move(self, event: events.MouseMove) -> None:
        if self._drag is None:
            return
        x = event.get_content_offset_capture(self).x  # captured: may be outside the widget
        x0, (start, end) = self._drag
        cells = x0 - x
        if cells:
            self._dragged = True
            shift = round(cells * (end - start) / self.plot_width)
            self.view = (start + shift, end + shift)

    def on_mouse_up(self, event: events.MouseUp) -> None:
        if self._drag is None:
            return
        self._drag = None
        self.release_mouse()
        x = event.get_content_offset_capture(self).x
        if not self._dragged and x >= GUTTER:  # a click: the cursor there
            self.cursor = self.step_at_x(x)

    # -- drawing -------------------------------------------------------------------------------
    def readout(self) -> str:
        """What the cursor is on: its step and values."""
        step = self.cursor
        if step is None:
            return "no history yet"
        p = self.point(step)
        if p is not None:
            parts = [f"step {step:,}", f"loss {short_num(p.loss, 9)}"]
            if p.grad_norm is not None or self.index.grad_norm:
                parts.append(f"|g| {short_num(p.grad_norm, 9)}")
            if p.scale is not None:  # a loss scaler's step: its scale, and whether it updated
                parts.append(f"scale {short_num(p.scale, 9)}")
            if p.spike:  # the watch caught a spike (refused under on_spike="skip")
                parts.append("spike, update skipped" if p.skipped else "spike")
            elif p.skipped and p.scale is not None:
                parts.append("update skipped by the scaler")
            elif p.skipped:  # refused by the watch (on_nan="skip")
                parts.append("update skipped")
            parts.append("traced" if p.traced else "not traced")
            return " · ".join(parts)
        b = self.bucket(step)
        if b is not None:
            text = f"steps {b.first:,}..{b.last:,} folded"
            for label, s in (("loss", b.loss), ("|g|", b.grad_norm)):
                if s.lo is not None or s.hi is not None:
                    text += f" · {label} {short_num(s.lo)}..{short_num(s.hi)}"
            if b.skipped:
                text += f" · {b.skipped:,} updates skipped"
            return text
        return f"step {step:,} · no values"

    def frame_key(self) -> tuple:
        return (self.view, self.cursor, self.log_mode, self.has_focus)

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def frame(self, width: int, height: int) -> list[Strip]:
        """Every line of the widget at ``width`` by ``height``."""
        t0 = time.perf_counter()
        base = self.rich_style
        st = {
            c.rsplit("--", 1)[1]: self.get_component_rich_style(c) for c in self.COMPONENT_CLASSES
        }
        lines: list[Strip] = []
        lines.append(
            Strip([Segment(self.readout(), base + st["readout"])]).adjust_cell_length(width, base)
        )
        buckets = self.index.buckets
        shown = [
            (label, attr, getattr(self.index, attr))
            for label, attr in SERIES
            if getattr(self.index, attr) or any(getattr(b, attr).hi is not None for b in buckets)
        ]
        marked = self.index.marked
        rows = height - 2 - marked
        if not shown or rows < 2 or width <= GUTTER + 1:
            empty = Strip([Segment(" no history yet", base + st["axis"])])
            lines.append(empty.adjust_cell_length(width, base))
            return lines
        start, end = self.view
        pw = width - GUTTER
        cursor_x = self.x_of_step(self.cursor) if self.cursor is not None else None
        per = [rows // len(shown)] * len(shown)
        per[0] += rows - sum(per)
        self.logs = {}
        for (label, attr, series), prow in zip(shown, per, strict=True):
            cols = bin_series(series, self.index.buckets, attr, start, end, pw * 2)
            lo, hi, log, floor = scale_of(cols, self.log_mode)
            self.logs[label] = log
            bits = draw(cols, prow, lo, hi, log, floor)
            colour = st["loss" if attr == "loss" else "grad"]
            for r in range(prow):
                lines.append(
                    self._panel_line(
                        r, prow, label, log, lo, hi, bits[r], cols, colour, st, base, cursor_x
                    )
                )
        if marked:
            lines.append(self._marks_line(start, end, pw, st, base, cursor_x))
        axis = " " * GUTTER + axis_text(start, end, pw)
        lines.append(Strip([Segment(axis, base + st["axis"])]).adjust_cell_length(width, base))
        self.draw_ms = (time.perf_counter() - t0) * 1000
        return lines

    def _marks_line(
        self, start: int, end: int, pw: int, st: dict[str, Style], base: Style, cursor_x: int | None
    ) -> Strip:
        """The marks row: each cell's spike or skipped update (see :data:`LEGEND`)."""
        span, n = max(1, end - start), pw * 2
        segs = [Segment("marks".rjust(GUTTER - 1) + "│", base + st["axis"])]
        for x in range(pw):
            a = start + 2 * x * span // n
            b = max(a + 1, start + (2 * x + 2) * span // n)
            ch = mark_of(*self.index.marks_in(a, b))
            style = base + (st["skipped"] if ch == SKIPPED else st["spike"])
            if x == cursor_x:
                style = style + st["cursor"]
            segs.append(Segment(ch, style))
        return Strip(segs).simplify()

    def _panel_line(
        self,
        r: int,
        rows: int,
        label: str,
        log: bool,
        lo: float,
        hi: float,
        bits: list[int],
        cols: list[Column],
        colour: Style,
        st: dict[str, Style],
        base: Style,
        cursor_x: int | None,
    ) -> Strip:
        """Row ``r`` of a series' panel: its y label and axis, then its cells."""
        if r == 0:
            text = short_num(10**hi if log else hi, 6)
        elif r == rows - 1:
            text = short_num(10**lo if log else lo, 6)
        elif r == rows // 2:
            text = label + (" log" if log and len(label) <= GUTTER - 5 else "")
        elif r == rows // 2 + 1 and log and len(label) > GUTTER - 5 and r < rows - 1:
            text = "log"  # no room beside the name
        else:
            text = ""
        tick = "┤" if r in (0, rows - 1) else "│"
        segs = [Segment(text.rjust(GUTTER - 1)[: GUTTER - 1] + tick, base + st["axis"])]
        run: list[str] = []
        run_style: Style | None = None
        for x, b in enumerate(bits):
            pair = cols[2 * x : 2 * x + 2]
            if r == 0 and any(c.bad for c in pair):
                ch, style = "!", st["nan"]
            else:
                ch = chr(BRAILLE + b)
                style = st["folded"] if all(c.folded or c.lo is None for c in pair) else colour
            style = base + style
            if x == cursor_x:
                style = style + st["cursor"]
            if style != run_style and run:
                segs.append(Segment("".join(run), run_style))
                run = []
            run_style = style
            run.append(ch)
        if run:
            segs.append(Segment("".join(run), run_style))
        return Strip(segs)
