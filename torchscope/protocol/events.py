"""Event schema: the plain-data records the tracer emits and every reader consumes.

Each event is a msgpack map with at least ``kind``, ``seq`` and ``step``. Readers ignore keys
they do not know, so adding a key is a minor protocol change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

SESSION = "session"
STEP = "step"
OP = "op"
GRAD = "grad"
GRAPH = "graph"
ALERT = "alert"
ERROR = "error"
PAUSE = "pause"  # the job stopped at an op or node (step-through)
RESUME = "resume"  # ... and went on: "by" says what let it go (continue, step, lease, ...)
TRACING = "tracing"  # an attached job armed or went dormant: "state", who holds it
KINDS = (SESSION, STEP, OP, GRAD, GRAPH, ALERT, ERROR, PAUSE, RESUME, TRACING)

# What an attached job is doing (session events, hello, heartbeats, ``ls``).
DORMANT = "dormant"  # counting steps only: no mode, no hooks
ARMING = "arming"  # asked to trace; starts at the next step boundary
TRACED = "traced"


class Event(dict):
    """One event: a dict that also allows attribute access (``ev.name`` is ``ev["name"]``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def kind(self) -> str:
        return self["kind"]


def all_finite(summaries: list | None) -> bool:
    """No tensor summary in the list counts NaN or Inf (one without stats counts as fine)."""
    for s in summaries or ():
        stats = s.get("stats") if s else None
        if stats and (stats.get("nan") or stats.get("inf")):
            return False
    return True


def as_event(obj: Any) -> Event:
    """Validate the envelope of a decoded record and wrap it."""
    from torchscope.protocol.codec import ProtocolError

    if not isinstance(obj, dict):
        raise ProtocolError(f"event is a {type(obj).__name__}, expected a map")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError("event has no 'kind'")
    if not isinstance(obj.get("seq"), int):
        raise ProtocolError(f"{kind} event has no integer 'seq'")
    return obj if isinstance(obj, Event) else Event(obj)


class Trace:
    """Events of one traced run, in order, with views by kind.

    ``torchscope.trace()`` fills one while the job runs; ``torchscope.load()`` builds one from a
    file. Both hold the same ``Event`` records.
    """

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self.events: list[Event] = list(events)

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
        return self.of_kind(ALERT)

    @property
    def steps(self) -> list[Event]:
        return self.of_kind(STEP)

    @property
    def errors(self) -> list[Event]:
        return self.of_kind(ERROR)

    def grads_of(self, node: str) -> list[Event]:
        """Grad events of every node with this name, e.g. ``"MulBackward0"``."""
        return [e for e in self.events if e["kind"] == GRAD and e.get("node") == node]
