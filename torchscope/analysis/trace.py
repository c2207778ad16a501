"""A recording in memory: :class:`Trace`, the events of one traced run with views by kind,
as ``torchscope.trace()`` collects them and ``torchscope.load()`` reads them back
(:func:`load_trace`), and ``Trace.to_pandas`` for tables.

Not a wire or file format (those are :mod:`torchscope.protocol`): the object a user's own
analysis starts from. Imports neither torch nor textual, and pandas only in ``to_pandas``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableSequence
from typing import Any

from torchscope.protocol.events import (
    ALERT,
    CONSEQUENCES,
    ERROR,
    GRAD,
    GRAPH,
    OP,
    SESSION,
    STEP,
    Event,
)
from torchscope.protocol.tracefile import TraceReader

__all__ = ["CONSEQUENCES", "Trace", "fold_alerts", "job_origins", "load_trace"]


def is_tally(alert: Event) -> bool:
    """An update of an origin's consequences, not an alert of its own."""
    return alert.get("where") == CONSEQUENCES


def is_link(alert: Event) -> bool:
    """A NaN/Inf that arrived here from another rank, linked to that rank's origin (the rank
    checks' ``where: "arrival"`` alert naming ``from_rank``): folded into the arrival."""
    return alert.get("from_rank") is not None


def fold_alerts(alerts: Iterable[Event]) -> list[Event]:
    """One alert per origin: each origin (a copy) with the latest count of its consequences
    folded in (``consequences``, ``consequence_steps``, ``first_consequences``; 0 and empty
    for an origin with none). An update whose origin is not among ``alerts`` (a step range
    that starts after it) stands on its own. Alerts of recordings made before origins had ids
    pass unchanged.

    A NaN/Inf that arrived from another rank (``where: "arrival"``, an ``arrival`` id, no
    ``origin``) is one alert too, with its consequences here; the link to the origin the
    other rank named, when it came, is folded into it: its message becomes that link's
    ("NaN arrived from rank 1: <that rank's words>"), with ``from_rank``, ``linked_origin``
    and ``origin_step``. A link whose arrival is not among ``alerts`` stands on its own."""
    out: list[Event] = []
    by_origin: dict[Any, Event] = {}
    watched: dict[Any, Event] = {}  # step -> the NaN watch's report of it
    for alert in alerts:
        if is_tally(alert):
            head = by_origin.get(alert.get("origin") or alert.get("arrival"))
            if head is not None:
                for key in ("consequences", "consequence_steps", "first_consequences"):
                    head[key] = alert.get(key)
                continue
        elif is_link(alert):
            # The arrival it links: this rank's arrival alert, or (under the NaN watch, which
            # traces nothing) the watch's report of that step.
            head = by_origin.get(alert.get("arrival")) or watched.get(alert.get("step"))
            if head is not None:
                through = str(head.get("name")).replace(" from another rank", "")
                for key in ("message", "from_rank", "linked_origin", "origin_step"):
                    head[key] = alert.get(key)
                head["name"] = f"{through} (from rank {alert['from_rank']})"
                continue
        alert = Event(alert)
        if alert.get("where") == "watch":
            watched[alert.get("step")] = alert
        ident = alert.get("origin") or alert.get("arrival")
        if ident is not None and not is_tally(alert) and not is_link(alert):
            alert.setdefault("consequences", 0)
            alert.setdefault("consequence_steps", None)
            alert.setdefault("first_consequences", [])
            by_origin[ident] = alert
        out.append(alert)
    return out


def job_origins(alerts_by_rank: Mapping[int, Iterable[Event]]) -> list[Event]:
    """The NaN/Inf origins of a whole multi-rank job, from every rank's alerts (each rank's
    recording): one per origin, on the rank that made it, with ``arrivals`` (``{rank, step,
    message}`` of each rank it reached, linked to it) and ``job_consequences``: its own
    consequences plus, on every rank it reached, the arrival and the consequences there.
    ``job_consequence_steps`` is ``[first, last]`` of the steps those fall in (None for none),
    and ``job_first_consequences`` the first few of them, each with its ``rank``: the
    origin's own listed ones, then each arrival (``where: "arrival"``) and its listed ones.
    Arrivals whose origin no rank named, and alerts of other kinds, are left out."""
    folded = {r: fold_alerts(a) for r, a in alerts_by_rank.items()}
    origins: dict[Any, Event] = {}
    steps: dict[Any, list[int]] = {}  # origin -> the steps of its consequences, every rank
    for rank, alerts in sorted(folded.items()):
        for a in alerts:
            if a.get("origin") is not None and a.get("what") in ("nan", "inf"):
                o = Event(a)
                o["rank"] = rank
                o["arrivals"] = []
                o["job_consequences"] = int(o.get("consequences") or 0)
                o["job_first_consequences"] = [
                    {**c, "rank": rank} for c in o.get("first_consequences") or ()
                ]
                origins[o["origin"]] = o
                steps[o["origin"]] = _steps_of(o, counted=False)
    for rank, alerts in sorted(folded.items()):
        for a in alerts:
            origin = origins.get(a.get("linked_origin"))
            if origin is None:
                continue
            origin["arrivals"].append(
                {"rank": rank, "step": a.get("step"), "message": a["message"]}
            )
            origin["job_consequences"] += 1 + int(a.get("consequences") or 0)
            origin["job_first_consequences"].append(
                {
                    "rank": rank,
                    "step": a.get("step"),
                    "where": "arrival",
                    "name": a.get("name"),
                    "event_seq": a.get("event_seq"),
                    "message": a["message"],
                }
            )
            origin["job_first_consequences"].extend(
                {**c, "rank": rank} for c in a.get("first_consequences") or ()
            )
            steps[origin["origin"]] += _steps_of(a, counted=True)
    for ident, o in origins.items():
        span = steps[ident]
        o["job_consequence_steps"] = [min(span), max(span)] if span else None
    return list(origins.values())


def _steps_of(alert: Event, *, counted: bool) -> list[int]:
    """The steps of an origin's or arrival's consequences (the tally's ``[first, last]``),
    and, when the alert itself is ``counted`` as one (an arrival), its own step."""
    out = [s for s in alert.get("consequence_steps") or () if type(s) is int]
    if counted and type(alert.get("step")) is int:
        out.append(alert["step"])
    return out


class Trace:
    """Events of one traced run, in order, with views by kind.

    ``torchscope.trace()`` fills one while the job runs; ``torchscope.load()`` builds one from a
    file. Both hold the same ``Event`` records.
    """

    # Set by load_trace only (see there); declared without a value so that a live Trace
    # still has none of them.
    metadata: dict[str, Any]
    truncated: bool
    damaged: str | None

    def __init__(self, events: Iterable[Event] = ()) -> None:
        # A list; a bounded deque where the tracer keeps only the newest (``trace(keep=N)``).
        self.events: MutableSequence[Event] = list(events)

    def append(self, event: Event) -> None:
        self.events.append(event)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e["kind"] == kind]

    @property
    def session(self) -> Event | None:
        for e in self.events:
            if e["kind"] == SESSION:
                return e
        return None

    @property
    def ops(self) -> list[Event]:
        return self.of_kind(OP)

    @property
    def grads(self) -> list[Event]:
        return self.of_kind(GRAD)

    @property
    def graphs(self) -> list[Event]:
        return self.of_kind(GRAPH)

    @property
    def alerts(self) -> list[Event]:
        """One alert per origin, with the count of its consequences (see ``fold_alerts``);
        ``of_kind("alert")`` gives the events as recorded."""
        return fold_alerts(self.of_kind(ALERT))

    @property
    def steps(self) -> list[Event]:
        return self.of_kind(STEP)

    @property
    def errors(self) -> list[Event]:
        return self.of_kind(ERROR)

    def to_pandas(self, kind: str = "op") -> Any:
        """A pandas DataFrame with one row per event of ``kind`` (``"op"``, ``"grad"``,
        ``"step"``, ``"alert"``...; ``"tensor"``: one row per tensor summary), stats as
        columns. Needs pandas: ``pip install 'torchscope-debugger[pandas]'``; see
        ``torchscope.export.tables``."""
        from torchscope.export.tables import to_pandas

        return to_pandas(self.events, kind)

    def grads_of(self, node: str) -> list[Event]:
        """Grad events of every node with this name, e.g. ``"MulBackward0"``."""
        return [e for e in self.events if e["kind"] == GRAD and e.get("node") == node]


def load_trace(
    path: str | os.PathLike[str], progress: Callable[[int, int], None] | None = None
) -> Trace:
    """Read every event of a trace file into a Trace. The Trace also gets ``metadata`` (the
    file header's map), ``truncated`` (True when the writer did not close the file, so the
    events end at the last complete chunk) and ``damaged`` (what is damaged in an index or
    trailer that had to be bypassed; None when nothing is). Any corrupt or invalid event
    raises TraceFileError."""
    with TraceReader(path, progress=progress) as reader:
        trace = Trace(reader.iter_events())
        trace.metadata = reader.metadata
        trace.truncated = reader.truncated
        trace.damaged = reader.damaged
    return trace
