"""The torchscope terminal UI: one app, the same screens for a live job and a trace file.

``run_tui(source)`` runs it; ``TorchscopeApp(source)`` is the app itself (tests drive it with
``App.run_test()``). The source runs on a Textual thread worker and fills an inbox; a ~30 Hz
timer drains the inbox and applies everything in it inside one ``batch_update()``, so a burst
of events costs one repaint, never one widget write per event.

Commands to a live job (``command``) are queued to the source's thread, the only one that
talks to the job; their replies come back through the same inbox, are applied to the store
(every stepping reply carries the job's state) and then handed to whoever asked. A refusal is
a notification, never an exception.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.worker import Worker

from torchscope.tui.screens.breakpoints import BreakpointsScreen
from torchscope.tui.screens.help import HelpScreen
from torchscope.tui.screens.main import MainScreen
from torchscope.tui.sources import CommandRefused, EventSource
from torchscope.tui.store import EventStore, Inbox, RateMeter

#: Called with (ok, result or one-line refusal) when a command's answer arrives.
ReplyHandler = Callable[[bool, Any], Any]

__all__ = ["TorchscopeApp", "run_tui"]


class TorchscopeApp(App[int]):
    """Step-through view of a PyTorch job: forward ops, backward nodes, gradients."""

    TITLE = "torchscope"
    CSS_PATH = "app.tcss"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
    ]

    def __init__(
        self,
        source: EventSource,
        *,
        max_events: int = 250_000,
        tick_hz: float = 30.0,
        max_apply: int = 20_000,
    ) -> None:
        super().__init__()
        self.source = source
        self.store = EventStore(
            max_events=max_events, reloadable=source.can_reload, live=source.mode == "live"
        )
        self.inbox = Inbox()
        self.status: dict[str, Any] = {"mode": source.mode}
        self.rate = RateMeter()
        self.tick_hz = tick_hz
        self.max_apply = max_apply
        self.main = MainScreen(live=source.mode == "live")
        self.waiting: dict[int, tuple[str, ReplyHandler | None, bool]] = {}
        self.sent: list[tuple[str, dict[str, Any]]] = []  # every command sent (tests)
        self.stop_event = threading.Event()
        self.worker: Worker | None = None
        self.fatal: str | None = None
        self.ticks = 0

    def on_mount(self) -> None:
        self.push_screen(self.main)
        self.worker = self.run_worker(
            self._run_source, name="source", thread=True, exclusive=True, exit_on_error=False
        )
        self.set_interval(1 / self.tick_hz, self.tick)
        self.set_interval(0.5, self._status_tick)

    def _run_source(self) -> None:
        try:
            self.source.run(self.inbox, self.stop_event)
        except Exception as exc:  # a bug in a source must not take the UI down silently
            self.inbox.put("error", f"source failed: {type(exc).__name__}: {exc}")
            self.inbox.status(state="error", error=str(exc))

    def tick(self) -> None:
        """Apply what the source produced since the last tick (also callable from tests)."""
        if not self.main.ready:
            return
        items = self.inbox.drain(self.max_apply)
        self.ticks += 1
        if not items:
            return
        # A new run of the followed job: what came before belongs to the old store.
        while True:
            cut = next((i for i, item in enumerate(items) if item[0] == "new_session"), None)
            if cut is None:
                break
            if cut:
                self._apply(items[:cut])
            self._new_session()
            items = items[cut + 1 :]
        if items:
            self._apply(items)

    def _new_session(self) -> None:
        self.store = EventStore(
            max_events=self.store.max_events, reloadable=self.source.can_reload, live=True
        )
        self.main.restart()
        self.notify("the job started again: following the new run", timeout=4)

    def _apply(self, items: list) -> None:
        with self.batch_update():
            changes = self.store.apply(items)
            if changes.status:
                self.status.update(changes.status)
                if changes.status.get("state") == "error":
                    self.fatal = str(changes.status.get("error"))
            self.rate.add(changes.events)
            self.main.apply_changes(changes)
            if changes.status or changes.events or changes.replies or changes.paused_changed:
                self.main.refresh_status()
            if changes.breakpoints_changed:
                for screen in self.screen_stack:
                    if isinstance(screen, BreakpointsScreen):
                        screen.refresh_list()
            for reply in changes.replies:
                self._answered(*reply)

    # -- commands to the job -------------------------------------------------------------------
    def can_command(self, *, say: bool = True) -> bool:
        """Whether commands can reach a job; when not, say why (a notification)."""
        if self.source.can_command:
            return True
        if say:
            self.notify(self.source.refusal, severity="warning", timeout=4)
        return False

    def command(
        self, cmd: str, *, then: ReplyHandler | None = None, quiet: bool = False, **fields: Any
    ) -> bool:
        """Send ``cmd`` to the job (through the source's thread). ``then(ok, payload)`` runs on
        the UI thread when the answer comes; a refusal is also a notification unless
        ``quiet``. False when the source cannot send commands at all (said, too)."""
        try:
            token = self.source.command(cmd, **fields)
        except CommandRefused as exc:
            self.notify(str(exc), severity="warning", timeout=4)
            return False
        self.sent.append((cmd, dict(fields)))
        self.waiting[token] = (cmd, then, quiet)
        return True

    def _answered(self, tag: str, token: int, cmd: str, fields: Any, payload: Any) -> None:
        _, then, quiet = self.waiting.pop(token, (cmd, None, True))  # token 0: the source's own
        ok = tag == "reply"
        if not ok and not quiet:
            self.notify(str(payload), severity="error", timeout=6)
        if then is not None:
            try:
                then(ok, payload)
            except Exception as exc:  # a screen that went away meanwhile, say
                self.log.error(f"reply handler for {cmd!r} failed: {exc!r}")

    def _status_tick(self) -> None:
        if self.main.ready:
            self.main.refresh_status()

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
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Leave the UI. Closes our sockets and files; never sends anything to the job (a job
        paused by this UI resumes by itself when its lease runs out)."""
        self.stop_event.set()
        code = 2 if self.fatal else 0
        self.exit(code, return_code=code)

    def on_unmount(self) -> None:
        self.stop_event.set()
        self.source.close()


def run_tui(source: EventSource, **options: Any) -> int:
    """Run the UI on ``source`` until the user quits. Returns the exit code: 0, or 2 when the
    source could not be read (a damaged trace file, say)."""
    app = TorchscopeApp(source, **options)
    try:
        app.run()
    finally:
        app.stop_event.set()
        source.close()
    if app.fatal:
        print(f"torchscope: {app.fatal}", file=sys.stderr)
    code = app.return_code
    if code is None:  # the app never started (no terminal, say)
        return 2 if app.fatal else 1
    return 2 if app.fatal and code == 0 else code
