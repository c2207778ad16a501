"""The run's history: loss and gradient norm over every step, and per-module norms.

What a user looks at before choosing where to look: the plot (``HistoryPlot``), and under it,
when the watch gives per-module norms, the heatmap (``ModuleHeatmap``) that names the first
layer to blow up. From the plot's cursor the user can arm a live job:

- ``a``: at a future step (the cursor's, when it is ahead of the job; else the next one),
  edited in a one-line input, posted as :class:`ArmAtStep`;
- ``w``: when a condition holds (``gradnorm>1e3``, ``loss>X``, ``loss<X``, ``nonfinite``),
  prefilled from the cursor's values, checked with the job's own parser
  (``protocol.history.parse_condition``) and posted as :class:`ArmWhen`; a bad one says why on
  one line and posts nothing.

The app sends them to the job (``arm`` with ``at_step`` / ``when``). A recording has no job
to arm: both keys say so. The screen follows the store's history as it grows (a live job's
``history`` events), checking its version a few times a second.
"""

from __future__ import annotations

import math
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Input, Static

from torchscope.protocol.history import parse_condition
from torchscope.session.store import EventStore
from torchscope.tui.screens.host import ArmAtStep, ArmWhen
from torchscope.tui.widgets.history_plot import HistoryPlot
from torchscope.tui.widgets.module_heatmap import ModuleHeatmap
from torchscope.tui.widgets.step_list import short_num

KEYS_TEXT = "←→ cursor  +- zoom  [] pan  0 all  l log  ! NaN  a arm at  w arm when  esc back"
NEEDS_LIVE = "arming needs a live job (this is a recording)"

__all__ = ["NEEDS_LIVE", "ArmAtStep", "ArmWhen", "HistoryScreen"]  # the messages: host.py


class HistoryScreen(Screen[None]):
    """The plot, the heatmap (with module norms) and the arming input (see the module)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "Back", show=False),
        Binding("a", "arm_at", "Arm at step", show=False),
        Binding("w", "arm_when", "Arm when", show=False),
    ]

    def __init__(
        self,
        store: EventStore,
        *,
        live: bool,
        job_step: int | None = None,
        step: int | None = None,
        name: str | None = None,
        id: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id)
        self.store = store
        self.live = live
        #: The step the job is at (the status's), when known: arming must be after it.
        self.job_step = job_step
        self.start_step = step  # where the cursor starts (the step list's row), else the last
        self._asking: str | None = None  # "at" or "when" while the input is open
        self._seen = (-1, -1)  # (id of the index, its version) last shown
        self._spike_said = False  # the note shows a spike's line (the cursor is on it)

    def compose(self) -> ComposeResult:
        with Vertical(id="history-body"):
            yield HistoryPlot(self.store.history_index, id="history-plot")
            yield ModuleHeatmap(self.store.history_index, id="history-heatmap")
            yield Static("", id="history-note")
            yield Input(id="history-input")
            yield Static("", id="history-error")
            yield Static(KEYS_TEXT, id="history-keys")

    @property
    def plot(self) -> HistoryPlot:
        return self.query_one(HistoryPlot)

    @property
    def heatmap(self) -> ModuleHeatmap:
        return self.query_one(ModuleHeatmap)

    def on_mount(self) -> None:
        self.query_one("#history-input").display = False
        self.query_one("#history-error").display = False
        self.query_one("#history-note").display = False
        self.plot.border_title = "loss and |g| over the run"
        self.heatmap.border_title = "|g| per module (b: first blow-up)"
        self.refresh_history()
        if self.start_step is not None:
            self.plot._move(self.start_step)
        self.plot.focus()
        # A live job's history grows while this screen is up: follow it (a version check).
        self.set_interval(0.25, self.refresh_history)

    def refresh_history(self) -> None:
        """Show the store's history again if it changed (the store may replace its index)."""
        index = self.store.history_index
        key = (id(index), index.version)
        if key == self._seen:
            return
        self._seen = key
        self.plot.set_index(index)
        heat = self.heatmap
        heat.set_index(index)
        heat.display = heat.has_modules
        # no taller than its modules need (a headline, a row each, the legend, the border):
        # the plot takes the rest
        heat.styles.max_height = len(heat.modules) + 4
        heat.view, heat.cursor = self.plot.view, self.plot.cursor

    # -- the plot and the heatmap together -------------------------------------------------------
    @on(HistoryPlot.ViewChanged)
    def _view_changed(self, event: HistoryPlot.ViewChanged) -> None:
        self.heatmap.view = (event.start, event.end)

    @on(HistoryPlot.CursorMoved)
    def _cursor_moved(self, event: HistoryPlot.CursorMoved) -> None:
        self.heatmap.cursor = event.step
        self._spike_note(event.step)

    def _spike_note(self, step: int) -> None:
        """On a step the watch flagged as a spike, its line (the alert's) under the plot."""
        line = next(
            (
                str(a.get("message"))
                for a in self.store.alerts
                if a.get("what") == "spike" and a.get("step") == step
            ),
            None,
        )
        if line is not None:
            self.say(line)
            self._spike_said = True
        elif self._spike_said:
            self.say("")
            self._spike_said = False

    @on(ModuleHeatmap.BlowUpSelected)
    def _blow_up(self, event: ModuleHeatmap.BlowUpSelected) -> None:
        self.plot._move(event.step)
        self.say(f"cursor on step {event.step:,}: {event.module} blew up there")

    # -- arming ----------------------------------------------------------------------------------
    @property
    def now(self) -> int | None:
        """The newest step the job is known to have reached."""
        known = [
            s
            for s in (self.job_step, self.store.history_index.last_step, self.store.newest_step)
            if s is not None
        ]
        return max(known) if known else None

    def say(self, text: str) -> None:
        note = self.query_one("#history-note", Static)
        note.update(text)
        note.display = bool(text)

    def error(self, text: str) -> None:
        err = self.query_one("#history-error", Static)
        err.update(text)
        err.display = bool(text)

    def _ask(self, what: str, value: str, prompt: str) -> None:
        self._asking = what
        box = self.query_one("#history-input", Input)
        box.placeholder = prompt
        box.border_title = prompt
        box.value = value
        box.display = True
        box.cursor_position = len(value)
        box.focus()
        self.error("")

    def action_arm_at(self) -> None:
        if not self.live:
            self.say(NEEDS_LIVE)
            return
        now = self.now
        step = self.plot.cursor
        if step is None or (now is not None and step <= now):
            step = (now + 1) if now is not None else 0
        self._ask("at", str(step), "arm at step (enter: arm, esc: cancel)")

    def action_arm_when(self) -> None:
        if not self.live:
            self.say(NEEDS_LIVE)
            return
        value = "nonfinite"
        p = self.plot.point(self.plot.cursor) if self.plot.cursor is not None else None
        if p is not None and p.grad_norm is not None and math.isfinite(p.grad_norm):
            value = f"gradnorm>{short_num(p.grad_norm)}"
        elif p is not None and p.loss is not None and math.isfinite(p.loss):
            value = f"loss>{short_num(p.loss)}"
        self._ask("when", value, "arm when: gradnorm>X, loss>X, loss<X or nonfinite")

    def _close_input(self) -> None:
        self._asking = None
        box = self.query_one("#history-input", Input)
        box.display = False
        self.error("")
        self.plot.focus()

    @on(Input.Submitted, "#history-input")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if self._asking == "at":
            try:
                step = int(text.replace(",", "").replace("_", ""))
            except ValueError:
                self.error(f"{text!r} is not a step number")
                return
            now = self.now
            if now is not None and step <= now:
                self.error(f"step {step:,} has passed (the job is at step {now:,}): a later one")
                return
            self._close_input()
            self.post_message(ArmAtStep(step))
            self.say(f"asked to arm at step {step:,}")
        elif self._asking == "when":
            try:
                cond = parse_condition(text)
            except ValueError as exc:
                self.error(str(exc))
                return
            self._close_input()
            self.post_message(ArmWhen(cond.text))
            self.say(f"asked to arm when {cond.text}")

    def action_back(self) -> None:
        if self._asking is not None:
            self._close_input()
            return
        self.dismiss(None)
