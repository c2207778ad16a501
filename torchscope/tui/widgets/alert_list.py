"""Where NaN/Inf first appeared, across all steps, and the eager checks of compiled calls
(``what: "eager_check"``: compiled against eager, not NaN/Inf origins; listed as checks, with
their message). Enter (or a click) jumps to the op or node.

With the ranks of one job open (``torchscope tui 'r.rank*.tsc'``), every rank's lane lists
the job's origins (``job_origins``), each once and in the same words, with its consequences
counted across ranks and steps; a rank it reached lists its arrival under it, linked to it.
Enter on an origin another rank made shows that rank's lane at the origin's event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from torchscope.analysis.render import job_origin_text, with_short_source
from torchscope.analysis.trace import fold_alerts, job_origins
from torchscope.protocol.events import Event
from torchscope.session.checks import check_passed, is_check
from torchscope.session.format import check_text, short_name, short_source
from torchscope.tui.lanes import JobAlerts


def is_spike(alert: Event) -> bool:
    """A loss spike the watch caught (``what: "spike"``): no op or line made it, so it is
    listed with its line (the figures against the run's recent steps) and counted apart."""
    return alert.get("what") == "spike"


def spike_label(alert: Event) -> str:
    """``  80 SPIKE loss 24.5 vs 0.291 ± 0.15 over the last 80 steps; ... · update skipped``:
    the watch's line after its ``loss spike at step 80:`` and what the job did about it."""
    message = str(alert.get("message") or "")
    head, sep, rest = message.partition(": ")
    text = rest if sep and " spike at step " in head else message
    figures = alert.get("spike")
    policy = figures.get("on_spike") if isinstance(figures, dict) else None
    then = {"skip": " · update skipped", "stop": " · job stopped"}.get(str(policy), "")
    return f"{alert.get('step', '-')!s:>4} SPIKE {text}{then}"


def alert_label(alert: Event, cwd: str | None = None) -> str:
    if is_spike(alert):
        return spike_label(alert)
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
        if is_check(alert) or is_spike(alert):  # stands alone: no origin, no knock-on
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


@dataclass
class AlertRow:
    """One line of the list: what it says, what the detail shows of it (and the knock-on
    alerts listed there), and the alert whose event enter goes to, in which lane."""

    key: tuple  # the same line across updates: it keeps its place (and the cursor)
    label: str
    shown: Event
    knock_on: list[Event]
    target: Event
    lane: int | None = None  # the lane whose events ``target`` names; None: the shown one


def _step_order(alert: Event) -> tuple[int, float]:
    step = alert.get("step")
    return (0, step) if type(step) is int else (1, 0)


def _through(arrival: Event) -> str:
    """What brought an arrival here (``torch.distributed.ddp_gradient_sync``): its name,
    without the rank the link named (folded into it as `` (from rank N)``)."""
    name = str(arrival.get("name") or "?").replace(" from another rank", "")
    return name.split(" (from rank ", 1)[0]


def _what(alert: Event) -> str:
    return str(alert.get("what", "?")).upper().replace("NAN", "NaN").replace("INF", "Inf")


def _ranked(consequence: dict[str, Any]) -> Event:
    """A consequence of a job origin as the detail lists it: named with its rank (the
    detail counts the ones with the same name and step together)."""
    name = str(consequence.get("name") or "?")
    if consequence.get("where") == "arrival":
        name = f"arrival through {short_name(_through(Event(consequence)))}"
    elif name.startswith("parameter "):
        name = "parameters"
    return Event({**consequence, "name": f"rank {consequence.get('rank')}: {name}"})


def job_rows(job: JobAlerts) -> tuple[list[AlertRow], str]:
    """The list of lane ``job.rank`` in a multi-rank job, and its subtitle: the job's origins
    (each in the same words on every lane, counted across ranks and steps), under each the
    arrivals here linked to it, and this rank's other alerts (checks, arrivals whose origin
    no open rank named), in step order."""
    origins = job_origins(job.alerts)
    named = {o["origin"] for o in origins}
    arrivals: dict[Any, list[tuple[Event, list[Event]]]] = {}
    rest: list[tuple[Event, list[Event]]] = []
    for head, knock_on in group_alerts(job.alerts.get(job.rank, [])):
        if head.get("linked_origin") in named:
            arrivals.setdefault(head["linked_origin"], []).append((head, knock_on))
        elif head.get("origin") not in named:  # this rank's own origins are among the job's
            rest.append((head, knock_on))
    entries: list[tuple[tuple, list[AlertRow]]] = []
    for o in origins:
        rows = [_origin_row(o, job)]
        for head, knock_on in arrivals.get(o["origin"], []):
            label = (
                f"{head.get('step', '-')!s:>4} ↳ {_what(head)} arrived here via "
                f"{short_name(_through(head))} · from rank {o['rank']}'s origin above, "
                "counted there"
            )
            key = ("arrival", head.get("arrival") or head.get("seq"))
            shown = _in_words_of(head, o, job)
            rows.append(AlertRow(key, label, shown, knock_on, head))
        entries.append(((*_step_order(o), 0), rows))
    for head, knock_on in rest:
        label = group_label(head, knock_on, job.cwds.get(job.rank))
        row = AlertRow(("seq", head.get("seq")), label, head, knock_on, head)
        entries.append(((*_step_order(head), 1), [row]))
    entries.sort(key=lambda e: e[0])  # stable: the job's origins, then this rank's, by step
    rows = [row for _, group in entries for row in group]
    # The subtitle counts bad values across the job: each origin with its consequences
    # everywhere (an arrival here is one of them), and this rank's other alerts.
    nan = [(h, k) for h, k in rest if not is_check(h) and not is_spike(h)]
    spikes = sum(is_spike(h) for h, _ in rest)
    arrived = sum(is_arrival(h) for h, _ in nan)
    own = len(origins) + len(nan) - arrived
    total = sum(1 + int(o["job_consequences"]) for o in origins)
    total += sum(1 + knock_on_count(h, k) for h, k in nan)
    checks = len(rest) - len(nan) - spikes
    heads = [f"{own} origin{'s' * (own != 1)}"] if own or not arrived else []
    if arrived:
        heads.append(f"{arrived} arrival{'s' * (arrived != 1)}")
    parts = [f"job: {', '.join(heads)} · {total}"] if total else []
    if spikes:
        parts.append(f"{spikes} spike{'s' * (spikes != 1)}")
    if checks:
        parts.append(f"{checks} check{'s' * (checks != 1)}")
    return rows, " · ".join(parts)


def _origin_row(origin: Event, job: JobAlerts) -> AlertRow:
    """A job origin's line: the same on every rank's lane (its own rank's paths, its count
    across the job); enter goes to its event in the lane of the rank that made it."""
    rank = origin["rank"]
    text = job_origin_text(origin, job.cwds.get(rank))
    shown = Event(origin)
    shown["message"] = text
    shown["consequences"] = origin["job_consequences"]
    shown["consequence_steps"] = origin["job_consequence_steps"]
    if rank != job.rank:
        # The detail links events of the lane shown; this one is in another rank's.
        shown["event_seq"] = None
    knock_on = sorted((_ranked(c) for c in origin["job_first_consequences"]), key=_step_order)
    label = f"{origin.get('step', '-')!s:>4} {text}"
    return AlertRow(
        ("origin", origin["origin"]), label, shown, knock_on, origin, lane=job.lanes.get(rank)
    )


def _in_words_of(arrival: Event, origin: Event, job: JobAlerts) -> Event:
    """An arrival as the detail shows it: its link quotes the origin's words, whose source
    path is shortened here as in the origin's line."""
    source = origin.get("source")
    message = arrival.get("message")
    if not isinstance(source, str) or not source or not isinstance(message, str):
        return arrival
    shown = Event(arrival)
    shown["message"] = with_short_source(message, source, job.cwds.get(origin["rank"]))
    return shown


def plain_rows(alerts: list[Event], cwd: str | None = None) -> tuple[list[AlertRow], str]:
    """The list of one source (or of recordings side by side), and its subtitle: one line
    per origin of ``alerts`` with its knock-on count, one per eager check (source paths
    shortened against ``cwd``)."""
    groups = group_alerts(alerts)
    rows = [AlertRow(("seq", o.get("seq")), group_label(o, k, cwd), o, k, o) for o, k in groups]
    nan = [g for g in groups if not is_check(g[0]) and not is_spike(g[0])]
    spikes = sum(is_spike(g[0]) for g in groups)
    checks = len(groups) - len(nan) - spikes
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
    if spikes:
        parts.append(f"{spikes} spike{'s' * (spikes != 1)}")
    if checks:
        parts.append(f"{checks} check{'s' * (checks != 1)}")
    return rows, " · ".join(parts)


class AlertList(OptionList):
    """One line per origin: step, NaN/Inf, forward/backward, op or node, source, and how
    many knock-on alerts followed from it (counted under it, not listed). One line per eager
    check: ✓ (within tolerance) or ≠, forward/backward, the compiled call, its message. With
    the ranks of a job open: the job's origins, alike on every rank (``job_rows``)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k", "cursor_up", "Up", show=False),
        Binding("j", "cursor_down", "Down", show=False),
    ]

    #: How often the job view looks at the other ranks' alerts: the app tells the shown
    #: lane's widgets of that lane's changes only, and another rank's origin or link may
    #: come (its file's count pass, a live rank) while this lane is shown.
    class Jump(Message):
        def __init__(self, alert: Event) -> None:
            super().__init__()
            self.alert = alert

    class JumpToLane(Message):
        """An origin another rank made: its event is in that rank's lane (the app shows it,
        then jumps there)."""

        def __init__(self, lane: int, alert: Event) -> None:
            super().__init__()
            self.lane = lane
            self.alert = alert

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, markup=False)
        self.rows: list[AlertRow] = []
        self.alerts: list[Event] = []  # what the detail shows of each line
        self.groups: list[tuple[Event, list[Event]]] = []
        self._given: list[Event] = []
        self._seen: list[Event] = []
        self._job_key: tuple | None = None  # what the job view last showed
        self._job: JobAlerts | None = None
        self.cwd: str | None = None

    def set_alerts(self, alerts: list[Event], job: JobAlerts | None = None) -> None:
        """Show ``alerts`` (the shown lane's store's list, sorted), grouped by origin; with
        ``job`` (the ranks of one job open: ``multi.job_alerts``), the job's view: each
        origin once, alike on every rank's lane."""
        self._given, self._job = alerts, job
        self._refresh()

    def _refresh(self) -> None:
        job = self._job
        if job is not None:
            key = job.key()
            if key == self._job_key:
                return
            self._job_key, self._seen = key, []
            rows, subtitle = job_rows(job)
        else:
            alerts = self._given
            if self._job_key is None and alerts == self._seen:
                return
            self._job_key, self._seen = None, list(alerts)
            rows, subtitle = plain_rows(alerts, self.cwd)
        self._show(rows)
        self.border_subtitle = subtitle

    def _show(self, rows: list[AlertRow]) -> None:
        old = self.rows
        # Rows are made anew each time: the same line has the same key.
        same_prefix = len(rows) >= len(old) and all(
            r.key == o.key for r, o in zip(rows, old, strict=False)
        )
        if not same_prefix:
            self.clear_options()
            old = []
        for i, row in enumerate(rows):
            if i < len(old):
                if old[i].label != row.label:
                    self.replace_option_prompt_at_index(i, row.label)
            else:
                self.add_option(Option(row.label))
        self.rows = rows
        self.groups = [(r.shown, r.knock_on) for r in rows]
        self.alerts = [r.shown for r in rows]
        if self.alerts and self.highlighted is None:
            self.highlighted = 0

    def knock_on_of(self, origin: Event) -> list[Event]:
        return next((k for o, k in self.groups if o is origin), [])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if not 0 <= event.option_index < len(self.rows):
            return
        row = self.rows[event.option_index]
        job = self._job
        if row.lane is None or job is None or row.lane == job.lanes.get(job.rank):
            self.post_message(self.Jump(row.target))
        else:
            self.post_message(self.JumpToLane(row.lane, row.target))
