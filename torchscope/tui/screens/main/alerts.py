"""The alerts list of the main screen: ``a`` goes to it; the alert under its cursor shows in the
detail while the user is in the list; enter jumps to the alert's event (a spike's step on the
history plot; another rank's origin on that rank's lane). With the ranks of a job open it holds
the job's view: each origin once, every rank's alerts.

:class:`AlertsView` sees the screen as an :class:`AlertsScreen`, and reaches the jump and the
history plot through the two callables it is given."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from torchscope.protocol.events import Event
    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.alert_list import AlertList
    from torchscope.tui.widgets.detail_panel import DetailPanel


class AlertsScreen(ScreenCore, Protocol):
    """The main screen, as its alerts list sees it."""

    host: Host
    alerts: AlertList
    detail: DetailPanel


class AlertsView:
    def __init__(
        self,
        main: AlertsScreen,
        *,
        jump: Callable[[Event], None],
        plot_at: Callable[[int], None],
    ) -> None:
        self.main = main
        self._jump = jump  # to an alert's event (navigation.py)
        self._plot_at = plot_at  # a step on the run's history plot (run_history.py)

    def key(self) -> None:
        """``a``: to the alerts list (saying so when it is empty)."""
        m = self.main
        if not m.alerts.rows:  # this lane's, or the job's when its ranks are open
            m.notify("no alerts: no NaN/Inf has appeared", timeout=3)
        m.alerts.focus()

    def highlighted(self, index: int) -> None:
        """The list's cursor moved. Only while the user is in the list: a new alert highlights
        itself, and must not take the detail away from the event being looked at (or the
        job's pause)."""
        if self.main.alerts.has_focus:
            self.show(index)

    def focused(self) -> None:
        """The list got the focus: its highlighted alert in the detail."""
        alerts = self.main.alerts
        if alerts.highlighted is not None:
            self.show(alerts.highlighted)

    def show(self, index: int) -> None:
        m = self.main
        if 0 <= index < len(m.alerts.alerts):
            origin = m.alerts.alerts[index]
            m.detail.show_alert(origin, m.alerts.knock_on_of(origin))

    def refresh(self) -> None:
        """The alerts list: this lane's alerts, or with the ranks of a job open, the job's
        view (each origin once, every rank's alerts)."""
        m = self.main
        m.alerts.set_alerts(m.store.alerts, m.host.job_alerts())

    def jump(self, alert: Event) -> None:
        step = alert.get("step")
        if alert.get("what") == "spike" and type(step) is int:
            # A spike names no event (the watch reads figures, not ops): its step on the
            # history plot, among the run's other steps.
            self._plot_at(step)
            return
        self._jump(alert)

    def jump_to_lane(self, lane: int, alert: Event) -> None:
        """An origin another rank made: show that rank's lane, then its event (no alignment
        with the op left: the jump says where to land)."""
        self.main.host.select_lane(lane, align=False)
        self._jump(alert)
