"""The steps of the trace: all of them in a replay, a growing list when live.

Each line: step, number of forward ops, number of backward nodes (and of aten calls, at the
aten level, where the panel has room: the screen widens it), and a mark for alerts and for
steps that are not in memory. Once known, the step's loss (the value at the root of its
backward: blank before that runs) and global gradient norm come first, with a bar scaling that
norm against every step's (a spike stands out), and the panel's subtitle is a sparkline of
the norms across all steps: a replay's count pass finds them (see countpass), a live session's
source as the events stream in (``torchscope.session.countpass.LiveOverview``, the same counter).

Where traced steps are not consecutive (152 then 164: the job ran untraced between, dormant
or attached later), a dim row between them says so (``… 11 steps not traced``, shorter where
the panel is narrow); the cursor passes over it. With the run's history (a ``history`` reply
on attach, ``history`` events after, a recording's), the steps it has get rows of their own
instead, dim and marked not traced, with their loss and |g|; the steps it folded (older than
its ~100k at full resolution) one row per bucket, their range and min-max. Gap rows are left
for steps nothing knows about.
"""

from __future__ import annotations

import bisect
import math

from torchscope.protocol.history import Bucket, StepPoint
from torchscope.session.format import SPARK
from torchscope.session.history_index import HistoryIndex
from torchscope.session.steps import EVICTED, LOADING, ON_DISK
from torchscope.session.store import EventStore
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


# Row segments (see StepList._layout): a run of traced steps (indices a..b into store.order),
# a run of consecutive history-only steps (indices a..b into the history index's points),
# one gap row (a: how many steps have no row), one bucket row (a: index into the buckets).
TRACED, HISTORY_ROWS, GAP, BUCKET = range(4)
Segment = tuple[int, int, int]  # (kind, a, b)


class StepList(VirtualList):
    """One line per step; ``Highlighted`` says which step the cursor is on.

    With a run history (``store.history_index``) the list holds the whole run: the traced
    steps (``store.order``), a row per step the history has that was not traced here (its
    loss and |g|, marked not traced), a row per bucket the history folded (a range of old
    steps, min-max), and gap rows only where neither says anything. Rows are found through
    runs (segments) and bisection, never one Python object per row, so 100k history steps
    cost a few runs.
    """

    HEADER_LINES = 1

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.store: EventStore | None = None
        self._overview_at = -1  # store.overview_version the scale below was taken at
        self._norm_scale: tuple[float, float] | None = None
        self._segs: list[Segment] = []
        self._starts: list[int] = []  # the first row of each segment
        self._traced: list[tuple[int, int]] = []  # (order index a, first row) of TRACED segs
        self._rows = 0
        self._layout_of: tuple | None = None
        #: The step the cursor is on: rows come and go before it (a run's history arriving
        #: after its traced steps) and the cursor stays on its step, not on its row number.
        self._cursor_step: int | None = None

    @property
    def has_overview(self) -> bool:
        store = self.store
        return store is not None and (store.overview_version > 0 or bool(store.history_index))

    def norm_scale(self) -> tuple[float, float] | None:
        store = self.store
        if store is not None and store.overview_version != self._overview_at:
            self._overview_at = store.overview_version
            scale = _scale(store.overview()[1])
            ys = store.history_index.grad_norm.ys
            if ys:  # the whole run's norms: a spike before the attach sets the scale too
                lo, hi = min(0.0, min(ys)), max(ys)
                if scale is not None:
                    lo, hi = min(lo, scale[0]), max(hi, scale[1])
                scale = (lo, hi)
            self._norm_scale = scale
        return self._norm_scale

    def sparkline(self, width: int) -> str:
        """The gradient norms (else the losses) across all steps, for the panel's subtitle:
        the run's history where there is one, else the traced steps'."""
        if not self.has_overview or self.store is None:
            return ""
        index = self.store.history_index
        if index:
            label = "|g|" if index.grad_norm else "loss"
            attr = "grad_norm" if index.grad_norm else "loss"
            values: list[float | None] = [getattr(p, attr) for p in index.points]
            return f"{label} {spark_across(values, width - len(label) - 1)}"
        losses, norms = self.store.overview()
        label, values = ("|g|", norms) if any(v is not None for v in norms) else ("loss", losses)
        return f"{label} {spark_across(values, width - len(label) - 1)}"

    def bind_store(self, store: EventStore) -> None:
        self.store = store
        self._layout_of = None
        self._cursor_step = None

    # -- the rows ------------------------------------------------------------------------------
    def _layout(self) -> list[Segment]:
        """The row segments (built again when the steps or the history changed)."""
        store = self.store
        order = store.order if store is not None else []
        index = store.history_index if store is not None else None
        # The store's counters, never ids: a history index replaced twice between two looks
        # can be a new object at a freed one's address, with the same version.
        key = (store.order_version, store.history_version) if store is not None else None
        if key != self._layout_of:
            self._layout_of = key
            self._build(order, index)
        return self._segs

    def _build(self, order: list[int], index: HistoryIndex | None) -> None:
        segs: list[Segment] = []
        steps = index.steps if index is not None else []
        buckets = index.buckets if index is not None else []
        n_points = len(steps)
        prev: int | None = None  # the last step that has a row (or a bucket) so far
        pi = 0  # next history point without a row

        def gap_to(step: int) -> None:
            if prev is not None and prev >= 0 and step > prev + 1:
                segs.append((GAP, step - prev - 1, 0))

        def points_before(limit: int | None) -> None:
            nonlocal pi, prev
            j = n_points if limit is None else bisect.bisect_left(steps, limit, lo=pi)
            while pi < j:
                end = index.run_end(pi, j) if index is not None else j
                gap_to(steps[pi])
                segs.append((HISTORY_ROWS, pi, end))
                prev = steps[end - 1]
                pi = end

        ti = bi = 0
        while ti < len(order) or bi < len(buckets):
            if bi < len(buckets) and (ti >= len(order) or buckets[bi].first <= order[ti]):
                b = buckets[bi]
                points_before(b.first)
                gap_to(b.first)
                segs.append((BUCKET, bi, 0))
                prev = b.last if prev is None else max(prev, b.last)
                bi += 1
                continue
            step = order[ti]
            points_before(step)
            if pi < n_points and steps[pi] == step:
                pi += 1  # traced: its own row (which falls back on the point's values)
            gap_to(step)
            last = segs[-1] if segs else None
            if last is not None and last[0] == TRACED and last[2] == ti and prev == step - 1:
                segs[-1] = (TRACED, last[1], ti + 1)
            else:
                segs.append((TRACED, ti, ti + 1))
            prev = step if prev is None else max(prev, step)
            ti += 1
        points_before(None)
        starts, traced, row = [], [], 0
        for kind, lo, hi in segs:
            starts.append(row)
            if kind == TRACED:
                traced.append((lo, row))
            row += hi - lo if kind in (TRACED, HISTORY_ROWS) else 1
        self._segs, self._starts, self._traced, self._rows = segs, starts, traced, row

    def row_count(self) -> int:
        if self.store is None:
            return 0
        self._layout()
        return self._rows

    def _entry(self, index: int) -> tuple[int, int]:
        """Row ``index`` -> (segment number, offset in it); call with 0 <= index < rows."""
        k = bisect.bisect_right(self._starts, index) - 1
        return k, index - self._starts[k]

    def _row_of(self, i: int) -> int:
        """The row of store.order[i]."""
        self._layout()
        k = bisect.bisect_right(self._traced, i, key=lambda t: t[0]) - 1
        a, row = self._traced[k]
        return row + i - a

    def row_of_step(self, step: int) -> int | None:
        """The row about ``step``: its traced row, else its history row, else its bucket's."""
        store = self.store
        if store is None:
            return None
        i = store.step_index(step)
        if i is not None:
            return self._row_of(i)
        self._layout()
        index = store.history_index
        for (kind, a, b), start in zip(self._segs, self._starts, strict=True):
            if kind == HISTORY_ROWS and index.steps[a] <= step <= index.steps[b - 1]:
                j = bisect.bisect_left(index.steps, step, a, b)
                return start + j - a if index.steps[j] == step else None
            if kind == BUCKET and index.buckets[a].first <= step <= index.buckets[a].last:
                return start
        return None

    def refresh_rows(self, *, clear: bool = True) -> None:
        """As VirtualList's, the cursor kept on its step (its row may have moved)."""
        super().refresh_rows(clear=clear)
        step = self._cursor_step
        row = self.row_of_step(step) if step is not None else None
        if row is None:
            self._cursor_step = self.row_step(self.cursor)
        elif row != self.cursor:
            self.cursor = row
            self.scroll_to_cursor()
            self.reveal_after_refresh()

    def _seg_at(self, index: int) -> tuple[Segment, int] | None:
        if self.store is None or not 0 <= index < self.row_count():
            return None
        k, off = self._entry(index)
        return self._segs[k], off

    def gap_at(self, index: int) -> int | None:
        """How many steps were not traced, when row ``index`` is a gap row."""
        at = self._seg_at(index)
        return at[0][1] if at is not None and at[0][0] == GAP else None

    def step_at(self, index: int) -> int | None:
        """The traced step of row ``index`` (None for a gap, history or bucket row)."""
        at = self._seg_at(index)
        if at is None or at[0][0] != TRACED or self.store is None:
            return None
        return self.store.order[at[0][1] + at[1]]

    def history_at(self, index: int) -> StepPoint | None:
        """The history's point of row ``index`` when it is a step that was not traced."""
        at = self._seg_at(index)
        if at is None or at[0][0] != HISTORY_ROWS or self.store is None:
            return None
        return self.store.history_index.points[at[0][1] + at[1]]

    def bucket_at(self, index: int) -> Bucket | None:
        """The history's bucket (old steps folded) of row ``index``."""
        at = self._seg_at(index)
        if at is None or at[0][0] != BUCKET or self.store is None:
            return None
        return self.store.history_index.buckets[at[0][1]]

    def row_step(self, index: int) -> int | None:
        """The step row ``index`` is about, traced or not (a bucket's first step)."""
        step = self.step_at(index)
        if step is not None:
            return step
        point = self.history_at(index)
        if point is not None:
            return point.step
        bucket = self.bucket_at(index)
        return bucket.first if bucket is not None else None

    def move_cursor(self, index: int, *, user: bool = False, center: bool = False) -> None:
        """As VirtualList's, passing over gap rows (on in the direction of travel)."""
        count = self.row_count()
        if count and 0 <= index < count and self.gap_at(index) is not None:
            index = index + 1 if index >= self.cursor else index - 1
            if index < 0:
                index = 1
        super().move_cursor(index, user=user, center=center)
        self._cursor_step = self.row_step(self.cursor)

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

    def _values(
        self, loss: float | None, norm: float | None, *, partial: bool = False
    ) -> list[Cell]:
        """The loss, |g| and bar cells. ``partial``: a backward still running (paused in
        it): the norm of the gradients made so far, dim and marked ``…``, with no bar, so it
        does not read as the step's (a collapse)."""
        bad = self.cstyle("error")
        if partial and norm is not None and math.isfinite(norm):
            dim = self.cstyle("dim")
            return [
                (rfit("" if loss is None else short_num(loss, 6), 6) + " ", None),
                (rfit(short_num(norm, 5) + "…", 6), dim),
                (bar(None, self.norm_scale()) + " ", dim),
            ]
        return [
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

    def _history_row(self, point: StepPoint, width: int) -> list[Cell]:
        """A step the history has and this UI never traced: its values, dim, marked."""
        dim = self.cstyle("dim")
        cells: list[Cell] = [(rfit(str(point.step), 5) + " ", dim)]
        cells += self._values(point.loss, point.grad_norm)
        if width >= WIDE:
            cells.append((fit("not traced", 14), dim))
        else:
            cells.append(("○", dim))  # not traced, where the words do not fit
        return cells

    def _bucket_row(self, b: Bucket, width: int) -> list[Cell]:
        """Old steps the history folded: their range, loss and |g| min-max."""
        parts = [f"{b.first}..{b.last}"]
        for label, series in (("loss", b.loss), ("|g|", b.grad_norm)):
            if series.lo is not None or series.hi is not None:
                parts.append(f"{label} {short_num(series.lo, 6)}..{short_num(series.hi, 6)}")
        bad = any(
            x is not None and not math.isfinite(x)
            for x in (b.loss.hi, b.loss.last, b.grad_norm.hi, b.grad_norm.last)
        )
        return [(fit("▤ " + " ".join(parts), width), self.cstyle("error" if bad else "dim"))]

    def render_row(self, index: int, width: int) -> list[Cell]:
        at = self._seg_at(index)
        if at is None or self.store is None:
            return []
        (kind, a, _b), off = at
        if kind == GAP:
            return [(" " + gap_text(a, width - 1), self.cstyle("dim"))]
        if kind == HISTORY_ROWS:
            return self._history_row(self.store.history_index.points[a + off], width)
        if kind == BUCKET:
            return self._bucket_row(self.store.history_index.buckets[a], width)
        step = self.store.order[a + off]
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
            if loss is None or norm is None:  # the history knows what the trace did not show
                point = self.store.history_index.point(step)
                if point is not None:
                    loss = point.loss if loss is None else loss
                    norm = point.grad_norm if norm is None else norm
            partial = info.backward_open and info.grad_norm is not None and norm == info.grad_norm
            cells += self._values(loss, norm, partial=partial)
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
