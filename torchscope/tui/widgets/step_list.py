"""The steps of the trace: all of them in a replay, a growing list when live.

Each line: step, number of forward ops, number of backward nodes, and a mark for alerts and for
steps that are not in memory.
"""

from __future__ import annotations

from torchscope.tui.store import EVICTED, LOADING, ON_DISK, EventStore
from torchscope.tui.widgets.virtual_list import Cell, VirtualList, fit, rfit


def _count(n: int, counted: bool) -> str:
    text = f"{n:,}" if n < 100_000 else f"{n / 1000:.0f}k"
    return text if counted else text + "…"


class StepList(VirtualList):
    """One line per step; ``Highlighted`` says which step the cursor is on."""

    HEADER_LINES = 1

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.store: EventStore | None = None

    def bind_store(self, store: EventStore) -> None:
        self.store = store

    def row_count(self) -> int:
        return len(self.store.order) if self.store is not None else 0

    def step_at(self, index: int) -> int | None:
        if self.store is None or not 0 <= index < len(self.store.order):
            return None
        return self.store.order[index]

    @property
    def current_step(self) -> int | None:
        return self.step_at(self.cursor)

    def select_step(self, step: int, *, user: bool = False) -> bool:
        if self.store is None:
            return False
        index = self.store.step_index(step)
        if index is None:
            return False
        if index != self.cursor:
            self.move_cursor(index, user=user)
        else:
            self.scroll_to_cursor()
        return True

    def empty_text(self) -> str:
        return "no steps yet"

    def render_header(self, width: int) -> list[Cell]:
        return [(f"{rfit('step', 5)} {rfit('ops', 6)} {rfit('nodes', 6)}", None)]

    def render_row(self, index: int, width: int) -> list[Cell]:
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
            (rfit(_count(info.n_ops, info.counted), 6) + " ", None),
            (rfit(_count(info.nodes, info.counted), 6) + " ", None),
            (fit(mark, 1), mark_style),
        ]
        if info.n_alerts:
            cells.append((f"⚠{info.n_alerts}", self.cstyle("error")))
        return cells
