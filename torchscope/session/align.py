"""Rows of two steps matched to each other, as ``torchscope diff`` aligns two recordings
(:mod:`torchscope.analysis.align`): a row's alignment key in its step, and the row with that key
in another store's step (switching ranks or recordings keeps the position; the compare view).

No textual imports here, and no torch.
"""

from __future__ import annotations

from typing import Any

from torchscope.analysis.align import keyed
from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.session.rows import FLAG_ACCUMULATE, FLAGS, KIND, NAME, AtenRow, Row
from torchscope.session.steps import StepData
from torchscope.session.store import EventStore

__all__ = ["describe_key", "find_key", "row_key"]


def _candidates(data: StepData, kind: str, name: str) -> list[tuple]:
    recs = data.ops if kind == OP else data.grads
    return [t for t in recs if t[NAME] == name]


def row_key(store: EventStore, data: StepData | None, row: Any) -> tuple | None:
    """``(kind, name, module or parameter[, backward call], occurrence)`` of a timeline row
    within its step (:func:`torchscope.analysis.align.keyed`), or None (no row, a pending row).
    An aten call's: see ``_call_key``."""
    if data is None or row is None or getattr(row, "pending", False):
        return None
    if isinstance(row, AtenRow):
        return _call_key(store, data, row)
    cands = _candidates(data, row.kind, row.name)
    for t, (_, key, _) in zip(cands, keyed(store.event(t) for t in cands), strict=True):
        if t[1] == row.seq:
            return key
    return None


def find_key(store: EventStore, data: StepData | None, key: tuple | None) -> Row | None:
    """The row of ``data`` (a step in ``store``) whose alignment key is ``key``."""
    if data is not None and key and key[0] == ATEN:
        return _find_call(store, data, key)
    if data is None or not key or key[0] not in (OP, GRAD):
        return None
    cands = _candidates(data, key[0], key[1])
    for t, (_, k, _) in zip(cands, keyed(store.event(t) for t in cands), strict=True):
        if k == key and t[KIND] == key[0]:
            return data.view(t)
    return None


# An aten call is aligned under its op or node, as ``torchscope diff`` aligns the aten level:
# ``(ATEN, its row's key, an engine sum or not, name, occurrence among that row's calls)``.
def _same_calls(data: StepData, parent: Row, name: str, accumulate: bool) -> list[tuple]:
    """The calls of ``parent`` named ``name``, the engine's sums or its own kernels."""
    return [
        t
        for t in data.aten_of(parent)
        if t[NAME] == name and bool(t[FLAGS] & FLAG_ACCUMULATE) == accumulate
    ]


def _call_key(store: EventStore, data: StepData, row: AtenRow) -> tuple | None:
    parent = row_key(store, data, row.parent)
    if parent is None:
        return None
    same = _same_calls(data, row.parent, row.name, row.accumulate)
    return (ATEN, parent, row.accumulate, row.name, same.index(row.t))


def _find_call(store: EventStore, data: StepData, key: tuple) -> Row | None:
    _, parent_key, accumulate, name, n = key
    parent = find_key(store, data, parent_key)
    same = _same_calls(data, parent, name, accumulate) if parent is not None else []
    return AtenRow(same[n], parent) if n < len(same) and parent is not None else None


def describe_key(key: tuple | None) -> str:
    if not key:
        return "?"
    if key[0] == ATEN:
        _, parent, accumulate, name, n = key
        which = f" (occurrence {n + 1})" if n else ""
        under = "summed after" if accumulate else "in"
        return f"{name}{which} {under} {describe_key(parent)}"
    where = key[2] or "the top level"
    n = key[-1] + 1
    return f"{key[1]} in {where}" + (f" (occurrence {n} in its step)" if n > 1 else "")
