"""How two traces' events line up: the one alignment ``torchscope diff`` and the UI's compare
view (ranks, recordings, steps side by side) share.

An event is aligned by its step, then by what it is: an op by its name and module path, a
backward node by its name, module (or parameter) and backward call, each with its occurrence
number within the step (the third ``Tensor.add`` in module ``blocks.0`` of step 2). Events
that are not compared (session, step markers, graphs, alerts) have no key.

An aten call (recorded with ``--aten``) is aligned under its parent: the full key of the op
or backward node that ran it, then its name and its occurrence among that parent's calls of
that name (the second ``aten.mm.default`` under the first AddmmBackward0 of module ``0``).
Seqs and node ids differ between runs; the parent's key does not, so a call lines up with the
same call under the same op occurrence in the other run, and an extra call elsewhere shifts
nothing. The engine's gradient sums after a node are keyed apart from the node's own kernels.

Imports neither torch nor textual.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

from torchscope.protocol.events import ATEN, GRAD, OP

__all__ = [
    "aten_keyed",
    "event_key",
    "group_aten_by_step",
    "group_by_step",
    "has_aten",
    "keyed",
    "step_of",
]


def event_key(ev: dict) -> tuple | None:
    """What an event is, without its occurrence number; None for events that are not
    compared (session, step, graph, alerts...). Aten calls are keyed by ``aten_keyed``:
    their key needs their parent's."""
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
    return _numbered((key, ev) for ev in events if (key := event_key(ev)) is not None)


def _numbered(keys: Iterable[tuple[tuple, dict]]) -> Iterator[tuple[Any, tuple, dict]]:
    """``(key, event)`` pairs with their occurrence within the step added to the key."""
    counts: dict[tuple, int] = {}
    for key, ev in keys:
        step = step_of(ev)
        full = (step, *key)
        n = counts.get(full, 0)
        counts[full] = n + 1
        yield step, (*key, n), ev


def group_by_step(events: Iterable[dict]) -> dict[Any, dict[tuple, Any]]:
    """step -> {(key..., occurrence): event}, in event order (dicts keep insertion order)."""
    return _by_step(keyed(events))


def _by_step(numbered: Iterable[tuple[Any, tuple, dict]]) -> dict[Any, dict[tuple, Any]]:
    steps: dict[Any, dict[tuple, Any]] = {}
    for step, key, ev in numbered:
        steps.setdefault(step, {})[key] = ev
    return steps


# -- the aten level --------------------------------------------------------------------------
def has_aten(events: Iterable[dict]) -> bool:
    """Whether a recording holds aten calls (it was made with the aten level on)."""
    return any(ev.get("kind") == ATEN for ev in events)


class _Parents:
    """The aligned keys of a run's ops and backward nodes, found from an aten call's links
    (``op_seq``, ``node_id``)."""

    def __init__(self, events: list[dict]) -> None:
        self.ops: dict[int, tuple] = {}
        # node id -> the seqs of that node's grad events (a node runs once per backward call,
        # an AccumulateGrad once per backward call too), ascending, and their keys
        self.node_seqs: dict[int, list[int]] = {}
        self.node_keys: dict[int, list[tuple]] = {}
        for _, key, ev in keyed(events):
            seq = ev.get("seq")
            if type(seq) is not int:  # a malformed event: no call can name it
                continue
            if ev.get("kind") == OP:
                self.ops[seq] = key
            elif type(ev.get("node_id")) is int:
                self.node_seqs.setdefault(ev["node_id"], []).append(seq)
                self.node_keys.setdefault(ev["node_id"], []).append(key)

    def of(self, call: dict) -> tuple | None:
        """The key of the op or node that ran ``call``; None when it is not in the run."""
        node_id = call.get("node_id")
        if type(node_id) is int:
            return self._node(node_id, call.get("seq"), bool(call.get("accumulate")))
        op_seq = call.get("op_seq")
        return self.ops.get(op_seq) if type(op_seq) is int else None

    def _node(self, node_id: int, seq: Any, after_it: bool) -> tuple | None:
        """The grad event of ``node_id`` that a call at ``seq`` belongs to: the node's event
        is emitted once its kernels ran, so the next one after the call; the engine sums
        the node's gradients once it returned, so for a sum the last one before it."""
        seqs = self.node_seqs.get(node_id)
        if not seqs or type(seq) is not int:
            return None
        i = bisect.bisect_left(seqs, seq)
        if after_it:
            i -= 1
        return self.node_keys[node_id][i] if 0 <= i < len(seqs) else None


def _unlinked_parent(call: dict) -> tuple:
    """A parent key for a call whose op or node is not in the run (the backward's seed
    ``ones_like``, a node outside the traced steps): what the call itself says of it."""
    return (None, call.get("node"), call.get("module"))


def aten_keyed(events: Iterable[dict]) -> Iterator[tuple[Any, tuple, dict]]:
    """``(step, (ATEN, parent key, engine sum, name, occurrence), call)`` for each aten call,
    in event order. ``engine sum`` is True for the engine's sum of the gradients a node sent
    with another path's (``accumulate``), False for the node's own kernels and an op's calls;
    the occurrence counts the earlier calls of the same step, parent, engine sum and name.
    The UI's compare view keys its aten rows the same way (``torchscope.session.align``)."""
    events = events if isinstance(events, list) else list(events)
    parents = _Parents(events)
    return _numbered(
        (
            (
                ATEN,
                parents.of(ev) or _unlinked_parent(ev),
                bool(ev.get("accumulate")),
                ev.get("name"),
            ),
            ev,
        )
        for ev in events
        if ev.get("kind") == ATEN
    )


def group_aten_by_step(events: Iterable[dict]) -> dict[Any, dict[tuple, Any]]:
    """step -> {aten key: call}, in event order: ``group_by_step`` for the aten level."""
    return _by_step(aten_keyed(events))
