"""The paused point on screen: which row carries the ⏸ mark (a row still to run is shown as a
pending row), selecting it when the job pauses, and the values view of its tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.session.rows import PendingRow, Row
from torchscope.session.stepper_view import (
    ValuesView,
    pause_event,
    pause_key,
    tensor_choices,
)
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from torchscope.session.stepper_view import ValuesView


class PauseScreen(ScreenCore, Protocol):
    """The main screen, as the pause marks see it."""

    center: str  # "timeline" or "graph"
    current_step: int | None
    values: ValuesView | None

    def clear_filter(self) -> None: ...

    def refresh_status(self) -> None: ...

    def show_detail(self) -> None: ...

    def show_step(self, step: int, *, keep_position: bool = False) -> None: ...


class PauseMarks:
    def __init__(self, main: PauseScreen) -> None:
        self.main = main
        # one PendingRow per pause (the detail panel knows rows by identity)
        self._pending: tuple[Any, PendingRow] | None = None

    def forget(self) -> None:
        self._pending = None

    def is_paused_row(self, row: Row | PendingRow) -> bool:
        if row.pending:
            return True
        key = self.main.timeline.paused_key
        return key is not None and key == (row.kind, row.seq)

    def _pending_row(self, pause: dict) -> PendingRow:
        key = pause_key(pause)
        if self._pending is None or self._pending[0] != key:
            self._pending = (key, PendingRow(pause_event(pause)))
        return self._pending[1]

    def sync(self) -> None:
        """Mark the paused event in the timeline: its row, or a pending row when it has none
        (a job paused before an op or node runs)."""
        m = self.main
        pause = m.store.stepper.paused
        if pause is None:
            self._pending = None
            m.timeline.set_paused(None, None)
            return
        ev = pause_event(pause)
        step = pause.get("step")
        if type(step) is not int:
            step = ev.get("step")
        here = m.current_step
        if not (type(step) is not int or here is None or step == here or step not in m.store):
            m.timeline.set_paused(None, None)  # paused in another step than the one shown
            return
        raw = ev.get("kind")
        kind = str(raw) if raw in (GRAD, ATEN) else OP
        seq = ev.get("seq")
        data = m.store.data(here)
        if data is not None and type(seq) is int and data.has_row(kind, seq):
            m.timeline.set_paused((kind, seq), None)
        else:
            m.timeline.set_paused(None, self._pending_row(pause))

    def changed(self) -> None:
        """The job paused somewhere else, or went on."""
        m = self.main
        stepper = m.store.stepper
        pause = stepper.paused
        if pause is None:
            m.values = None
            self.sync()
            if stepper.resumed_by == "lease":
                m.notify(
                    "the job resumed by itself: its lease ran out", severity="warning", timeout=6
                )
            m.show_detail()
            m.refresh_status()
            return
        step = pause.get("step")
        if type(step) is not int:
            step = pause_event(pause).get("step")
        if type(step) is int and step in m.store and step != m.current_step:
            m.show_step(step)
        else:
            self.sync()
        if m.center == "graph":
            m.center = "timeline"
            m.timeline.focus()
        self.select()
        m.show_detail()
        m.refresh_status()

    def select(self) -> bool:
        m = self.main
        tl = m.timeline
        key = tl.paused_key
        # not shown: an aten call under a folded row (select unfolds it), or hidden by the
        # filter (then the filter goes)
        if key is not None and tl.paused_index() is None and not tl.select(*key) and tl.pattern:
            m.clear_filter()
            tl.select(*key)
        index = tl.paused_index()
        if index is None:
            return False
        tl.move_cursor(index, center=True)
        return True

    def values_for(self, pause: dict) -> ValuesView:
        m = self.main
        key = pause_key(pause)
        if m.values is None or m.values.key != key:
            m.values = ValuesView(key, tensor_choices(pause))
        return m.values
