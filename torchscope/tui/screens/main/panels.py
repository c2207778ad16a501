"""The main screen's panels: the layout for the terminal's width (the detail under the
timeline, narrower side panels, the steps/alerts column folded away and shown alone while it
has the focus), ``+`` giving the focused panel the whole screen, and which help section the
focused panel has.

:class:`Panels` sees the screen as a :class:`PanelScreen`: its panels, its CSS classes, its
size and focus."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torchscope.tui import keys

if TYPE_CHECKING:
    from textual.geometry import Size
    from textual.widget import Widget

    from torchscope.tui.widgets.alert_list import AlertList
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.graph_tree import GraphTree
    from torchscope.tui.widgets.op_timeline import OpTimeline
    from torchscope.tui.widgets.step_list import StepList

#: Below these widths the layout changes: the detail goes under the timeline (stacked: both
#: get the full width), narrower side panels, then (compact) the steps/alerts column folds
#: away (shown alone while it has the focus).
WIDE = 150
NARROW = 120
COMPACT = 100

MAX_CLASSES = ("-max-center", "-max-detail", "-max-steps", "-max-alerts")


class PanelScreen(Protocol):
    """The main screen, as its layout sees it."""

    steps: StepList
    alerts: AlertList
    timeline: OpTimeline
    graph: GraphTree
    detail: DetailPanel

    @property
    def size(self) -> Size: ...

    @property
    def focused(self) -> Widget | None: ...

    def has_class(self, *class_names: str) -> bool: ...

    def add_class(self, *class_names: str, update: bool = True) -> object: ...

    def remove_class(self, *class_names: str, update: bool = True) -> object: ...

    def set_class(self, add: bool, *class_names: str, update: bool = True) -> object: ...

    def call_after_refresh(
        self, callback: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> bool: ...

    def refresh_status(self) -> None: ...


class Panels:
    def __init__(self, main: PanelScreen, *, resized: Callable[[], None]) -> None:
        self.main = main
        self._resized = resized  # after a refresh, once the panels changed size

    def resize(self) -> None:
        m = self.main
        width = m.size.width
        m.set_class(COMPACT <= width < WIDE, "-stacked")
        m.set_class(width < NARROW, "-narrow")
        m.set_class(width < COMPACT, "-compact")
        self.side_for_focus()
        m.call_after_refresh(self._resized)

    def side_for_focus(self) -> None:
        """Compact: the steps/alerts column shown alone while it has the focus."""
        m = self.main
        focused = m.focused
        side = focused is not None and focused in (m.steps, m.alerts)
        m.set_class(side and m.has_class("-compact"), "-side")

    @property
    def maximised(self) -> str | None:
        """Which panel ``+`` maximised ("center", "detail", "steps", "alerts"), if any."""
        return next((c[5:] for c in MAX_CLASSES if self.main.has_class(c)), None)

    def maximize(self) -> None:
        """lazygit's ``+``: the focused panel takes the whole screen; again (or esc): back."""
        m = self.main
        if self.maximised is not None:
            self.restore()
            return
        focus = m.focused
        if focus is m.detail or (focus is not None and m.detail in focus.ancestors):
            panel = "detail"
        elif focus is m.steps:
            panel = "steps"
        elif focus is m.alerts:
            panel = "alerts"
        else:
            panel = "center"
        m.add_class(f"-max-{panel}")
        m.refresh_status()
        m.call_after_refresh(self._resized)

    def restore(self) -> None:
        m = self.main
        m.remove_class(*MAX_CLASSES)
        m.refresh_status()
        m.call_after_refresh(self._resized)

    def help_section(self) -> str | None:
        """The help's section for the focused panel (``?`` shows it right after stepping)."""
        m = self.main
        focus = m.focused
        if focus is m.graph:
            return keys.GRAPH
        if focus is m.detail:
            return keys.DETAIL
        if focus is m.alerts:
            return keys.ALERTS
        if focus is m.timeline:
            return keys.TIMELINE
        return None
