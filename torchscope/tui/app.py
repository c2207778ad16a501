"""The torchscope terminal UI: one app, the same screens for a live job and a trace file.

``run_tui(source)`` runs it; ``TorchscopeApp(source)`` is the app itself (tests drive it with
``App.run_test()``). The source runs on a Textual thread worker and fills an inbox; a ~30 Hz
timer drains the inbox and applies everything in it inside one ``batch_update()``, so a burst
of events costs one repaint, never one widget write per event.

Commands to a live job (``command``) are queued to the source's thread, the only one that
talks to the job; their replies come back through the same inbox, are applied to the store
(every stepping reply carries the job's state) and then handed to whoever asked. A refusal is
a notification, never an exception.

Several sources (the ranks of a torchrun job, recordings side by side) are one
:class:`~torchscope.tui.lanes.Lane` each: its own source thread, inbox, store and status. The
main screen shows one lane at a time (``1``-``9``, ``r``), keeping the step and the op (aligned
by name, module and occurrence); the source bar says which lanes are paused. Stepping
commands (``space``, ``s``, ``n``, ``c``) go to every lane that takes commands unless ``o``
narrowed them to the shown one; ``x`` compares the selected op across lanes (or with the op
``X`` marked, in another step).

The app knows no screen's insides: it tells the screens what changed by signals (``applied``,
``restarted``, ``lane_switch``, ``breakpoints_changed``, ``redraw``), and the screens call it
through the :class:`~torchscope.tui.screens.host.Host` protocol it satisfies. It imports
screens only to push them.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from textual import on
from textual.app import App
from textual.binding import Binding, BindingType
from textual.signal import Signal
from textual.worker import Worker

from torchscope.protocol.breakpoints import BreakpointError
from torchscope.session.inbox import Inbox
from torchscope.session.items import ErrorMessage, NewSession
from torchscope.session.rate import RateMeter
from torchscope.session.replay_cursor import ReplayBreakpoints, first_origin
from torchscope.session.store import EventStore
from torchscope.tui.keys import Hint, bindings, hint
from torchscope.tui.lanes import STEPPING, JobAlerts, Lane, job_alerts, lane_labels, rank_lanes
from torchscope.tui.screens.help import HelpScreen
from torchscope.tui.screens.host import (
    Applied,
    ArmAtStep,
    ArmWhen,
    LaneSwitch,
    Mark,
    Redraw,
    ReplyHandler,
)
from torchscope.tui.screens.main import MainScreen
from torchscope.tui.sources.base import CommandRefused, EventSource
from torchscope.tui.sources.live import LiveSource

#: Called with (ok, result or one-line refusal) when a command's answer arrives (re-exported).
__all__ = ["ReplyHandler", "TorchscopeApp", "run_tui"]


class TorchscopeApp(App[int]):
    """Step-through view of a PyTorch job: forward ops, backward nodes, gradients."""

    TITLE = "torchscope"
    CSS_PATH = "app.tcss"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS: ClassVar[list[BindingType]] = [
        *bindings("app"),  # keys.py has every key; here the sources' numbered ones
        *(Binding(str(i + 1), f"lane({i})", f"Source {i + 1}", show=False) for i in range(9)),
        Binding("r", "cycle_lane(1)", "Next source", show=False),
        Binding("R", "cycle_lane(-1)", "Previous source", show=False),
    ]

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """Colours of the focus cues, chosen to survive 256 and 16 colours (tmux without
        COLORTERM): a mid grey for unfocused panel borders (242 / bright black) and a neutral
        grey for the cursor row of an unfocused list (237 / bright black), while the focused
        panel keeps ``$accent`` and its cursor row ``$block-cursor-background``."""
        return {"panel-border": "#6C6C6C", "cursor-blurred": "#3A3A3A"}

    def __init__(
        self,
        source: EventSource | Sequence[EventSource],
        *,
        first: int = 0,
        follow_job: bool = False,
        max_events: int = 250_000,
        tick_hz: float = 30.0,
        max_apply: int = 20_000,
        at_origin: bool = True,
    ) -> None:
        super().__init__()
        sources = [source] if isinstance(source, EventSource) else list(source)
        if not sources:
            raise ValueError("the UI needs at least one source")
        self.lanes = [Lane.of(s, i, max_events) for i, s in enumerate(sources)]
        self.current = max(0, min(first, len(self.lanes) - 1))
        #: stepping commands go to every lane ("all") or to the shown one ("one")
        self.scope = "all"
        #: (lane, step, alignment key, label) of the op ``X`` marked
        self.mark: Mark | None = None
        self.tick_hz = tick_hz
        self.max_apply = max_apply
        # what changed, for the screens (see screens/host.py)
        self.applied: Signal[Applied] = Signal(self, "applied")
        self.restarted: Signal[int] = Signal(self, "restarted")
        self.lane_switch: Signal[LaneSwitch] = Signal(self, "lane_switch")
        self.breakpoints_changed: Signal[None] = Signal(self, "breakpoints_changed")
        self.redraw: Signal[Redraw] = Signal(self, "redraw")
        #: the main screen is mounted and listens: the tick may apply what the sources sent
        self.views_ready = False
        #: a recording with alerts opens paused at its first NaN/Inf origin (``--from-start``:
        #: at its first step)
        self.main = MainScreen(
            self, live=any(lane.live for lane in self.lanes), at_origin=at_origin
        )
        self.waiting: dict[tuple[int, int], tuple[str, ReplyHandler | None, bool]] = {}
        self.sent: list[tuple[str, dict[str, Any]]] = []  # every command sent (tests)
        self.stop_event = threading.Event()
        self.worker: Worker | None = None
        self.fatal: str | None = None
        self.ticks = 0
        #: live, opened on one rank or on the one running job: add the job's other ranks as
        #: they register (torchrun starts them one by one)
        self.follow_job = follow_job
        self._job_checked = 0.0
        self._job_until: float | None = None

    # -- the shown lane --------------------------------------------------------------------------
    @property
    def lane(self) -> Lane:
        return self.lanes[self.current]

    @property
    def multi(self) -> bool:
        return len(self.lanes) > 1

    @property
    def source(self) -> EventSource:
        return self.lane.source

    @property
    def store(self) -> EventStore:
        return self.lane.store

    @store.setter
    def store(self, store: EventStore) -> None:
        self.lane.store = store

    @property
    def inbox(self) -> Inbox:
        return self.lane.inbox

    @property
    def status(self) -> dict[str, Any]:
        return self.lane.status

    @property
    def rate(self) -> RateMeter:
        return self.lane.rate

    def labels(self) -> list[str]:
        return lane_labels(self.lanes)

    def label(self, lane: Lane) -> str:
        return self.labels()[lane.index]

    def screen_ready(self) -> None:
        """The main screen is mounted and subscribed: from the next tick on, what the sources
        sent is applied (until then it waits in the inboxes)."""
        self.views_ready = True

    def show_lane(self, index: int) -> None:
        """The main screen shows lane ``index`` from now on (see ``select_lane``)."""
        self.current = index

    def on_mount(self) -> None:
        self.push_screen(self.main)
        for lane in self.lanes:
            self._start(lane)
        self.worker = self.lanes[0].worker
        self.set_interval(1 / self.tick_hz, self.tick)
        self.set_interval(0.5, self._status_tick)

    def _start(self, lane: Lane) -> None:
        lane.worker = self.run_worker(
            functools.partial(self._run_source, lane),
            name=f"source {lane.index}",
            group=f"source-{lane.index}",
            thread=True,
            exclusive=True,
            exit_on_error=False,
        )

    def _run_source(self, lane: Lane) -> None:
        try:
            lane.source.run(lane.inbox, self.stop_event)
        except Exception as exc:  # a bug in a source must not take the UI down silently
            lane.inbox.put(ErrorMessage(f"source failed: {type(exc).__name__}: {exc}"))
            lane.inbox.status(state="error", error=str(exc))

    def tick(self) -> None:
        """Apply what the sources produced since the last tick (also callable from tests)."""
        if not self.views_ready:
            return
        self.ticks += 1
        bar = False
        for lane in self.lanes:
            items = lane.inbox.drain(self.max_apply)
            if not items:
                continue
            bar = True
            # A new run of the followed job: what came before belongs to the old store.
            while True:
                cut = next(
                    (i for i, item in enumerate(items) if isinstance(item, NewSession)), None
                )
                if cut is None:
                    break
                if cut:
                    self._apply(lane, items[:cut])
                self._new_session(lane)
                items = items[cut + 1 :]
            if items:
                self._apply(lane, items)
        if bar:
            self.refresh_bar()

    def _ask_history(self, lane: Lane) -> None:
        """A live job just said hello: ask for its run's history so far (steps before the
        attach, their loss and gradient norms); the store takes the reply."""
        after = lane.store.history.latest()
        fields = {"since": after.step} if after is not None else {}
        try:
            token = lane.source.command("history", **fields)
        except CommandRefused:
            return
        self.waiting[(lane.index, token)] = ("history", None, True)

    @on(ArmAtStep)
    def _arm_at_step(self, message: ArmAtStep) -> None:
        self._arm_from_history({"at_step": message.step}, f"arm at step {message.step:,}")

    @on(ArmWhen)
    def _arm_when(self, message: ArmWhen) -> None:
        self._arm_from_history({"when": message.condition}, f"arm when {message.condition}")

    def _arm_from_history(self, fields: dict[str, Any], text: str) -> None:
        if not self.can_command():
            return

        def answered(ok: bool, payload: Any) -> None:
            if ok:
                self.notify(f"asked the job: {text}", timeout=3)
            else:
                self.notify(f"{text}: refused: {payload}", severity="warning", timeout=6)

        self.command("arm", then=answered, quiet=True, **fields)

    def _new_session(self, lane: Lane) -> None:
        lane.fresh_store()
        self.restarted.publish(lane.index)
        who = f"{self.label(lane)}: " if self.multi else ""
        self.notify(f"{who}the job started again: following the new run", timeout=4)

    def _apply(self, lane: Lane, items: list) -> None:
        shown = lane is self.lane
        with self.batch_update():
            changes = lane.store.apply(items)
            if changes.status:
                lane.status.update(changes.status)
                if changes.status.get("state") == "error":
                    lane.fatal = str(changes.status.get("error"))
                    who = f"{self.label(lane)}: " if self.multi else ""
                    self.fatal = self.fatal or who + lane.fatal
            lane.rate.add(changes.events)
            if not shown:
                for err in changes.errors:
                    self.notify(f"{self.label(lane)}: {err}", severity="error", timeout=8)
            # before the replies: a reply's handler finds the screens as this batch left them
            self.applied.publish(Applied(lane.index, changes, shown))
            if shown and changes.breakpoints_changed:
                self.breakpoints_changed.publish(None)
            if changes.paused_changed:
                self._lane_paused(lane)
            if changes.session and lane.live:
                self._ask_history(lane)
            for reply in changes.replies:
                self._answered(lane, *reply)

    # -- commands to the job -------------------------------------------------------------------
    def can_command(self, *, say: bool = True) -> bool:
        """Whether commands can reach a job; when not, say why (a notification)."""
        if self.source.can_command:
            return True
        if say:
            self.notify(self.source.refusal, severity="warning", timeout=4)
        return False

    def command_lanes(self, cmd: str) -> list[Lane]:
        """Where ``cmd`` goes: a stepping command to every lane that takes commands (unless
        ``o`` narrowed it to the shown one), anything else to the shown lane."""
        if cmd in STEPPING and self.scope == "all" and self.multi:
            lanes = [lane for lane in self.lanes if lane.source.can_command]
            if lanes:
                return lanes
        return [self.lane]

    def command(
        self, cmd: str, *, then: ReplyHandler | None = None, quiet: bool = False, **fields: Any
    ) -> bool:
        """Send ``cmd`` to the job (through the source's thread). ``then(ok, payload)`` runs on
        the UI thread when the shown lane's answer comes; a refusal is also a notification
        unless ``quiet``. Stepping commands go to every rank (see ``command_lanes``). False
        when the shown lane's source cannot send commands at all (said, too)."""
        if cmd in ReplayBreakpoints.COMMANDS and self.lane.source.mode != "live":
            return self._replay_breakpoints(cmd, then, quiet, fields)
        lanes = self.command_lanes(cmd)
        shown_ok = any_ok = False
        for lane in lanes:
            try:
                token = lane.source.command(cmd, **fields)
            except CommandRefused as exc:
                if lane is self.lane:
                    self.notify(str(exc), severity="warning", timeout=4)
                continue
            shown = lane is self.lane
            self.waiting[(lane.index, token)] = (cmd, then if shown else None, quiet)
            lane.sent.append((cmd, dict(fields)))
            any_ok = True
            shown_ok = shown_ok or shown
        if any_ok:
            self.sent.append((cmd, dict(fields)))
        return shown_ok if self.lane in lanes else any_ok

    def _replay_breakpoints(
        self, cmd: str, then: ReplyHandler | None, quiet: bool, fields: dict[str, Any]
    ) -> bool:
        """A recording's breakpoints, kept here (the replay's cursor stops at them): the
        command answered at once, as a job would."""
        try:
            payload = self.lane.breakpoints.answer(cmd, fields)
        except (BreakpointError, ValueError) as exc:
            if not quiet:
                self.notify(str(exc), severity="error", timeout=6)
            if then is not None:
                then(False, str(exc))
            return True
        self.sent.append((cmd, dict(fields)))
        _, changed = self.store.stepper.on_state(payload["state"])
        if then is not None:
            then(True, payload)
        if changed:
            self.breakpoints_changed.publish(None)
            self.redraw.publish(Redraw(bar=False))
        return True

    def running_elsewhere(self) -> bool:
        """Whether a stepping command now also reaches a lane that is not paused (another
        rank, with commands acting on all of them)."""
        return any(
            lane.paused is None for lane in self.command_lanes("pause") if lane is not self.lane
        )

    def _answered(
        self, lane: Lane, tag: str, token: int, cmd: str, fields: Any, payload: Any
    ) -> None:
        # token 0: the source's own request
        _, then, quiet = self.waiting.pop((lane.index, token), (cmd, None, True))
        ok = tag == "reply"
        if not ok and not quiet:
            who = f"{self.label(lane)}: " if self.multi else ""
            self.notify(who + str(payload), severity="error", timeout=6)
        if then is not None:
            try:
                then(ok, payload)
            except Exception as exc:  # a screen that went away meanwhile, say
                self.log.error(f"reply handler for {cmd!r} failed: {exc!r}")

    def _lane_paused(self, lane: Lane) -> None:
        """A lane paused or went on. When one rank stops at a breakpoint while commands act
        on all ranks, the others that are running are paused too (at their next op or node),
        so that ``s``/``n``/``c`` then move them together."""
        began = lane.note_pause()
        if lane is not self.lane and began and lane.paused is not None:
            reason = lane.paused.get("reason") or "paused"
            why = "" if reason == "paused" else f": {reason}"  # a pause asked for says no more
            key = f" ({lane.index + 1})" if lane.index < 9 else ""
            self.notify(f"{self.label(lane)} paused{why}{key}", timeout=4)
        if not (began and self.multi and self.scope == "all" and lane.paused is not None):
            return
        reason = str(lane.paused.get("reason") or "")
        if not reason.startswith("breakpoint"):
            return  # a step, next or pause this UI asked of every rank: they stop alike
        others = [
            o
            for o in self.lanes
            if o is not lane
            and o.source.can_command
            and o.paused is None
            and o.store.stepper.mode in (None, "run")
            and o.status.get("connected")
        ]
        for o in others:
            try:
                token = o.source.command("pause")
            except CommandRefused:
                continue
            self.waiting[(o.index, token)] = ("pause", None, True)
            o.sent.append(("pause", {}))
        if others:
            names = ", ".join(self.label(o) for o in others)
            self.notify(f"{self.label(lane)} stopped at {reason}: pausing {names}", timeout=4)

    # -- several sources ---------------------------------------------------------------------
    def lane_hints(self) -> list[Hint]:
        """Key bar hints for several sources (none for one, unless an op is marked)."""
        out: list[Hint] = []
        if self.multi:
            n = len(self.lanes)
            shown = f"1-{min(n, 9)}" if n > 1 else "1"
            out.append((shown, "source", "source"))
            if any(lane.source.can_command for lane in self.lanes):
                out.append(hint("toggle_scope", None if self.scope == "all" else "all ranks"))
            out.append(hint("compare"))
        elif self.mark is not None:
            out.append(hint("compare", "compare with mark"))
        return out

    def refresh_bar(self) -> None:
        self.redraw.publish(Redraw(status=False))

    def action_lane(self, index: int) -> None:
        if self.screen is not self.main:
            return
        if index >= len(self.lanes):
            if self.multi:
                self.notify(f"no source {index + 1}: {len(self.lanes)} are open", timeout=2)
            return
        self.select_lane(index)

    def action_cycle_lane(self, delta: int) -> None:
        if self.screen is not self.main:
            return
        if not self.multi:
            self.notify("one source open (several: torchscope tui A.tsc B.tsc)", timeout=3)
            return
        self.select_lane((self.current + delta) % len(self.lanes))

    def origin_lane(self) -> int | None:
        """The lane of the job's first NaN/Inf origin (the earliest step, then the lowest
        rank) when the lanes are recorded ranks of one job and it is not the shown one."""
        if self.source.mode == "live":
            return None
        ranks = rank_lanes(self.lanes)
        if ranks is None:
            return None
        firsts = []
        for rank, lane in ranks.items():
            landed = first_origin(lane.store)
            if landed is not None:
                firsts.append((landed.position.step, rank, lane.index))
        if not firsts:
            return None
        index = min(firsts)[2]
        return None if index == self.current else index

    def job_alerts(self) -> JobAlerts | None:
        """Every rank's alerts when the lanes are the ranks of one job (the alerts list's job
        view); else None."""
        return job_alerts(self.lanes, self.current)

    def select_lane(self, index: int, *, align: bool = True) -> None:
        """Show lane ``index``, at the same step and (``align``) on the same op where it has
        them: the main screen moves its view over and calls ``show_lane`` when the new lane
        is the shown one."""
        if index == self.current or not 0 <= index < len(self.lanes):
            return
        self.lane_switch.publish(LaneSwitch(self.current, index, align))
        self.show_lane(index)  # no main screen listening yet: the lane is shown all the same

    def action_toggle_scope(self) -> None:
        if self.screen is not self.main:
            return
        if not self.multi or not any(lane.source.can_command for lane in self.lanes):
            self.notify("o: with several live ranks, c s n space act on all or on one", timeout=3)
            return
        self.scope = "one" if self.scope == "all" else "all"
        label = self.label(self.lane)
        self.notify(
            f"c s n space: {label} only" if self.scope == "one" else "c s n space: all ranks",
            timeout=3,
        )
        self.redraw.publish(Redraw())

    def _status_tick(self) -> None:
        if self.views_ready:
            self.redraw.publish(Redraw(bar=False))
            if self.follow_job:
                self._grow_job()
            if self.multi:
                self.refresh_bar()

    # -- the other ranks of a job --------------------------------------------------------------
    JOB_POLL_SECONDS = 2.0
    JOB_POLL_FOR = 60.0  # after the first rank connected: ranks of other hosts never come

    def source_for(self, record: Any) -> EventSource:
        """The source for another rank's registry record (tests replace it)."""
        return LiveSource(record.control)

    def _grow_job(self, now: float | None = None) -> None:
        """Add the lanes of the job's ranks that registered since (this machine's)."""
        session = next((lane.store.session for lane in self.lanes if lane.store.session), None)
        if session is None:
            return
        job, world = session.get("job"), session.get("world_size")
        if not isinstance(job, str) or type(world) is not int or len(self.lanes) >= world:
            self.follow_job = False  # not a torchrun job, or every rank is here
            return
        now = time.monotonic() if now is None else now
        if now - self._job_checked < self.JOB_POLL_SECONDS:
            return
        self._job_checked = now
        if self._job_until is None:
            self._job_until = now + self.JOB_POLL_FOR
        elif now > self._job_until:
            self.follow_job = False
            return
        from torchscope.protocol import endpoints as ep

        have = set()
        for lane in self.lanes:
            have.add(lane.status.get("endpoint"))
            have.add(getattr(lane.source, "target", None))
        try:
            records = [r for r in ep.list_sessions() if r.job == job]
        except Exception:  # an unreadable registry: try again later
            return
        ranks = {lane.rank for lane in self.lanes if lane.session_value("job") == job}
        for record in sorted(records, key=lambda r: r.rank or 0):
            if record.control not in have and record.rank not in ranks:
                self.add_lane(self.source_for(record))

    def add_lane(self, source: EventSource) -> Lane:
        """Open one more source (a rank that started after the UI)."""
        lane = Lane.of(source, len(self.lanes), self.lanes[0].store.max_events)
        self.lanes.append(lane)
        self._start(lane)
        self.redraw.publish(Redraw())
        return lane

    def screen_text(self) -> str:
        """The screen as plain text (tests, debugging)."""
        import io

        from rich.console import Console

        width, height = self.size
        console = Console(
            width=width, height=height, file=io.StringIO(), record=True, color_system=None
        )
        console.print(self.screen._compositor.render_update(full=True))
        return console.export_text()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.main.help_section()))

    async def action_quit(self) -> None:
        """Leave the UI. Closes our sockets and files; never sends anything to the job (a job
        paused by this UI resumes by itself when its lease runs out)."""
        self.stop_event.set()
        code = 2 if self.fatal else 0
        self.exit(code, return_code=code)

    def on_unmount(self) -> None:
        self.stop_event.set()
        for lane in self.lanes:
            lane.source.close()


def run_tui(source: EventSource | Sequence[EventSource], **options: Any) -> int:
    """Run the UI on ``source`` (or several: the ranks of a job, recordings side by side)
    until the user quits. Returns the exit code: 0, or 2 when a source could not be read (a
    damaged trace file, say)."""
    app = TorchscopeApp(source, **options)
    try:
        app.run()
    finally:
        app.stop_event.set()
        for lane in app.lanes:
            lane.source.close()
    if app.fatal:
        print(f"torchscope: {app.fatal}", file=sys.stderr)
    code = app.return_code
    if code is None:  # the app never started (no terminal, say)
        return 2 if app.fatal else 1
    return 2 if app.fatal and code == 0 else code
