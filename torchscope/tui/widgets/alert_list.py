"""Where NaN/Inf first appeared, across all steps, and the eager checks of compiled calls
(``what: "eager_check"``: compiled against eager, not NaN/Inf origins; listed as checks, with
their message). Enter (or a click) jumps to the op or node."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from torchscope.analysis.trace import fold_alerts
from torchscope.protocol.events import Event
from torchscope.tui.format import check_passed, check_text, is_check, short_name, short_source


def alert_label(alert: Event, cwd: str | None = None) -> str:
    if is_check(alert):
        where = {"forward": "fwd", "backward": "bwd"}.get(str(alert.get("where")), "")
        name = short_name(str(alert.get("name", "?")))
        mark = "✓" if check_passed(alert) else "≠"
        return f"{alert.get('step', '-')!s:>4} {mark} check {where} {name}: {check_text(alert)}"
    what = str(alert.get("what", "?")).upper().replace("NAN", "NaN").replace("INF", "Inf")
    where = {"forward": "fwd", "backward": "bwd", "input": "in", "arrival": "arr"}.get(
        str(alert.get("where")), str(alert.get("where", "?"))[:3]
    )
    name = short_name(str(alert.get("name", "?")))
    src = short_source(alert.get("source"), cwd)
    return f"{alert.get('step', '-')!s:>4} {what:<3} {where} {name}" + (f"  {src}" if src else "")


def is_arrival(alert: Event) -> bool:
    """A NaN/Inf that another rank made and a collective brought here (linked, once that
    rank named it, to its origin): listed, but not counted as an origin of this rank."""
    return alert.get("where") == "arrival" or alert.get("from_rank") is not None


def is_knock_on(alert: Event) -> bool:
    """A NaN/Inf that came in from outside the traced ops (``where: input``): once an origin
    has been seen, such an alert is what that origin did next (``clip_grad_norm_`` reading
    the bad gradients, the parameters after the update), not a new cause."""
    return alert.get("where") == "input"


def group_alerts(alerts: list[Event]) -> list[tuple[Event, list[Event]]]:
    """``(origin, knock-on alerts)`` in order. The tracer names each origin (``origin``)
    and counts its consequences in later updates: folded into the origin, which lists its
    first few (``knock_on_count`` gives the whole count). In recordings made before that,
    each input alert after an origin (same step or later) is counted under the latest origin
    before it; the ones before any origin (bad data coming in) stand as origins themselves.
    An eager check stands alone: it is no origin, and takes no knock-on."""
    groups: list[tuple[Event, list[Event]]] = []
    last: tuple[Event, list[Event]] | None = None  # the latest NaN/Inf group
    for alert in fold_alerts(alerts):
        if is_check(alert):
            groups.append((alert, []))
            continue
        if alert.get("origin") is not None:
            group = (alert, [Event(c) for c in alert.get("first_consequences") or []])
        elif last is not None and is_knock_on(alert) and not is_knock_on(last[0]):
            last[1].append(alert)
            continue
        else:
            group = (alert, [])
        groups.append(group)
        last = group
    return groups


def knock_on_count(origin: Event, knock_on: list[Event]) -> int:
    """How many consequences an origin has: the tracer's count, else the alerts under it."""
    count = origin.get("consequences")
    return count if type(count) is int else len(knock_on)


def group_label(origin: Event, knock_on: list[Event], cwd: str | None = None) -> str:
    label = alert_label(origin, cwd)
    count = knock_on_count(origin, knock_on)
    if count:
        steps = origin.get("consequence_steps") or sorted(
            {a.get("step") for a in knock_on if isinstance(a.get("step"), int)}
        )
        span = f" (steps {steps[0]}-{steps[-1]})" if steps and steps[0] != steps[-1] else ""
        label += f"  +{count} knock-on{span}"
    return label


class AlertList(OptionList):
    """One line per origin: step, NaN/Inf, forward/backward, op or node, source, and how
    many knock-on alerts followed from it (counted under it, not listed). One line per eager
    check: ✓ (within tolerance) or ≠, forward/backward, the compiled call, its message."""

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
        # Origins are folded copies, made anew each time: the same origin has the same seq.
        same_prefix = len(groups) >= len(old) and all(
            g[0].get("seq") == o[0].get("seq") for g, o in zip(groups, old, strict=False)
        )
        if not same_prefix:
            self.clear_options()
            old = []
        for i, (origin, knock_on) in enumerate(groups):
            label = group_label(origin, knock_on, self.cwd)
            if i < len(old):
                if knock_on_count(*old[i]) != knock_on_count(origin, knock_on):
                    self.replace_option_prompt_at_index(i, label)
            else:
                self.add_option(Option(label))
        self.groups = groups
        self.alerts = [g[0] for g in groups]
        self._seen = list(alerts)
        if self.alerts and self.highlighted is None:
            self.highlighted = 0
        nan = [g for g in groups if not is_check(g[0])]
        checks = len(groups) - len(nan)
        arrived = sum(is_arrival(g[0]) for g in nan)
        own = len(nan) - arrived
        total = sum(1 + knock_on_count(*g) for g in nan)
        parts = []
        if total == len(nan) and total and not arrived:
            parts.append(str(total))
        elif total:
            # Another rank's origin is counted there: here it is an arrival.
            heads = [f"{own} origin{'s' * (own != 1)}"] if own else []
            if arrived:
                heads.append(f"{arrived} arrival{'s' * (arrived != 1)}")
            parts.append(f"{', '.join(heads)} · {total}")
        if checks:
            parts.append(f"{checks} check{'s' * (checks != 1)}")
        self.border_subtitle = " · ".join(parts)

    def knock_on_of(self, origin: Event) -> list[Event]:
        return next((k for o, k in self.groups if o is origin), [])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if 0 <= event.option_index < len(self.alerts):
            self.post_message(self.Jump(self.alerts[event.option_index]))
