"""What the main screen's helpers use of it, declared once: :class:`MainContext`.

The helpers (navigation, stepping, pause, values, evaluate, search, graph, sharing, lanes, the
key bar's hints, the prompt's modes) each hold a ``MainContext``, which
:class:`~torchscope.tui.screens.main.screen.MainScreen` satisfies. This module imports none of
them, nor the screen: they all import it, so there is no circle between the screen and its
parts. A helper reaches another one through the screen's
methods listed here, never directly.

The feature controllers (shown_step.py: the step shown and following the newest; alerts.py:
the alerts list; panels.py: the layout and ``+``; run_history.py: ``H``) do not see all of
this: each declares the few members it uses as its own protocol, and is handed the other
helpers' methods it calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from textual.app import App
    from textual.notifications import SeverityLevel
    from textual.timer import Timer
    from textual.widget import Widget
    from textual.worker import Worker

    from torchscope.session.rows import PendingRow, Row
    from torchscope.session.search import FieldPattern
    from torchscope.session.stepper_view import ValuesView
    from torchscope.session.store import EventStore
    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.alert_list import AlertList
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.filter_input import FilterInput
    from torchscope.tui.widgets.graph_tree import GraphTree
    from torchscope.tui.widgets.op_timeline import OpTimeline
    from torchscope.tui.widgets.status_bar import StatusBar


@dataclass(frozen=True)
class Location:
    """Where a jump starts or lands."""

    view: str  # "timeline" or "graph"
    step: int
    kind: str | None = None  # op / grad (timeline); None: whichever has this seq
    seq: int | None = None
    node: int | None = None  # graph


#: What ``@`` / ``E`` asked of the job's next step: (text, answered, the job's step then).
Asked = tuple[str, bool, "int | None"]


class MainContext(Protocol):
    """The main screen, as its helpers see it."""

    # -- the app and what it shows -----------------------------------------------------------
    host: Host
    at_origin: bool

    @property
    def app(self) -> App[object]: ...

    @property
    def store(self) -> EventStore: ...

    @property
    def live(self) -> bool: ...

    # -- widgets -----------------------------------------------------------------------------
    timeline: OpTimeline
    graph: GraphTree
    detail: DetailPanel
    alerts: AlertList
    filter: FilterInput
    status_bar: StatusBar

    @property
    def focused(self) -> Widget | None: ...

    # -- state -------------------------------------------------------------------------------
    current_step: int | None
    center: str  # "timeline" or "graph"
    follow: bool
    values: ValuesView | None
    back_stack: list[Location]  # jumps backspace goes back over
    pending: Location | None  # a jump waiting for its step to load
    search: FieldPattern | None
    asked: Asked | None
    expressions: list[str]  # p / e: what was typed, for ↑↓

    # -- Textual's services ------------------------------------------------------------------
    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = True,
    ) -> None: ...

    def call_after_refresh(
        self, callback: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> bool: ...

    def set_timer(
        self,
        delay: float,
        callback: Callable[[], Any] | None = None,
        *,
        name: str | None = None,
        pause: bool = False,
    ) -> Timer: ...

    def run_worker(
        self,
        work: Callable[[], Any],
        name: str | None = "",
        group: str = "default",
        description: str = "",
        exit_on_error: bool = True,
        start: bool = True,
        exclusive: bool = False,
        thread: bool = False,
    ) -> Worker[Any]: ...

    # -- showing -----------------------------------------------------------------------------
    def show_step(self, step: int, *, keep_position: bool = False) -> None: ...

    def request_step(self, step: int) -> bool: ...

    def show_detail(self) -> None: ...

    def show_graph(self, node: int | None = None) -> None: ...

    def show_timeline(self) -> None: ...

    def set_follow(self, on: bool) -> None: ...

    def refresh_status(self) -> None: ...

    def refresh_title(self) -> None: ...

    def refresh_sources(self) -> None: ...

    def graph_title(self) -> None: ...

    def restart(self) -> None: ...

    def clear_filter(self) -> None: ...

    def selected_event(self) -> tuple[dict | None, str | None]: ...

    # -- moving (navigation.py) --------------------------------------------------------------
    def go(self, loc: Location, *, record: bool = True) -> None: ...

    def select_in_timeline(self, kind: str | None, seq: int) -> bool: ...

    def run_command(self, text: str) -> str | None: ...

    # -- the pause (pause.py) ----------------------------------------------------------------
    def is_paused_row(self, row: Row | PendingRow) -> bool: ...

    def sync_pause_marks(self) -> None: ...

    def select_paused(self) -> bool: ...

    def values_for(self, pause: dict) -> ValuesView: ...

    # -- the prompt (prompt.py, search.py, evaluate.py) --------------------------------------
    def open_prompt(self, name: str) -> None: ...

    def close_prompt(self) -> None: ...

    def start_search(self) -> None: ...

    def back_to_search_origin(self) -> None: ...

    def matches(self) -> list[tuple[int, int]]: ...

    def to_match(
        self, direction: int, *, include_current: bool = False, origin: bool = False
    ) -> bool: ...

    def evaluate(self, text: str) -> None: ...

    def edit(self, text: str) -> None: ...

    def cancel_evaluation(self) -> None: ...
