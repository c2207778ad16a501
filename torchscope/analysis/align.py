"""How two traces' events line up: the one alignment ``torchscope diff`` and the UI's compare
view (ranks, recordings, steps side by side) share.

An event is aligned by its step, then by what it is: an op by its name and module path, a
backward node by its name, module (or parameter) and backward call, each with its occurrence
number within the step (the third ``Tensor.add`` in module ``blocks.0`` of step 2). Events
that are not compared (session, step markers, graphs, alerts) have no key.

Imports neither torch nor textual.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torchscope.protocol.events import GRAD, OP

__all__ = ["event_key", "group_by_step", "keyed", "step_of"]


def event_key(ev: dict) -> tuple | None:
    """What an event is, without its occurrence number; None for events that are not
    compared (session, step, graph, alerts...)."""
    kind = ev.get("kind")
    if kind == OP:
        return (OP, ev.get("name"), ev.get("module"))
    if kind == GRAD:
        return (GRAD, ev.get("node"), ev.get("param") or ev.get("module"), ev.get("backward"))
    return None


def step_of(ev: dict) -> Any:
    s = ev.get("step")
    return s if type(s) is int else None


def keyed(events: Iterable[dict]) -> Iterator[tuple[Any, tuple, dict]]:
    """``(step, (key..., occurrence), event)`` for each compared event, in event order. The
    occurrence counts the earlier events of the same step with the same key, so any subset
    of a step's events that keeps every event of a key gives the same numbers."""
    counts: dict[tuple, int] = {}
    for ev in events:
        key = event_key(ev)
        if key is None:
            continue
        step = step_of(ev)
        full = (step, *key)
        n = counts.get(full, 0)
        counts[full] = n + 1
        yield step, (*key, n), ev


def group_by_step(events: Iterable[dict]) -> dict[Any, dict[tuple, Any]]:
    """step -> {(key..., occurrence): event}, in event order (dicts keep insertion order)."""
    steps: dict[Any, dict[tuple, Any]] = {}
    for step, key, ev in keyed(events):
        steps.setdefault(step, {})[key] = ev
    return steps
