"""The paused point on screen: which row carries the ⏸ mark (a row still to run is shown as a
pending row), selecting it when the job pauses, and the values view of its tensors. A mixin
of :class:`~torchscope.tui.screens.main.MainScreen`."""

from __future__ import annotations

from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.tui.stepping import (
    ValuesView,
    pause_event,
    pause_key,
    tensor_choices,
)
from torchscope.tui.store import (
    PendingRow,
    Row,
)


class PauseMarks:
    """Part of MainScreen (see the module's docstring)."""

    # -- step-through ------------------------------------------------------------------------
    def _is_paused_row(self, row: Row | PendingRow) -> bool:
        if row.pending:
            return True
        key = self.timeline.paused_key
        return key is not None and key == (row.kind, row.seq)

    def _pending_row(self, pause: dict) -> PendingRow:
        """One PendingRow per pause (the detail panel knows rows by identity)."""
        key = pause_key(pause)
        if self._pending is None or self._pending[0] != key:
            self._pending = (key, PendingRow(pause_event(pause)))
        return self._pending[1]

    def _sync_pause_marks(self) -> None:
        """Mark the paused event in the timeline: its row, or a pending row when it has none
        (a job paused before an op or node runs)."""
        pause = self.store.stepper.paused
        if pause is None:
            self._pending = None
            self.timeline.set_paused(None, None)
            return
        ev = pause_event(pause)
        step = pause.get("step")
        if type(step) is not int:
            step = ev.get("step")
        here = self.current_step
        if not (type(step) is not int or here is None or step == here or step not in self.store):
            self.timeline.set_paused(None, None)  # paused in another step than the one shown
            return
        kind = ev.get("kind") if ev.get("kind") in (GRAD, ATEN) else OP
        seq = ev.get("seq")
        data = self.store.data(here)
        if data is not None and type(seq) is int and data.has_row(kind, seq):
            self.timeline.set_paused((kind, seq), None)
        else:
            self.timeline.set_paused(None, self._pending_row(pause))

    def _pause_changed(self) -> None:
        """The job paused somewhere else, or went on."""
        stepper = self.store.stepper
        pause = stepper.paused
        if pause is None:
            self.values = None
            self._sync_pause_marks()
            if stepper.resumed_by == "lease":
                self.notify(
                    "the job resumed by itself: its lease ran out", severity="warning", timeout=6
                )
            self.show_detail()
            self.refresh_status()
            return
        step = pause.get("step")
        if type(step) is not int:
            step = pause_event(pause).get("step")
        if type(step) is int and step in self.store and step != self.current_step:
            self.show_step(step)
        else:
            self._sync_pause_marks()
        if self.center == "graph":
            self.center = "timeline"
            self.timeline.focus()
        self._select_paused()
        self.show_detail()
        self.refresh_status()

    def _select_paused(self) -> bool:
        tl = self.timeline
        key = tl.paused_key
        # not shown: an aten call under a folded row (select unfolds it), or hidden by the
        # filter (then the filter goes)
        if key is not None and tl.paused_index() is None and not tl.select(*key) and tl.pattern:
            self._apply_filter(None)
            tl.select(*key)
        index = tl.paused_index()
        if index is None:
            return False
        tl.move_cursor(index, center=True)
        return True

    def _values_for(self, pause: dict) -> ValuesView:
        key = pause_key(pause)
        if self.values is None or self.values.key != key:
            self.values = ValuesView(key, tensor_choices(pause))
        return self.values
