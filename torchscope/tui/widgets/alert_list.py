"""Where NaN/Inf first appeared, across all steps. Enter (or a click) jumps to the op or node."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
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


def is_knock_on(alert: Event) -> bool:
    """A NaN/Inf that came in from outside the traced ops (``where: input``): once an origin
    has been seen, such an alert is what that origin did next (``clip_grad_norm_`` reading
    the bad gradients, the parameters after the update), not a new cause."""
    return alert.get("where") == "input"


def group_alerts(alerts: list[Event]) -> list[tuple[Event, list[Event]]]:
    """``(origin, knock-on alerts)`` in order: each input alert after an origin (same step
    or later) is counted under the latest origin before it; the ones before any origin (bad
    data coming in) stand as origins themselves."""
    groups: list[tuple[Event, list[Event]]] = []
    for alert in alerts:
        if groups and is_knock_on(alert) and not is_knock_on(groups[-1][0]):
            groups[-1][1].append(alert)
        else:
            groups.append((alert, []))
    return groups


def group_label(origin: Event, knock_on: list[Event], cwd: str | None = None) -> str:
    label = alert_label(origin, cwd)
    if knock_on:
        steps = sorted({a.get("step") for a in knock_on if isinstance(a.get("step"), int)})
        span = f" (steps {steps[0]}-{steps[-1]})" if len(steps) > 1 else ""
        label += f"  +{len(knock_on)} knock-on{span}"
    return label


class AlertList(OptionList):
    """One line per origin: step, NaN/Inf, forward/backward, op or node, source, and how
    many knock-on alerts followed from it (counted under it, not listed)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k", "cursor_up", "Up", show=False),
        Binding("j", "cursor_down", "Down", show=False),
    ]

    class Jump(Message):
        def __init__(self, alert: Event) -> None:
            super().__init__()
            self.alert = alert

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, markup=False)
        self.alerts: list[Event] = []  # the origins, one per line
        self.groups: list[tuple[Event, list[Event]]] = []
        self._seen: list[Event] = []
        self.cwd: str | None = None

    def set_alerts(self, alerts: list[Event]) -> None:
        """Show ``alerts`` (the store's list, sorted), grouped by origin."""
        if alerts == self._seen:
            return
        groups = group_alerts(alerts)
        old = self.groups
        same_prefix = len(groups) >= len(old) and all(
            g[0] is o[0] for g, o in zip(groups, old, strict=False)
        )
        if not same_prefix:
            self.clear_options()
            old = []
        for i, (origin, knock_on) in enumerate(groups):
            label = group_label(origin, knock_on, self.cwd)
            if i < len(old):
                if len(old[i][1]) != len(knock_on):
                    self.replace_option_prompt_at_index(i, label)
            else:
                self.add_option(Option(label))
        self.groups = groups
        self.alerts = [g[0] for g in groups]
        self._seen = list(alerts)
        if self.alerts and self.highlighted is None:
            self.highlighted = 0
        total = len(alerts)
        if not total:
            self.border_subtitle = ""
        elif total == len(self.alerts):
            self.border_subtitle = str(total)
        else:
            self.border_subtitle = f"{len(self.alerts)} origin{'s' * (len(self.alerts) != 1)}"
            self.border_subtitle += f" · {total}"

    def knock_on_of(self, origin: Event) -> list[Event]:
        return next((k for o, k in self.groups if o is origin), [])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if 0 <= event.option_index < len(self.alerts):
            self.post_message(self.Jump(self.alerts[event.option_index]))
