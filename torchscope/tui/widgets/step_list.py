"""The steps of the trace: all of them in a replay, a growing list when live.

Each line: step, number of forward ops, number of backward nodes (and of aten calls, at the
aten level, where the panel has room: the screen widens it), and a mark for alerts and for
steps that are not in memory. Once known, the step's loss (the value at the root of its
backward: blank before that runs) and global gradient norm come first, with a bar scaling that
norm against every step's (a spike stands out), and the panel's subtitle is a sparkline of
the norms across all steps: a replay's count pass finds them (see countpass), a live session's
source as the events stream in (``sources.LiveOverview``, the same counter).

Where traced steps are not consecutive (152 then 164: the job ran untraced between, dormant
or attached later), a dim row between them says so (``… 11 steps not traced``, shorter where
the panel is narrow); the cursor passes over it.
"""

from __future__ import annotations

import bisect
import math

from torchscope.tui.format import SPARK
from torchscope.tui.store import EVICTED, LOADING, ON_DISK, EventStore
from torchscope.tui.widgets.virtual_list import Cell, VirtualList, fit, rfit

#: Below this width the overview columns push out the op and node counts.
WIDE = 40
#: What the aten call count needs after the step, op and node counts.
ATEN_WIDTH = 7


def short_num(x: float | None, width: int = 7) -> str:
    """A number in at most ``width`` characters: ``2.3457``, ``1.2e+04``, ``nan``; ``-``
    when unknown."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    for sig in (5, 4, 3, 2, 1):
        text = f"{x:.{sig}g}"
        if len(text) <= width:
            return text
    return f"{x:.0e}"


def _scale(values: list[float | None]) -> tuple[float, float] | None:
    """The range a bar spans: from 0 (or the lowest value, if negative) to the highest."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    return min(0.0, min(finite)), max(finite)


def bar(value: float | None, scale: tuple[float, float] | None) -> str:
    """One block character: ``value`` on a linear scale over ``scale`` (so steady values
    look steady and a spike dwarfs them); ``!`` for NaN or Inf."""
    if value is None:
        return " "
    if not math.isfinite(value):
        return "!"
    if scale is None:
        return SPARK[0]
    lo, hi = scale
    if hi - lo <= 0:
        return SPARK[len(SPARK) // 2]
    i = int((value - lo) / (hi - lo) * (len(SPARK) - 1) + 0.5)
    return SPARK[max(0, min(len(SPARK) - 1, i))]


def spark_across(values: list[float | None], width: int) -> str:
    """``values`` in at most ``width`` block characters, each the largest of its bucket (a
    spike in one step of thousands still shows); ``!`` for a bucket with a non-finite value."""
    if width <= 0 or not values:
        return ""
    n = len(values)
    buckets = min(n, width)
    out: list[float | None] = []
    for b in range(buckets):
        part = values[b * n // buckets : (b + 1) * n // buckets]
        nonfinite = any(v is not None and not math.isfinite(v) for v in part)
        known = [v for v in part if v is not None and math.isfinite(v)]
        out.append(math.inf if nonfinite else (max(known) if known else None))
    scale = _scale(out)
    return "".join(bar(v, scale) for v in out)


def gap_text(missing: int, width: int) -> str:
    """The row between two traced steps ``missing + 1`` apart, in at most ``width`` cells."""
    word = "step" if missing == 1 else "steps"
    for text in (
        f"… {missing:,} {word} not traced",
        f"… {missing:,} not traced",
        f"… {missing:,} untraced",
        f"… {missing:,}",
        f"…{missing}",
    ):
        if len(text) <= width:
            return text
    return "…"


def _count(n: int, counted: bool) -> str:
    text = f"{n:,}" if n < 100_000 else f"{n / 1000:.0f}k"
    return text if counted else text + "…"


class StepList(VirtualList):
    """One line per step; ``Highlighted`` says which step the cursor is on."""

    HEADER_LINES = 1

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.store: EventStore | None = None
        self._overview_at = -1  # store.overview_version the scale below was taken at
        self._norm_scale: tuple[float, float] | None = None
        # Gaps: indices i into store.order with order[i] more than one past order[i - 1]
        # (a row before each), and the row of each gap, for the order they were found in
        self._gaps: list[int] = []
        self._gap_rows: list[int] = []
        self._gaps_of: tuple[int, int, int, int] | None = None

    @property
    def has_overview(self) -> bool:
        return self.store is not None and self.store.overview_version > 0

    def norm_scale(self) -> tuple[float, float] | None:
        store = self.store
        if store is not None and store.overview_version != self._overview_at:
            self._overview_at = store.overview_version
            self._norm_scale = _scale(store.overview()[1])
        return self._norm_scale

    def sparkline(self, width: int) -> str:
        """The gradient norms (else the losses) across all steps, for the panel's subtitle."""
        if not self.has_overview or self.store is None:
            return ""
        losses, norms = self.store.overview()
        label, values = ("|g|", norms) if any(v is not None for v in norms) else ("loss", losses)
        return f"{label} {spark_across(values, width - len(label) - 1)}"

    def bind_store(self, store: EventStore) -> None:
        self.store = store

    def _layout(self) -> list[int]:
        """Where the gaps are (found again when the steps changed)."""
        order = self.store.order if self.store is not None else []
        key = (id(order), len(order), order[0] if order else 0, order[-1] if order else 0)
        if key != self._gaps_of:
            self._gaps_of = key
            self._gaps = [
                i for i in range(1, len(order)) if order[i - 1] >= 0 and order[i] > order[i - 1] + 1
            ]
            self._gap_rows = [g + j for j, g in enumerate(self._gaps)]
        return self._gaps

    def row_count(self) -> int:
        if self.store is None:
            return 0
        return len(self.store.order) + len(self._layout())

    def _entry(self, index: int) -> tuple[int, bool]:
        """Row ``index`` -> (index into store.order, whether it is the gap row before it)."""
        gaps = self._layout()
        k = bisect.bisect_right(self._gap_rows, index)  # gap rows at or before it
        if k and self._gap_rows[k - 1] == index:
            return gaps[k - 1], True
        return index - k, False

    def _row_of(self, i: int) -> int:
        """The row of store.order[i]."""
        return i + bisect.bisect_right(self._layout(), i)

    def gap_at(self, index: int) -> int | None:
        """How many steps were not traced, when row ``index`` is a gap row."""
        if self.store is None or not 0 <= index < self.row_count():
            return None
        i, gap = self._entry(index)
        order = self.store.order
        return order[i] - order[i - 1] - 1 if gap else None

    def step_at(self, index: int) -> int | None:
        if self.store is None or not 0 <= index < self.row_count():
            return None
        i, gap = self._entry(index)
        return None if gap else self.store.order[i]

    def move_cursor(self, index: int, *, user: bool = False, center: bool = False) -> None:
        """As VirtualList's, passing over gap rows (on in the direction of travel)."""
        count = self.row_count()
        if count and 0 <= index < count and self.gap_at(index) is not None:
            index = index + 1 if index >= self.cursor else index - 1
            if index < 0:
                index = 1
        super().move_cursor(index, user=user, center=center)

    @property
    def current_step(self) -> int | None:
        return self.step_at(self.cursor)

    def select_step(self, step: int, *, user: bool = False) -> bool:
        if self.store is None:
            return False
        index = self.store.step_index(step)
        if index is None:
            return False
        index = self._row_of(index)
        if index != self.cursor:
            self.move_cursor(index, user=user)
        else:
            self.scroll_to_cursor()
        return True

    def empty_text(self) -> str:
        return "no steps yet"

    def _shows_aten(self, width: int) -> bool:
        """The aten call count: at the aten level, after the op and node counts if it fits."""
        if self.store is None or not self.store.has_aten:
            return False
        counts = 21 if not self.has_overview else WIDE
        return width >= counts + ATEN_WIDTH

    def render_header(self, width: int) -> list[Cell]:
        aten = f" {rfit('aten', 6)}" if self._shows_aten(width) else ""
        if not self.has_overview:
            return [(f"{rfit('step', 5)} {rfit('ops', 6)} {rfit('nodes', 6)}{aten}", None)]
        text = f"{rfit('step', 5)} {rfit('loss', 6)} {rfit('|g|', 6)}"
        if width >= WIDE:
            text += f"   {rfit('ops', 6)} {rfit('nodes', 6)}{aten}"
        return [(text, None)]

    def render_row(self, index: int, width: int) -> list[Cell]:
        missing = self.gap_at(index)
        if missing is not None:
            return [(" " + gap_text(missing, width - 1), self.cstyle("dim"))]
        step = self.step_at(index)
        if step is None or self.store is None:
            return []
        info = self.store.steps[step]
        state = info.state
        mark = ""
        mark_style = self.cstyle("dim")
        if state == LOADING:
            mark = "…"
        elif state == EVICTED:
            mark = "✗"
        elif state == ON_DISK:
            mark = "·"
        cells: list[Cell] = [
            (rfit(str(step) if step >= 0 else "-", 5) + " ", self.cstyle("accent")),
        ]
        if self.has_overview:
            loss, norm = info.loss, info.grad_norm
            bad = self.cstyle("error")
            cells += [
                (  # blank until known: the root of the step's backward (see store.LOSS_KNOWN)
                    rfit("" if loss is None else short_num(loss, 6), 6) + " ",
                    bad if loss is not None and not math.isfinite(loss) else None,
                ),
                (
                    rfit(short_num(norm, 6), 6),
                    bad if norm is not None and not math.isfinite(norm) else None,
                ),
                (
                    bar(norm, self.norm_scale()) + " ",
                    bad if norm is not None and not math.isfinite(norm) else self.cstyle("accent"),
                ),
            ]
        if not self.has_overview or width >= WIDE:
            cells += [
                (rfit(_count(info.n_ops, info.counted), 6) + " ", None),
                (rfit(_count(info.nodes, info.counted), 6) + " ", None),
            ]
            if self._shows_aten(width):
                aten = _count(info.n_aten, info.counted) if info.n_aten else "-"
                cells.append((rfit(aten, 6) + " ", self.cstyle("dim")))
        cells.append((fit(mark, 1), mark_style))
        alerts = self.store.nan_alerts(info)  # eager checks are not NaN/Inf alerts
        if alerts:
            cells.append((f"⚠{alerts}", self.cstyle("error")))
        return cells
