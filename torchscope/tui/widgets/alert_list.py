"""Where NaN/Inf first appeared, across all steps. Enter (or a click) jumps to the op or node."""

from __future__ import annotations

from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from torchscope.protocol.events import Event
from torchscope.tui.format import short_name, short_source


def alert_label(alert: Event, cwd: str | None = None) -> str:
    what = str(alert.get("what", "?")).upper().replace("NAN", "NaN").replace("INF", "Inf")
    where = {"forward": "fwd", "backward": "bwd", "input": "in"}.get(
        str(alert.get("where")), str(alert.get("where", "?"))[:3]
    )
    name = short_name(str(alert.get("name", "?")))
    src = short_source(alert.get("source"), cwd)
    return f"{alert.get('step', '-')!s:>4} {what:<3} {where} {name}" + (f"  {src}" if src else "")


class AlertList(OptionList):
    """One line per alert: step, NaN/Inf, forward/backward, op or node, source."""

    class Jump(Message):
        def __init__(self, alert: Event) -> None:
            super().__init__()
            self.alert = alert

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, markup=False)
        self.alerts: list[Event] = []
        self.cwd: str | None = None

    def set_alerts(self, alerts: list[Event]) -> None:
        """Show ``alerts`` (the store's list; only new entries are added)."""
        if len(alerts) < len(self.alerts) or alerts[: len(self.alerts)] != self.alerts:
            self.clear_options()
            self.alerts = []
        new = alerts[len(self.alerts) :]
        if new:
            self.add_options(Option(alert_label(a, self.cwd)) for a in new)
            self.alerts = list(alerts)
            if self.highlighted is None:
                self.highlighted = 0
        self.border_subtitle = str(len(self.alerts)) if self.alerts else ""

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if 0 <= event.option_index < len(self.alerts):
            self.post_message(self.Jump(self.alerts[event.option_index]))
