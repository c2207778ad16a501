"""Per-module gradient norm over the run: modules down, steps across, colour by log norm.

Rows are the modules in the order they first report a norm (the watch's order: the model's),
columns the steps of the view binned to the width; each cell is the largest norm of its bin
(a one-step spike survives binning), coloured on one log scale over the whole view, and ``!``
(red) where a step of the bin had a NaN or Inf norm. The first line names the first module to
blow up: the earliest step where a module's norm is non-finite or more than 100 times its
median. Module norms exist for the history's newest steps only (the agent keeps them for a
window), so older columns are blank.

Drawn by hand like the plot (see ``history_plot``): one character per cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import ClassVar

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip

from torchscope.session.history_index import HistoryIndex, SeriesIndex
from torchscope.tui.widgets.history_frame import HistoryFrame
from torchscope.tui.widgets.step_list import short_num
from torchscope.tui.widgets.virtual_list import fit

#: Low to high (viridis): readable on dark and light themes, and in 256 colours.
PALETTE = (
    "#440154",
    "#482878",
    "#3e4989",
    "#31688e",
    "#26828e",
    "#1f9e89",
    "#35b779",
    "#6ece58",
    "#b5de2b",
    "#fde725",
)
NAN_MARK = "!"  # a cell with a NaN/Inf norm (the step list and the plot mark them so too)
FACTOR = 100.0  # a norm this many times its module's median is a blow-up
MEDIAN_SAMPLE = 20_000  # the median of at most this many values (evenly strided)


@dataclass(frozen=True)
class BlowUp:
    """The first module whose gradient norm went non-finite or jumped past ``FACTOR`` times
    its median, at ``step``; ``others``: the modules that did too at that same step."""

    step: int
    module: str
    value: float
    median: float | None
    others: tuple[str, ...] = ()

    def describe(self) -> str:
        if math.isfinite(self.value):
            ratio = self.value / self.median if self.median else math.inf
            what = f"{short_num(self.value)}, {ratio:,.0f}x its median {short_num(self.median)}"
        else:
            what = short_num(self.value)
        text = f"first blow-up: {self.module} at step {self.step:,} ({what})"
        if self.others:
            n = len(self.others)
            text += f"; {n} more module{'s' if n > 1 else ''} that step"
        return text


def module_median(series: SeriesIndex) -> float | None:
    """The median of a module's finite norms (of an even sample past ``MEDIAN_SAMPLE``)."""
    ys = series.ys
    if not ys:
        return None
    stride = max(1, len(ys) // MEDIAN_SAMPLE)
    return median(ys[::stride])


def first_blow_up(modules: dict[str, SeriesIndex], factor: float = FACTOR) -> BlowUp | None:
    """The earliest step where a module's norm is NaN/Inf or above ``factor`` times its
    median; at a tie the non-finite one, then the largest jump, comes first."""
    found: list[tuple[int, int, float, str, float, float | None]] = []
    for name, s in modules.items():
        med = module_median(s)
        cands: list[tuple[int, float]] = []
        if s.bad_xs:
            cands.append((s.bad_xs[0], s.bad_ys[0]))
        if med is not None and med > 0 and max(s.ys) > factor * med:  # max(): a C loop first
            limit = factor * med
            i = next(i for i, y in enumerate(s.ys) if y > limit)
            cands.append((s.xs[i], s.ys[i]))
        if not cands:
            continue
        step, value = min(cands, key=lambda c: c[0])
        finite = math.isfinite(value)
        jump = value / med if finite and med else math.inf
        found.append((step, 0 if not finite else 1, -jump, name, value, med))
    if not found:
        return None
    found.sort()
    step, _, _, name, value, med = found[0]
    others = tuple(f[3] for f in found[1:] if f[0] == step)
    return BlowUp(step, name, value, med, others)


def colour_of(t: float, lo: float, hi: float) -> str:
    """The palette colour of log norm ``t`` on ``lo``..``hi``."""
    if hi <= lo:
        return PALETTE[len(PALETTE) // 2]
    i = int((t - lo) / (hi - lo) * (len(PALETTE) - 1) + 0.5)
    return PALETTE[max(0, min(len(PALETTE) - 1, i))]


class ModuleHeatmap(HistoryFrame):
    """Modules by steps, coloured by log gradient norm (see the module's docstring)."""

    DEFAULT_CSS = """
    ModuleHeatmap {
        height: 1fr;
        min-height: 4;
    }
    ModuleHeatmap > .module-heatmap--name { color: $text-muted; }
    ModuleHeatmap > .module-heatmap--nan { color: $error; text-style: bold; }
    ModuleHeatmap > .module-heatmap--headline { color: $error; text-style: bold; }
    ModuleHeatmap > .module-heatmap--quiet { color: $text-muted; }
    ModuleHeatmap > .module-heatmap--cursor { color: $accent; text-style: bold; }
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "module-heatmap--name",
        "module-heatmap--nan",
        "module-heatmap--headline",
        "module-heatmap--quiet",
        "module-heatmap--cursor",
    }

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "scroll_rows(-1)", "Up", show=False),
        Binding("down,j", "scroll_rows(1)", "Down", show=False),
        Binding("pageup", "scroll_rows(-10)", "Page up", show=False),
        Binding("pagedown", "scroll_rows(10)", "Page down", show=False),
        Binding("b", "blow_up", "First blow-up", show=False),
    ]

    #: Steps start..end (exclusive) shown: the plot's view (the screen keeps them together).
    view: reactive[tuple[int, int]] = reactive((0, 1))
    #: The plot's cursor step, marked under its column.
    cursor: reactive[int | None] = reactive(None)
    #: The first module row shown.
    top: reactive[int] = reactive(0)

    class BlowUpSelected(Message):
        """``b``: the user asks to see the first blow-up (``step``, ``module``)."""

        def __init__(self, heatmap: ModuleHeatmap, step: int, module: str) -> None:
            super().__init__()
            self.heatmap = heatmap
            self.step = step
            self.module = module

        @property
        def control(self) -> ModuleHeatmap:
            return self.heatmap

    def __init__(
        self,
        index: HistoryIndex | None = None,
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(index, name=name, id=id, classes=classes)
        self._blow: tuple[tuple[int, int], BlowUp | None] | None = None

    def set_index(self, index: HistoryIndex) -> None:
        self.index = index
        self._frame_key = None
        self.refresh()

    @property
    def modules(self) -> dict[str, SeriesIndex]:
        return self.index.module_series()

    @property
    def has_modules(self) -> bool:
        return bool(self.modules)

    def blow_up(self) -> BlowUp | None:
        """The first blow-up (kept until the history changes)."""
        key = (id(self.index), self.index.version)
        if self._blow is None or self._blow[0] != key:
            self._blow = (key, first_blow_up(self.modules))
        return self._blow[1]

    def validate_top(self, top: int) -> int:
        return max(0, min(top, len(self.modules) - self.rows_shown()))

    def rows_shown(self) -> int:
        return max(1, self.size.height - 2)

    def action_scroll_rows(self, n: int) -> None:
        self.top += n

    def action_blow_up(self) -> None:
        found = self.blow_up()
        if found is None:
            self.notify("no module blew up", timeout=3)
            return
        names = list(self.modules)
        i = names.index(found.module)
        if not self.top <= i < self.top + self.rows_shown():
            self.top = i
        self.post_message(self.BlowUpSelected(self, found.step, found.module))

    # -- drawing -------------------------------------------------------------------------------
    def frame_key(self) -> tuple:
        return (self.view, self.cursor, self.top)

    def cells(
        self, width: int
    ) -> tuple[list[str], list[list[tuple[str, str | None]]], float, float]:
        """(module names, per module the cells ``(char, colour)`` over ``width`` columns, the
        log10 range the colours span) for the view."""
        start, end = self.view
        span = max(1, end - start)
        n = max(1, width)
        bounds = []
        for c in range(n):
            a = start + c * span // n
            bounds.append((a, max(a + 1, start + (c + 1) * span // n)))
        names = list(self.modules)
        values: list[list[float | bool | None]] = []
        lo, hi = math.inf, -math.inf
        for name in names:
            s = self.modules[name]
            row: list[float | bool | None] = []
            for a, b in bounds:
                if s.bad_in(a, b):
                    row.append(True)  # non-finite
                    continue
                r = s.span(a, b)
                if r is None or r[1] <= 0:
                    row.append(None)
                    continue
                t = math.log10(r[1])
                lo, hi = min(lo, t), max(hi, t)
                row.append(t)
            values.append(row)
        out: list[list[tuple[str, str | None]]] = []
        for row in values:
            line: list[tuple[str, str | None]] = []
            for v in row:
                if v is True:
                    line.append((NAN_MARK, None))
                elif v is None:
                    line.append((" ", None))
                else:
                    line.append(("█", colour_of(float(v), lo, hi)))
            out.append(line)
        return names, out, lo, hi

    def frame(self, width: int, height: int) -> list[Strip]:
        base = self.rich_style
        st = {
            c.rsplit("--", 1)[1]: self.get_component_rich_style(c) for c in self.COMPONENT_CLASSES
        }

        def line(text: str, style: Style) -> Strip:
            return Strip([Segment(fit(text, width), base + style)])

        found = self.blow_up()
        if not self.modules:
            return [line(" no per-module gradient norms (the watch is off)", st["quiet"])]
        head = (
            line(found.describe(), st["headline"])
            if found is not None
            else line(f"no module blew up (NaN/Inf, or >{FACTOR:.0f}x its median)", st["quiet"])
        )
        name_w = min(28, max(8, width // 4))
        cells_w = max(1, width - name_w - 1)
        names, cells, lo, hi = self.cells(cells_w)
        lines = [head]
        top = self.top
        rows = height - 2
        for name, row in zip(names[top : top + rows], cells[top : top + rows], strict=True):
            segs = [Segment(fit(name, name_w) + " ", base + st["name"])]
            for ch, colour in row:
                if ch == NAN_MARK:
                    style = base + st["nan"]
                elif colour is not None:
                    style = base + Style(color=Color.parse(colour))
                else:
                    style = base
                segs.append(Segment(ch, style))
            lines.append(Strip(segs).adjust_cell_length(width, base))
        while len(lines) < height - 1:
            lines.append(Strip.blank(width, base))
        lines.append(self._footer(width, name_w, cells_w, top, len(names), lo, hi, st))
        return lines[:height]

    def _footer(
        self,
        width: int,
        name_w: int,
        cells_w: int,
        top: int,
        n: int,
        lo: float,
        hi: float,
        st: dict[str, Style],
    ) -> Strip:
        """Which modules are shown, the log range the colours span (with the palette) and a
        mark under the cursor's column."""
        base = self.rich_style
        quiet = base + st["quiet"]
        shown = f"{top + 1}-{min(n, top + self.size.height - 2)} of {n}"
        chars: list[tuple[str, Style]] = [(ch, quiet) for ch in fit(shown, name_w) + " "]
        area: list[tuple[str, Style]] = [(" ", base)] * cells_w
        if lo <= hi:
            text = [(ch, quiet) for ch in f"log10 |g| {lo:.1f} "]
            text += [(" ", base + Style(bgcolor=Color.parse(c))) for c in PALETTE]
            text += [(ch, quiet) for ch in f" {hi:.1f}"]
            area[: len(text)] = text[:cells_w]
        cx = self._cursor_x(cells_w)
        if cx is not None:
            area[cx] = ("▲", base + st["cursor"])
        return Strip([Segment(ch, style) for ch, style in chars + area]).adjust_cell_length(
            width, base
        )

    def _cursor_x(self, cells_w: int) -> int | None:
        start, end = self.view
        if self.cursor is None or not start <= self.cursor < end:
            return None
        return min(cells_w - 1, ((self.cursor - start + 1) * cells_w - 1) // (end - start))
