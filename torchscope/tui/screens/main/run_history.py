"""The run's history from the main screen: ``H`` (and a spike's alert) opens the plot of loss,
|g| and per-module norms over the whole run, from which a live job is armed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torchscope.tui.screens.history import HistoryScreen

if TYPE_CHECKING:
    from textual.app import App

    from torchscope.session.store import EventStore
    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.step_list import StepList


class HistoryOpener(Protocol):
    """What opening the history plot reads of the main screen."""

    host: Host
    steps: StepList

    @property
    def app(self) -> App[object]: ...

    @property
    def store(self) -> EventStore: ...

    @property
    def live(self) -> bool: ...


class RunHistoryPlot:
    def __init__(self, main: HistoryOpener) -> None:
        self.main = main

    def open(self, step: int | None = None) -> None:
        """The run's history (loss, |g|, per-module norms); from it, arm a live job. The
        cursor starts on ``step``, else on the step list's row."""
        m = self.main
        now = m.host.status.get("step") if m.live else None
        steps = m.steps
        row = steps.row_step(steps.cursor) if steps.cursor >= 0 else None
        row = step if step is not None else row
        m.app.push_screen(
            HistoryScreen(
                m.store,
                live=m.live,
                job_step=now if type(now) is int else None,
                step=row,
            )
        )
