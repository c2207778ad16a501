"""The torchscope terminal UI: one app, the same screens for a live job and a trace file.

``run_tui(source)`` runs it; ``TorchscopeApp(source)`` is the app itself (tests drive it with
``App.run_test()``). The source runs on a Textual thread worker and fills an inbox; a ~30 Hz
timer drains the inbox and applies everything in it inside one ``batch_update()``, so a burst
of events costs one repaint, never one widget write per event.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.worker import Worker

from torchscope.tui.screens.help import HelpScreen
from torchscope.tui.screens.main import MainScreen
from torchscope.tui.sources import EventSource
from torchscope.tui.store import EventStore, Inbox, RateMeter

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
        self.store = EventStore(max_events=max_events, reloadable=source.can_reload)
        self.inbox = Inbox()
        self.status: dict[str, Any] = {"mode": source.mode}
        self.rate = RateMeter()
        self.tick_hz = tick_hz
        self.max_apply = max_apply
        self.main = MainScreen()
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
        with self.batch_update():
            changes = self.store.apply(items)
            if changes.status:
                self.status.update(changes.status)
                if changes.status.get("state") == "error":
                    self.fatal = str(changes.status.get("error"))
            self.rate.add(changes.events)
            self.main.apply_changes(changes)
            if changes.status or changes.events:
                self.main.refresh_status()

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
        """Leave the UI. Closes our sockets and files; never sends anything to the job."""
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
