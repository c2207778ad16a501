"""The stepping keys: space, s, n, c to a live job; in a recording the same keys (and S, N, C
back) move its cursor (:mod:`torchscope.tui.replay_stepping`); ``@`` / ``E`` ask the job's next
step traced more closely; ``b`` / ``B`` breakpoints. A mixin of
:class:`~torchscope.tui.screens.main.MainScreen`."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torchscope.protocol.breakpoints import BreakpointError
from torchscope.tui.replay_stepping import Landed, NeedStep, ReplayCursor, Stay
from torchscope.tui.screens.breakpoints import BreakHereScreen, BreakpointsScreen
from torchscope.tui.screens.navigation import Location
from torchscope.tui.stepping import (
    spec_text,
)
from torchscope.tui.store import (
    Changes,
)


class SteppingKeys:
    """Part of MainScreen (see the module's docstring)."""

    def _command(self, cmd: str, **fields: Any) -> bool:
        return self.tapp.command(cmd, **fields)

    def action_pause(self) -> None:
        if not self.live:  # a recording: pause where the cursor is
            row = self.timeline.current_row() if self.current_step is not None else None
            if row is None or getattr(row, "pending", False):
                return
            self._replay_landed(self._cursor().place(self.current_step, row.kind, row.seq))
            return
        if self.store.stepper.paused is not None and not self.tapp.running_elsewhere():
            self.notify("already paused: s steps, n runs to the next step, c continues", timeout=3)
            return
        self._command("pause")  # the status bar says "pausing…" until the job has paused

    def action_step(self) -> None:
        self._step_key("s", "step")

    def action_next(self) -> None:
        self._step_key("n", "next")

    def action_continue(self) -> None:
        self._step_key("c", "continue")

    def action_step_back(self) -> None:
        self._step_key("S")

    def action_prev(self) -> None:
        self._step_key("N")

    def action_continue_back(self) -> None:
        self._step_key("C")

    def _step_key(self, key: str, command: str | None = None) -> None:
        """A stepping key: a command to a live job; in a recording, a move of its cursor."""
        if self.live:
            if command is None:
                self.notify(f"{key} steps back through a recording, not a running job", timeout=3)
            else:
                self._command(command)
            return
        cursor = self._cursor()
        try:
            cursor.set_breakpoints(self.store.stepper.breakpoints)
        except BreakpointError as exc:
            self.notify(str(exc), severity="error", timeout=5)
            return
        self._replay_answer(key, cursor.move(key))

    # -- a recording's cursor (replay_stepping.py) -------------------------------------------
    def _cursor(self) -> ReplayCursor:
        """The recording's cursor, one per store (each source of several has its own)."""
        if self._replay is None or self._replay[0] is not self.store:
            self._replay = (self.store, ReplayCursor(self.store))
            self._replay_wait = None
        return self._replay[1]

    def _replay_answer(self, key: str, answer: Any) -> None:
        if isinstance(answer, NeedStep):
            # Load that step, then make the same move again (apply_changes, when it arrives).
            self._replay_wait = (key, answer.step)
            self.request_step(answer.step)
            self.store.pin({s for s in (self.current_step, answer.step) if s is not None})
            self.status_bar.note(f"looking in step {answer.step}…")
        elif isinstance(answer, Stay):
            self._replay_wait = None
            self.notify(answer.note, timeout=3)
        elif isinstance(answer, Landed):
            self._replay_wait = None
            self._replay_landed(answer)

    def _replay_landed(self, landed: Landed) -> None:
        """Show the recording paused at the landed event, as a live pause is shown."""
        pos = landed.position
        self.status_bar.note(None)
        self._go(Location("timeline", pos.step, pos.kind, pos.seq))
        if self.store.data(pos.step) is None:  # shown once it is loaded (_replay_loaded)
            self._replay_landing = landed
            return
        self._replay_landing = None
        self.store.stepper.paused = landed.pause(self.store)
        self._sync_pause_marks()
        if landed.note:
            self.notify(landed.note, timeout=4)
        self.show_detail()
        self.refresh_status()

    def open_at_first_origin(self) -> None:
        """A recording with alerts opens paused at its first NaN/Inf origin: once per
        recording, and only while the user has not gone anywhere yet (no jump, no pause). The
        ranks of a job open at the job's origin, on the rank that made it (another rank's
        recording holds only its arrival)."""
        key = id(self.store)
        if key in self._opened or not self.at_origin:
            return
        if self.history or self.store.stepper.paused is not None:
            self._opened.add(key)
            return
        landed = self._cursor().open()
        if landed is None:
            other = self.tapp.origin_lane()
            if other is not None:
                self._opened.add(key)
                self.tapp.select_lane(other, align=False)
                self.open_at_first_origin()
            return
        self._opened.add(key)
        # no toast: the status bar tells the origin's story, and nothing covers the screen
        # the user has not looked at yet
        self._replay_landed(dataclasses.replace(landed, note=""))

    def _replay_loaded(self, ch: Changes) -> None:
        """A step the cursor waited for came (or was given up): the same move again."""
        landing = self._replay_landing
        if landing is not None and landing.position.step in ch.loaded:
            self._replay_landed(landing)
        wait = self._replay_wait
        if wait is not None and (wait[1] in ch.loaded or wait[1] in ch.evicted):
            self._replay_wait = None
            self._replay_answer(wait[0], self._cursor().move(wait[0]))

    # -- @ / E: the job's next step, traced more closely -------------------------------------
    def action_aten_next(self) -> None:
        """``@``: the job's next step traced at the aten level, inside the selected row's
        module (every call when nothing, or a row of the root module, is selected)."""
        _, module = self._selected_event()
        if module:
            text = f"next step at the aten level, inside {module}"
            aten = f"^{re.escape(module)}(\\.|$)"
        else:
            text, aten = "next step at the aten level, everywhere", ""
        self._ask_next_step("@", "tracing the next step at the aten level", text, aten=aten)

    def action_eager_check(self) -> None:
        """``E``: the job's next step with each compiled module's call run once more
        eagerly and compared (an alert per call says what differs)."""
        self._ask_next_step(
            "E",
            "checking the next step's compiled modules against eager",
            "next step: compiled modules checked against eager",
            eager_check=True,
        )

    def _ask_next_step(self, key: str, what: str, text: str, **fields: Any) -> None:
        """``arm`` the job for its next step, beside this UI's own hold (``also``)."""
        source = self.tapp.source
        if not source.can_command:
            why = "this is a recording" if not self.live else source.refusal
            self.notify(f"{key}: {what} needs a live job ({why})", timeout=4)
            return
        asked = (text, False, None)

        def answered(ok: bool, payload: Any) -> None:
            if self.asked is not asked:
                return  # asked again since
            if ok:
                step = self.tapp.status.get("step")
                self.asked = (text, True, step if type(step) is int else None)
                self.notify(f"asked the job: {text}", timeout=3)
            else:
                self.asked = None
                why = str(payload)
                if "not supported" in why:  # a trace(live=True) block has no agent to arm
                    why += " (a trace(live=True) block cannot be armed)"
                self.notify(f"{text}: refused: {why}", severity="warning", timeout=6)
            self.refresh_status()

        self.asked = asked
        if self.tapp.command("arm", next=1, also=True, quiet=True, then=answered, **fields):
            self.refresh_status()
        else:
            self.asked = None

    def action_break_here(self) -> None:
        if self.live and not self.tapp.can_command():  # a recording keeps its own
            return
        row = self.timeline.current_row()
        if row is None:
            self.notify("select an op or a backward node first", timeout=3)
            return
        ev = dict(row.event) if row.pending else dict(self.store.event(row))
        if not ev.get("module"):  # a node's module: that of the op that made it
            data = self.store.data(self.current_step)
            op = data.op(row.op_seq) if data is not None and row.op_seq is not None else None
            module = row.module or (op.module if op is not None else "")
            if module:
                ev["module"] = module
        self.app.push_screen(BreakHereScreen(ev, self.detail.cwd), self._break_chosen)

    def _break_chosen(self, spec: dict | None) -> None:
        if spec:
            text = spec_text(spec)
            self.tapp.command("break_add", then=lambda ok, result: self._added(ok, text), **spec)

    def _added(self, ok: bool, text: str) -> None:
        if ok:
            bps = self.store.stepper.breakpoints
            bp_id = max((b["id"] for b in bps), default=None)
            self.notify(f"breakpoint {bp_id}: {text}", timeout=3)

    def action_breakpoints(self) -> None:
        if self.live and not self.tapp.can_command():  # a recording keeps its own
            return
        self.app.push_screen(BreakpointsScreen())
