"""The compare view's model: one op or backward node side by side, a column per source (the
ranks of a job, recordings) or per step (a marked op against the current one), its tensors'
stats in rows, the outlier marked.

Columns are aligned by the caller (:func:`torchscope.session.align.find_key`: step, op name,
module path and occurrence, as ``torchscope diff`` aligns). Here, per tensor and stat, each
column is judged against the median of the columns: a column whose NaN/Inf count others do not
share, or whose norm or mean lies beyond ``atol + rtol * scale`` of the median (``diff``'s
tolerance, with the tensor's RMS in the scale), differs; the column that differs most (any
NaN/Inf first) is *the* outlier. With two columns the median is their midpoint: both differ
alike, so only a NaN/Inf on one side names an outlier.

No textual imports here, and no torch.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from torchscope.analysis.diff import STAT_KEYS, Options, compare_events
from torchscope.protocol.events import ATEN, GRAD, OP, Event, number_text
from torchscope.session.stepper_view import event_name

__all__ = ["Cell", "Column", "CompareTable", "build_table"]

# Which tensors an event shows first: what an op makes, what a node sends on.
GROUPS = {
    OP: ("outputs", "inputs"),
    ATEN: ("outputs", "inputs"),
    GRAD: ("grad_inputs", "grad_outputs"),
}
_JUDGED = ("norm", "mean")  # the stats an outlier is judged on


@dataclass
class Column:
    """One side: ``event`` (decoded) or, when there is none, ``missing`` saying why."""

    label: str
    step: int | None
    event: dict | None = None
    missing: str | None = None
    lane: int | None = None


@dataclass
class Cell:
    text: str
    differs: bool = False  # beyond the tolerance from the median of the columns
    bad: bool = False  # NaN/Inf here
    outlier: bool = False  # the column that differs most, in this row


@dataclass
class CompareTable:
    columns: list[Column]
    title: str = ""
    #: (row label, cells); a row whose cells are all None is a section heading
    rows: list[tuple[str, list[Cell | None]]] = field(default_factory=list)
    outlier: int | None = None  # the column that differs most over all rows
    why: str = ""  # one line: what makes it the outlier
    aligned: bool = True  # every column has the event

    def text(self) -> str:
        """The table as plain text (tests, debugging)."""
        lines = [self.title, "  ".join(c.label for c in self.columns)]
        for label, cells in self.rows:
            lines.append(f"{label}: " + "  ".join("" if c is None else c.text for c in cells))
        if self.why:
            lines.append(self.why)
        return "\n".join(lines)


def _stats(summary: Any) -> dict:
    s = summary.get("stats") if isinstance(summary, dict) else None
    return s if isinstance(s, dict) else {}


def _numel(summary: dict) -> int | None:
    shape = summary.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        return None
    return math.prod(shape)


def _rms(summary: Any) -> float:
    if not isinstance(summary, dict):
        return 0.0
    norm = _stats(summary).get("norm")
    n = _numel(summary)
    if not isinstance(norm, (int, float)) or not n or not math.isfinite(norm):
        return 0.0
    return abs(norm) / math.sqrt(n)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_bad(summary: Any) -> bool:
    st = _stats(summary)
    return bool(st.get("nan")) or bool(st.get("inf"))


def _tensors(event: dict | None, group: str) -> list:
    value = event.get(group) if event is not None else None
    return value if isinstance(value, list) else []


def _kind(columns: list[Column]) -> str | None:
    for c in columns:
        if c.event is not None:
            return c.event.get("kind")
    return None


def build_table(columns: list[Column], opts: Options | None = None) -> CompareTable:
    """The rows of the compare view for ``columns`` (aligned events, or why one is missing)."""
    opts = opts or Options()
    table = CompareTable(columns=columns)
    table.aligned = all(c.event is not None for c in columns)
    kind = _kind(columns)
    first = next((c.event for c in columns if c.event is not None), None)
    if first is None:
        table.title = "nothing to compare: " + "; ".join(
            f"{c.label}: {c.missing or 'no event'}" for c in columns
        )
        return table
    where = first.get("param") or first.get("module") or "top level"
    table.title = f"{event_name(first)} in {where}"
    rows = table.rows

    def ident(label: str, get: Any) -> None:
        rows.append((label, [Cell(get(j, c)) for j, c in enumerate(columns)]))

    ident("step", lambda j, c: "-" if c.step is None else str(c.step))
    ident("event", lambda j, c: _event_text(c))
    ident("source", lambda j, c: "" if c.event is None else _source(c.event.get("source")))
    worst: tuple[float, int, str] | None = None  # (score, column, why)
    for group in GROUPS.get(kind or OP, ()):
        n = max((len(_tensors(c.event, group)) for c in columns), default=0)
        for i in range(n):
            found_at = [_tensors(c.event, group)[i : i + 1] for c in columns]
            sums = [t[0] if t else None for t in found_at]
            rows.append((f"{group}[{i}]", [None] * len(columns)))
            ident("  shape", lambda j, c, s=sums: _shape(s[j]))
            ident("  dtype", lambda j, c, s=sums: _dtype(s[j]))
            present = [j for j, x in enumerate(sums) if isinstance(x, dict)]
            bad = [_is_bad(x) for x in sums]
            lone_bad = any(bad) and not all(bad[j] for j in present)
            if lone_bad and (worst is None or worst[0] < math.inf):
                j = bad.index(True)
                worst = (math.inf, j, f"{group}[{i}] has NaN/Inf where others have none")
            scale = max((_rms(x) for x in sums), default=0.0)
            for key in (*STAT_KEYS, "nan", "inf"):
                values = [_stats(x).get(key) if isinstance(x, dict) else None for x in sums]
                cells: list[Cell | None] = [
                    None if not isinstance(x, dict) else Cell(number_text(v), bad=bad[j])
                    for j, (x, v) in enumerate(zip(sums, values, strict=True))
                ]
                if key in ("nan", "inf") and lone_bad:
                    for j, cell in enumerate(cells):
                        if cell is not None and values[j]:
                            cell.differs = cell.outlier = True
                if key in _JUDGED:
                    found = _judge(values, scale, opts)
                    if found is not None:
                        devs, med = found
                        for d, cell in zip(devs, cells, strict=True):
                            if d > 0 and cell is not None:
                                cell.differs = True
                        best = max(range(len(devs)), key=lambda j: devs[j])
                        ranked = sorted(devs, reverse=True)
                        # one column alone off the median (two columns: both are, alike)
                        if len(ranked) > 2 and ranked[0] > ranked[1]:
                            cell = cells[best]
                            if cell is not None:
                                cell.outlier = True
                            if worst is None or devs[best] > worst[0]:
                                worst = (
                                    devs[best],
                                    best,
                                    f"{group}[{i}] {key} {number_text(values[best])} "
                                    f"vs median {number_text(med)}",
                                )
                rows.append((f"  {key}", cells))
    if worst is not None:
        table.outlier = worst[1]
        table.why = f"outlier: {columns[worst[1]].label}: {worst[2]}"
    else:
        events = [c.event for c in columns if c.event is not None]
        if len(events) == 2:  # what torchscope diff would say of the pair
            # a column holds the decoded event as a plain dict; diff reads it as an Event
            differ = compare_events(Event(events[0]), Event(events[1]), opts)
            table.why = f"they differ: {differ[1]}" if differ else "the same within the tolerance"
        elif len(events) > 2:
            differs = any(c is not None and c.differs for _, cells in rows for c in cells)
            table.why = (
                "they differ beyond the tolerance (no single outlier)"
                if differs
                else "the same within the tolerance"
            )
    return table


def _source(source: Any) -> str:
    """``train.py:22``: the file's name and line (the full path is in the detail panel)."""
    if not isinstance(source, str) or not source:
        return "-"
    path, sep, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if sep and line.isdigit() else source


def _event_text(c: Column) -> str:
    if c.event is None:
        return c.missing or "?"
    text = f"#{c.event.get('seq')}"
    if c.event.get("node_id") is not None:
        text += f" node {c.event['node_id']}"
    return text


def _judge(values: list, scale: float, opts: Options) -> tuple[list[float], float] | None:
    """Relative distance of each value from the median (0 within the tolerance), and the
    median; None when fewer than two columns have a finite value."""
    finite = [v for v in values if _finite(v)]
    if len(finite) < 2:
        return None
    med = statistics.median(finite)
    devs = []
    for v in values:
        if not _finite(v):
            devs.append(0.0)
            continue
        d = abs(v - med)
        room = max(abs(v), abs(med), scale)
        if d <= opts.atol + opts.rtol * room:
            devs.append(0.0)
        else:
            devs.append(d / room if room > 0 else math.inf)
    return devs, med


def _shape(s: Any) -> str:
    if not isinstance(s, dict):
        return ""
    shape = s.get("shape")
    return "x".join(str(d) for d in shape) if isinstance(shape, list) and shape else "scalar"


def _dtype(s: Any) -> str:
    return str(s.get("dtype") or "?") if isinstance(s, dict) else ""
