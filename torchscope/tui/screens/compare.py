"""``x``: the selected op or backward node side by side — across the open sources (the ranks of
a job, recordings), or against the op ``X`` marked (another step, or another source) — with
each tensor's stats per column and the outlier marked (see :mod:`torchscope.session.compare`).

Columns are aligned as ``torchscope diff`` aligns (step, op name, module path, occurrence). A
step that a source has not in memory is asked for; its column says "loading" until it comes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import ScrollableContainer, Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from torchscope.protocol.events import ATEN
from torchscope.session.align import describe_key, find_key
from torchscope.session.compare import Column, CompareTable, build_table
from torchscope.session.steps import EVICTED, LOADING, ON_DISK
from torchscope.tui.screens.host import Applied, Host, host_of, subscribe

if TYPE_CHECKING:
    from torchscope.tui.lanes import Lane


@dataclass(frozen=True)
class CompareSpec:
    """What ``x`` was pressed on: the shown lane, its step, the selected event's alignment
    key; and the mark ``(lane, step, key, label)`` if one is set."""

    lane: int
    step: int
    key: tuple
    mark: tuple | None = None


MODE_TITLES = {"sources": "across sources", "mark": "with the marked op"}


class CompareScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("q", "dismiss", "Close", show=False),
        Binding("x", "other_mode", "Other comparison", show=False),
        Binding("tab", "other_mode", "Other comparison", show=False),
    ]

    DEFAULT_CSS = """
    CompareScreen {
        align: center middle;
    }
    #compare-box {
        width: 96%;
        height: 92%;
        border: round $accent;
        background: $surface;
        padding: 0 1;
    }
    #compare-head {
        height: auto;
    }
    #compare-scroll {
        height: 1fr;
        overflow-x: auto;
        overflow-y: auto;
    }
    #compare-table {
        width: auto;
    }
    #compare-keys {
        height: 1;
        color: $text-muted;
    }
    """

    def __init__(
        self,
        spec: CompareSpec,
        modes: list[str],
        *,
        shown_step: Callable[[], int | None] = lambda: None,
    ) -> None:
        super().__init__()
        self.spec = spec
        #: the main screen's step now (its lane keeps it in memory too)
        self.shown_step = shown_step
        self.modes = modes
        self.mode = modes[0]
        self.table: CompareTable | None = None
        self.loading = False

    @property
    def host(self) -> Host:
        return host_of(self)

    def compose(self) -> ComposeResult:
        with Vertical(id="compare-box"):
            yield Static("", id="compare-head")
            with ScrollableContainer(id="compare-scroll"):
                yield Static("", id="compare-table")
            yield Static("", id="compare-keys")

    def on_mount(self) -> None:
        self.rebuild()
        self.query_one("#compare-scroll").focus()
        subscribe(self.host.applied, self, self._applied)

    def _applied(self, applied: Applied) -> None:
        ch = applied.changes
        if ch.loaded or ch.evicted or ch.steps_changed:
            self.data_changed()

    # -- columns ---------------------------------------------------------------------------
    def _column(self, lane: Lane, label: str, step: int, key: tuple | None) -> Column:
        """``key``'s event in ``lane`` at ``step``, loading the step if it must."""
        store = lane.store
        col = Column(label=label, step=step, lane=lane.index)
        if not lane.has_step(step):
            col.missing = f"no step {step}"
            return col
        data = store.data(step)
        if data is None:
            info = store.info(step)
            state = info.state if info is not None else None
            if state in (ON_DISK, LOADING) or (state == EVICTED and lane.source.can_reload):
                if state != LOADING:
                    store.mark_loading(step)
                    lane.source.request_step(step)
                self.loading = True
                col.missing = f"loading step {step}…"
            else:
                col.missing = f"step {step} is no longer in memory"
            return col
        row = find_key(store, data, key)
        if row is None and key is not None and key[0] == ATEN and not store.has_aten:
            col.missing = "no aten calls recorded (record with --aten)"
            return col
        if row is None:
            col.missing = f"not in step {step}"
            return col
        col.event = dict(store.event(row))
        return col

    def columns(self) -> list[Column]:
        app = self.host
        spec = self.spec
        labels = app.labels()
        self.loading = False
        pins: dict[int, set[int]] = {}
        out: list[Column] = []

        def add(lane_index: int, label: str, step: int, key: tuple | None) -> None:
            lane = app.lanes[lane_index]
            pins.setdefault(lane_index, set()).add(step)
            out.append(self._column(lane, label, step, key))

        if self.mode == "sources":
            for lane in app.lanes:
                add(lane.index, labels[lane.index], spec.step, spec.key)
        else:
            assert spec.mark is not None
            m_lane, m_step, m_key, m_label = spec.mark
            multi = app.multi
            where = f"{m_label} " if multi else ""
            add(m_lane, f"marked: {where}step {m_step}", m_step, m_key)
            here = f"{labels[spec.lane]} " if multi else ""
            add(spec.lane, f"{here}step {spec.step}", spec.step, spec.key)
            if spec.key != m_key:
                add(spec.lane, f"{here}step {spec.step}: the marked op", spec.step, m_key)
        for index, steps in pins.items():
            lane = app.lanes[index]
            shown = self.shown_step()
            if lane is app.lane and shown is not None:
                steps = steps | {shown}
            lane.store.pin(steps)
        return out

    # -- rendering -------------------------------------------------------------------------
    def rebuild(self) -> None:
        cols = self.columns()
        table = build_table(cols)
        self.table = table
        spec = self.spec
        title = f"[b]compare {MODE_TITLES[self.mode]}[/]: " + _esc(describe_key(spec.key))
        if self.mode == "mark" and spec.mark is not None and spec.mark[2] != spec.key:
            title += " and the marked " + _esc(describe_key(spec.mark[2]))
        lines = [title]
        if table.why:
            style = "$error" if table.outlier is not None else "$text-muted"
            lines.append(f"[{style}]{_esc(table.why)}[/]")
        if self.loading:
            lines.append("[$warning]loading steps…[/]")
        self.query_one("#compare-head", Static).update("\n".join(lines))
        self.query_one("#compare-table", Static).update(_render(table))
        keys = "esc close"
        if len(self.modes) > 1:
            other = next(m for m in self.modes if m != self.mode)
            keys = f"x / tab: compare {MODE_TITLES[other]} · " + keys
        keys += " · ◆ outlier · ≠ off the median beyond the tolerance"
        self.query_one("#compare-keys", Static).update(keys)

    def data_changed(self) -> None:
        """A source loaded or dropped a step: columns that were loading may be ready."""
        if self.loading or self.table is None or not self.table.aligned:
            self.rebuild()

    def action_other_mode(self) -> None:
        if len(self.modes) < 2:
            return
        i = self.modes.index(self.mode)
        self.mode = self.modes[(i + 1) % len(self.modes)]
        self.rebuild()

    def screen_text(self) -> str:
        """The table as plain text (tests)."""
        return self.table.text() if self.table is not None else ""


def _esc(text: str) -> str:
    from textual.markup import escape

    return escape(text)


def _render(table: CompareTable) -> Table:
    out = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    out.add_column("", style="bold", no_wrap=True)
    for j, col in enumerate(table.columns):
        head = Text(col.label, style="bold")
        if table.outlier == j:
            head = Text("◆ " + col.label, style="bold red")
        out.add_column(head, no_wrap=True, justify="right")
    for label, cells in table.rows:
        if all(c is None for c in cells):
            out.add_row(Text(label, style="bold underline"), *[""] * len(cells))
            continue
        row = []
        for cell in cells:
            if cell is None:
                row.append(Text("—", style="dim"))
                continue
            text = cell.text
            style = ""
            if cell.outlier:
                text, style = "◆ " + text, "bold red"
            elif cell.bad:
                style = "red"
            elif cell.differs:
                text, style = "≠ " + text, "yellow"
            row.append(Text(text, style=style))
        out.add_row(Text(label), *row)
    return out
