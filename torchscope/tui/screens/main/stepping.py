"""The stepping keys: space, s, n, c to a live job; in a recording the same keys (and S, N, C
back) move its cursor (:mod:`torchscope.session.replay_cursor`); ``@`` / ``E`` ask the job's
next step traced more closely; ``b`` / ``B`` breakpoints."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Protocol

from torchscope.protocol.breakpoints import BreakpointError
from torchscope.session.replay_cursor import Landed, NeedStep, ReplayCursor, Stay
from torchscope.session.rows import PendingRow
from torchscope.session.stepper_view import spec_text
from torchscope.session.store import Changes, EventStore
from torchscope.tui.screens.breakpoints import BreakHereScreen, BreakpointsScreen
from torchscope.tui.screens.main.context import Asked, Location, ScreenCore

if TYPE_CHECKING:
    from textual.app import App

    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.status_bar import StatusBar


class SteppingScreen(ScreenCore, Protocol):
    """The main screen, as stepping sees it."""

    asked: Asked | None
    at_origin: bool
    back_stack: list[Location]  # jumps backspace goes back over
    current_step: int | None
    detail: DetailPanel
    host: Host
    status_bar: StatusBar

    @property
    def app(self) -> App[object]: ...

    def go(self, loc: Location, *, record: bool = True) -> None: ...

    @property
    def live(self) -> bool: ...

    def refresh_status(self) -> None: ...

    def request_step(self, step: int) -> bool: ...

    def selected_event(self) -> tuple[dict | None, str | None]: ...

    def show_detail(self) -> None: ...

    def sync_pause_marks(self) -> None: ...


class Stepping:
    def __init__(self, main: SteppingScreen) -> None:
        self.main = main
        # a recording's cursor (its store, the cursor) and the move waiting for a step to load
        self._replay: tuple[EventStore, ReplayCursor] | None = None
        self._replay_wait: tuple[str, int] | None = None
        self._replay_landing: Landed | None = None  # landed in a step still loading
        # stores whose recording was opened at its first NaN/Inf origin (or that the user
        # moved in before one was counted): each recording opens there once
        self._opened: set[int] = set()

    def pause(self) -> None:
        m = self.main
        if not m.live:  # a recording: pause where the cursor is
            row = m.timeline.current_row() if m.current_step is not None else None
            if row is None or m.current_step is None or getattr(row, "pending", False):
                return
            self._replay_landed(self._cursor().place(m.current_step, row.kind, row.seq))
            return
        if m.store.stepper.paused is not None and not m.host.running_elsewhere():
            m.notify("already paused: s steps, n runs to the next step, c continues", timeout=3)
            return
        m.host.command("pause")  # the status bar says "pausing…" until the job has paused

    def key(self, key: str, command: str | None = None) -> None:
        """A stepping key: a command to a live job; in a recording, a move of its cursor."""
        m = self.main
        if m.live:
            if command is None:
                m.notify(f"{key} steps back through a recording, not a running job", timeout=3)
            else:
                m.host.command(command)
            return
        cursor = self._cursor()
        try:
            cursor.set_breakpoints(m.store.stepper.breakpoints)
        except BreakpointError as exc:
            m.notify(str(exc), severity="error", timeout=5)
            return
        self._replay_answer(key, cursor.move(key))

    # -- a recording's cursor (replay_cursor.py) ---------------------------------------------
    def _cursor(self) -> ReplayCursor:
        """The recording's cursor, one per store (each source of several has its own)."""
        store = self.main.store
        if self._replay is None or self._replay[0] is not store:
            self._replay = (store, ReplayCursor(store))
            self._replay_wait = None
        return self._replay[1]

    def _replay_answer(self, key: str, answer: Any) -> None:
        m = self.main
        if isinstance(answer, NeedStep):
            # Load that step, then make the same move again (loaded(), when it arrives).
            self._replay_wait = (key, answer.step)
            m.request_step(answer.step)
            m.store.pin({s for s in (m.current_step, answer.step) if s is not None})
            m.status_bar.note(f"looking in step {answer.step}…")
        elif isinstance(answer, Stay):
            self._replay_wait = None
            m.notify(answer.note, timeout=3)
        elif isinstance(answer, Landed):
            self._replay_wait = None
            self._replay_landed(answer)

    def _replay_landed(self, landed: Landed) -> None:
        """Show the recording paused at the landed event, as a live pause is shown."""
        m = self.main
        pos = landed.position
        m.status_bar.note(None)
        m.go(Location("timeline", pos.step, pos.kind, pos.seq))
        if m.store.data(pos.step) is None:  # shown once it is loaded (loaded())
            self._replay_landing = landed
            return
        self._replay_landing = None
        m.store.stepper.paused = landed.pause(m.store)
        m.sync_pause_marks()
        if landed.note:
            m.notify(landed.note, timeout=4)
        m.show_detail()
        m.refresh_status()

    def open_at_first_origin(self) -> None:
        """A recording with alerts opens paused at its first NaN/Inf origin: once per
        recording, and only while the user has not gone anywhere yet (no jump, no pause). The
        ranks of a job open at the job's origin, on the rank that made it (another rank's
        recording holds only its arrival)."""
        m = self.main
        key = id(m.store)
        if key in self._opened or not m.at_origin:
            return
        if m.back_stack or m.store.stepper.paused is not None:
            self._opened.add(key)
            return
        landed = self._cursor().open()
        if landed is None:
            other = m.host.origin_lane()
            if other is not None:
                self._opened.add(key)
                m.host.select_lane(other, align=False)
                self.open_at_first_origin()
            return
        self._opened.add(key)
        # no toast: the status bar tells the origin's story, and nothing covers the screen
        # the user has not looked at yet
        self._replay_landed(dataclasses.replace(landed, note=""))

    def loaded(self, ch: Changes) -> None:
        """A step the cursor waited for came (or was given up): the same move again."""
        landing = self._replay_landing
        if landing is not None and landing.position.step in ch.loaded:
            self._replay_landed(landing)
        wait = self._replay_wait
        if wait is not None and (wait[1] in ch.loaded or wait[1] in ch.evicted):
            self._replay_wait = None
            self._replay_answer(wait[0], self._cursor().move(wait[0]))

    # -- @ / E: the job's next step, traced more closely -------------------------------------
    def aten_next(self) -> None:
        """``@``: the job's next step traced at the aten level, inside the selected row's
        module (every call when nothing, or a row of the root module, is selected)."""
        _, module = self.main.selected_event()
        if module:
            text = f"next step at the aten level, inside {module}"
            aten = f"^{re.escape(module)}(\\.|$)"
        else:
            text, aten = "next step at the aten level, everywhere", ""
        self._ask_next_step("@", "tracing the next step at the aten level", text, aten=aten)

    def eager_check(self) -> None:
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
        m = self.main
        source = m.host.source
        if not source.can_command:
            why = "this is a recording" if not m.live else source.refusal
            m.notify(f"{key}: {what} needs a live job ({why})", timeout=4)
            return
        asked: Asked = (text, False, None)

        def answered(ok: bool, payload: Any) -> None:
            if m.asked is not asked:
                return  # asked again since
            if ok:
                step = m.host.status.get("step")
                m.asked = (text, True, step if type(step) is int else None)
                m.notify(f"asked the job: {text}", timeout=3)
            else:
                m.asked = None
                why = str(payload)
                if "not supported" in why:  # a trace(live=True) block has no agent to arm
                    why += " (a trace(live=True) block cannot be armed)"
                m.notify(f"{text}: refused: {why}", severity="warning", timeout=6)
            m.refresh_status()

        m.asked = asked
        if m.host.command("arm", next=1, also=True, quiet=True, then=answered, **fields):
            m.refresh_status()
        else:
            m.asked = None

    # -- b / B: breakpoints ------------------------------------------------------------------
    def break_here(self) -> None:
        m = self.main
        if m.live and not m.host.can_command():  # a recording keeps its own
            return
        row = m.timeline.current_row()
        if row is None:
            m.notify("select an op or a backward node first", timeout=3)
            return
        ev = dict(row.event) if isinstance(row, PendingRow) else dict(m.store.event(row))
        if not ev.get("module"):  # a node's module: that of the op that made it
            data = m.store.data(m.current_step)
            op = data.op(row.op_seq) if data is not None and row.op_seq is not None else None
            module = row.module or (op.module if op is not None else "")
            if module:
                ev["module"] = module
        m.app.push_screen(BreakHereScreen(ev, m.detail.cwd), self._break_chosen)

    def _break_chosen(self, spec: dict | None) -> None:
        if spec:
            text = spec_text(spec)
            self.main.host.command(
                "break_add", then=lambda ok, result: self._added(ok, text), **spec
            )

    def _added(self, ok: bool, text: str) -> None:
        if ok:
            bps = self.main.store.stepper.breakpoints
            bp_id = max((b["id"] for b in bps), default=None)
            self.main.notify(f"breakpoint {bp_id}: {text}", timeout=3)

    def breakpoints(self) -> None:
        m = self.main
        if m.live and not m.host.can_command():  # a recording keeps its own
            return
        m.app.push_screen(BreakpointsScreen())
