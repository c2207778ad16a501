"""The step the main screen shows: which one (``[`` ``]``, the step list, a jump), asking the
source for it while it is not in memory, following a live job's newest step (``f``, ``end``),
and what goes with it as batches come: the step list and its sparkline, a recording opened on
an empty step moved to its first traced one, the progress row.

:class:`ShownStep` sees the screen as a :class:`StepScreen`: only what it uses of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torchscope.session.steps import EVICTED, LOADING, ON_DISK
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from textual.widget import Widget
    from textual.widgets import Label, ProgressBar

    from torchscope.session.store import Changes
    from torchscope.tui.screens.host import Host
    from torchscope.tui.screens.main.context import Location
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.graph_tree import GraphTree
    from torchscope.tui.widgets.step_list import StepList


class StepScreen(ScreenCore, Protocol):
    """The main screen, as the shown step sees it."""

    host: Host
    current_step: int | None
    pending: Location | None  # a jump waiting for its step to load
    follow: bool
    center: str  # "timeline" or "graph"
    steps: StepList
    graph: GraphTree
    detail: DetailPanel
    progress_row: Widget
    progress_label: Label
    progress_bar: ProgressBar

    @property
    def live(self) -> bool: ...

    def set_class(self, add: bool, *class_names: str, update: bool = True) -> object: ...

    def refresh_title(self) -> None: ...

    def refresh_status(self) -> None: ...

    def sync_pause_marks(self) -> None: ...


class ShownStep:
    def __init__(self, main: StepScreen) -> None:
        self.main = main
        #: the step a recording opened on by itself, until the user moves: when its counts
        #: show it holds no op or node (steps before a recorder armed the job, which hold
        #: only the session and the run's history), the first traced step replaces it
        self._opened_on: int | None = None
        self._count_progress: tuple[float, float, str] | None = None
        self._spark_key: tuple[int, int, int] | None = None

    # -- which step --------------------------------------------------------------------------
    def show(self, step: int, *, keep_position: bool = False) -> None:
        m = self.main
        store = m.store
        if step not in store:
            return
        m.current_step = step
        store.pin({step})
        m.steps.select_step(step)
        data = store.data(step)
        message = ""
        if data is None:
            if self.request(step):
                message = f"loading step {step}…"
            else:
                message = (
                    f"step {step} is no longer in memory "
                    "(the UI keeps the newest steps; record the job to replay older ones)"
                )
        keep = m.timeline.current_row() if keep_position else None
        m.timeline.set_step(store, step, data, message)
        if keep is not None:
            m.timeline.select(keep.kind, keep.seq, center=True)
        if m.center == "graph":
            m.graph.set_step(store, data, message)
        m.sync_pause_marks()
        if data is None and m.timeline.pending is None:
            m.detail.show_message(message)
        elif data is not None and m.timeline.row_count() == 0:
            m.detail.show_message(m.timeline.empty_text())
        m.refresh_title()
        self.update_progress()
        m.refresh_status()

    def request(self, step: int) -> bool:
        """Ask the source for a step that is not in memory (a step already loading is not
        asked again). False when it cannot come back: evicted from a live job's stream."""
        m = self.main
        store, source = m.store, m.host.source
        info = store.info(step)
        if info is None:
            return False
        if info.state == LOADING:
            return True
        if info.state == ON_DISK or (info.state == EVICTED and source.can_reload):
            store.mark_loading(step)
            source.request_step(step)
            m.steps.refresh_rows()
            return True
        return False

    def step_by(self, delta: int) -> None:
        """``[`` / ``]``: the step before or after the shown one."""
        m = self.main
        order = m.store.order
        if not order:
            return
        i = m.store.step_index(m.current_step) if m.current_step is not None else None
        i = 0 if i is None else max(0, min(len(order) - 1, i + delta))
        self.set_follow(False)
        self.show(order[i])

    def from_step_list(self) -> None:
        """The user moved the step list's cursor: its step is shown (following stops unless
        it is the newest)."""
        m = self.main
        # the cursor's step, not the message's row: rows may have come in before it since
        step = m.steps.current_step
        if step is not None and step != m.current_step:
            if step != m.store.newest_step:
                self.set_follow(False)
            self.show(step)

    # -- follow ------------------------------------------------------------------------------
    def set_follow(self, on: bool) -> None:
        m = self.main
        m.follow = on and m.live

    def follow_changed(self, on: bool) -> None:
        """The screen's ``follow`` changed: the timeline follows too."""
        m = self.main
        m.timeline.follow = on
        newest = m.store.newest_step
        if on and newest is not None:
            if newest != m.current_step:
                self.show(newest)
            m.timeline.data_changed()
        m.refresh_title()

    def follow_key(self) -> None:
        """Follow the newest step (live). Pressed while following, it stays on (any move in
        the timeline turns it off; ``end`` or ``f`` turn it on again)."""
        m = self.main
        if not m.live:
            m.notify(
                "f follows a live job's newest step; a recording does not grow "
                "([ ] or :N move between steps)",
                timeout=4,
            )
            return
        if m.follow:
            newest = m.store.newest_step
            if newest is not None and newest != m.current_step:
                self.show(newest)
            m.timeline.data_changed()  # back to the newest row
            m.notify("following the newest step (any move stops it)", timeout=2)
            return
        self.set_follow(True)

    # -- a batch -----------------------------------------------------------------------------
    def apply(self, ch: Changes) -> int | None:
        """The step list and the shown step after a batch; returns the step shown then."""
        m = self.main
        store = m.store
        if ch.steps_added or ch.steps_changed or ch.evicted or ch.removed:
            m.set_class(store.has_aten, "-aten")  # room for the steps' aten call counts
            m.steps.refresh_rows()
            self.sparkline()
        if m.current_step in ch.removed:  # an empty trailing step, dropped
            m.current_step = None
            if m.pending is not None and m.pending.step in ch.removed:
                m.pending = None
        if m.current_step is None and store.order:
            newest = store.newest_step
            first = newest if m.follow and newest is not None else store.order[0]
            self.show(first)
            self._opened_on = None if m.live else first
        elif m.follow and store.newest_step is not None and (store.newest_step != m.current_step):
            self.show(store.newest_step)
        if self._opened_on is not None and (ch.steps_changed or ch.loaded):
            self._open_on_a_traced_step()
        step = m.current_step
        if step is not None:
            if step in ch.loaded or step in ch.started:
                self.show(step, keep_position=True)
            elif step in ch.evicted and store.data(step) is None:
                self.show(step)  # its load was given up: ask again
            elif step in ch.events_changed:
                m.timeline.data_changed()
                if m.center == "graph":
                    m.graph.set_step(store, store.data(step))
            elif step in ch.steps_changed:
                info = store.info(step)
                if info is not None and info.state == EVICTED and store.data(step) is None:
                    self.show(step)
        return step

    def _open_on_a_traced_step(self) -> None:
        """Move a recording opened on an empty step to its first step with ops or nodes."""
        m = self.main
        store, opened = m.store, self._opened_on
        if m.current_step != opened:  # the user moved, or an origin was opened
            self._opened_on = None
            return
        info = store.info(opened) if opened is not None else None
        if info is None or not info.counted:
            return
        if info.n_ops or info.nodes or info.n_aten:
            self._opened_on = None
            return
        for step in store.order:
            later = store.info(step)
            if later is None or not later.counted:
                return  # not known yet: wait for the count pass
            if later.n_ops or later.nodes or later.n_aten:
                self._opened_on = None
                self.show(step)
                return

    # -- the step list's sparkline, the progress row -----------------------------------------
    def sparkline(self) -> None:
        """The steps panel's subtitle: gradient norms (or losses) across all steps."""
        m = self.main
        key = (m.store.overview_version, len(m.store.order), m.steps.size.width)
        if key == self._spark_key:
            return
        self._spark_key = key
        m.steps.border_subtitle = m.steps.sparkline(max(0, m.steps.size.width - 6))

    def progress(self, ch: Changes) -> None:
        """The progress row after a batch."""
        if ch.progress is not None:
            self._count_progress = ch.progress
        elif ch.progress_done:
            self._count_progress = None
        if ch.progress is not None or ch.progress_done or ch.events_changed or ch.evicted:
            self.update_progress()

    def update_progress(self) -> None:
        """The progress row: the shown step streaming in, else the source's own progress (a
        scan, the count pass)."""
        m = self.main
        step = m.current_step
        loading = m.store.loading.get(step) if step is not None else None
        if loading is not None and step is not None:
            done, total, events = loading
            info = m.store.info(step)
            expect = info.n_events if info is not None and info.counted else 0
            if expect >= events > 0:
                self._show_progress(
                    f"loading step {step}: {events:,} of {expect:,} events", events, expect
                )
            else:
                self._show_progress(
                    f"loading step {step}: {events:,} events, part {done} of {total}", done, total
                )
        elif self._count_progress is not None:
            counted, of, label = self._count_progress
            self._show_progress(label, counted, of)
        else:
            self._show_progress(None)

    def _show_progress(self, label: str | None, done: float = 0, total: float = 0) -> None:
        m = self.main
        if label is None:
            m.progress_row.display = False
            return
        m.progress_row.display = True
        m.progress_label.update(label)
        m.progress_bar.update(total=max(total, 1), progress=done)
