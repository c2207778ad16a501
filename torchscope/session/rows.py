"""The UI's rows: op, node and aten call events kept as compact records, and views of them.

Memory: op and grad events, by far the most numerous, are kept as records (plain tuples) that
hold the few fields the lists need (name, module, source, node ids, NaN/Inf flags) plus the
event's msgpack bytes; the full event is decoded again on demand (the detail panel, visible rows).
That is about 5x smaller than the decoded dicts, and invisible to the garbage collector. UI code
reads records through :class:`Row` views. Aten calls (the tracer's aten level) are records too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from operator import itemgetter
from typing import Any

from torchscope.protocol import codec
from torchscope.protocol.events import ATEN, GRAD, OP, Event

__all__ = [
    "FLAG_ACCUMULATE",
    "FLAG_INF_IN",
    "FLAG_INF_OUT",
    "FLAG_NAN_IN",
    "FLAG_NAN_OUT",
    "NO_STEP",
    "AtenRow",
    "PendingRow",
    "Rec",
    "Row",
    "int_or_none",
    "make_item",
    "prepare",
    "seq_key",
    "step_of",
]

# Row.flags: non-finite values on each side. For an op, "in" is its inputs and "out" its
# outputs; for a grad, "in" is grad_outputs (what arrives) and "out" grad_inputs (what it sends).
FLAG_NAN_IN = 1
FLAG_INF_IN = 2
FLAG_NAN_OUT = 4
FLAG_INF_OUT = 8
# An aten call the autograd engine made to sum a tensor's incoming gradients after a node.
FLAG_ACCUMULATE = 16

NO_STEP = -1


_intern = sys.intern


def int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _side_flags(summaries: Any, nan_bit: int, inf_bit: int) -> int:
    flags = 0
    if type(summaries) is not list:
        return 0
    for s in summaries:
        if type(s) is not dict:
            continue
        stats = s.get("stats")
        if type(stats) is not dict:
            continue
        if stats.get("nan"):
            flags |= nan_bit
        if stats.get("inf"):
            flags |= inf_bit
    return flags


# An op or grad event is kept as a plain tuple (a "record"): exact tuples of ints, strings and
# bytes are untracked by Python's cycle collector, so hundreds of thousands of them cost the
# garbage collector nothing (objects would make each full collection walk all of them: ~100 ms
# pauses at 250k events). Fields, by index:
KIND, SEQ, STEP_, NAME, MODULE, SOURCE, FLAGS, RAW, NODE_ID, OP_SEQ, PARAM, NODES = range(12)
Rec = tuple  # (kind, seq, step, name, module, source, flags, raw, node_id, op_seq, param, nodes)

#: sort key of records: their seq (= time) order
seq_key = itemgetter(SEQ)


def _field(i: int) -> Any:
    return property(lambda self: self.t[i])


class Row:
    """A read-only view of one record, for UI code (made on demand, never stored in bulk)."""

    __slots__ = ("module", "t")

    pending = False  # see PendingRow

    def __init__(self, t: Rec, module: str | None = None) -> None:
        self.t = t
        self.module: str = t[MODULE] if module is None else module

    kind = _field(KIND)
    seq = _field(SEQ)
    step = _field(STEP_)
    name = _field(NAME)
    source = _field(SOURCE)
    flags = _field(FLAGS)
    raw = _field(RAW)
    node_id = _field(NODE_ID)
    op_seq = _field(OP_SEQ)
    param = _field(PARAM)
    nodes = _field(NODES)

    @property
    def is_op(self) -> bool:
        return self.t[KIND] == OP

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Row) and other.t[SEQ] == self.t[SEQ] and other.t[KIND] == self.t[KIND]
        )

    def __hash__(self) -> int:
        return hash((self.t[KIND], self.t[SEQ]))

    def __repr__(self) -> str:
        return f"Row({self.kind} #{self.seq} step {self.step} {self.name})"


class AtenRow(Row):
    """A view of one aten call, shown under its ``parent`` (the op's or the node's row)."""

    __slots__ = ("parent",)

    def __init__(self, t: Rec, parent: Row) -> None:
        super().__init__(t, t[MODULE] or parent.module)
        self.parent = parent

    @property
    def accumulate(self) -> bool:
        """The engine summing a tensor's incoming gradients after the parent node."""
        return bool(self.t[FLAGS] & FLAG_ACCUMULATE)


class PendingRow:
    """The event a job is paused at when the timeline has no record of it: the op, node or
    aten call a job stopped *before* (its event does not exist yet), an aten call whose op
    has not come (an op's calls come with it, after it ran), or an event that was lost.
    Quacks like a :class:`Row`; ``event`` is the event (or the stub the pause carries)."""

    pending = True

    def __init__(self, ev: dict) -> None:
        self.event = ev
        kind = ev.get("kind")
        self.kind = kind if kind in (GRAD, ATEN) else OP
        seq = ev.get("seq")
        self.seq = seq if type(seq) is int else -1
        self.step = step_of(ev)
        name = ev.get("node") if self.kind == GRAD else ev.get("name")
        self.name = name if isinstance(name, str) else "?"
        module = ev.get("module")
        self.module = module if isinstance(module, str) else ""
        source = ev.get("source")
        self.source = source if isinstance(source, str) else ""
        param = ev.get("param")
        self.param = param if isinstance(param, str) and param else None
        self.node_id = int_or_none(ev.get("node_id"))
        self.op_seq = int_or_none(ev.get("op_seq"))
        self.nodes = ()
        ins, outs = ("grad_outputs", "grad_inputs") if self.kind == GRAD else ("inputs", "outputs")
        self.flags = _flags(ev, ins, outs)

    @property
    def is_op(self) -> bool:
        return self.kind == OP

    def __repr__(self) -> str:
        return f"PendingRow({self.kind} step {self.step} {self.name})"


def step_of(ev: dict) -> int:
    step = int_or_none(ev.get("step"))
    return NO_STEP if step is None else step


def _flags(ev: dict, ins: str, outs: str) -> int:
    """NaN/Inf flags of what went in and what came out."""
    return _side_flags(ev.get(ins), FLAG_NAN_IN, FLAG_INF_IN) | _side_flags(
        ev.get(outs), FLAG_NAN_OUT, FLAG_INF_OUT
    )


def _record(
    kind: str,
    ev: dict,
    name: Any,
    module: Any,
    flags: int,
    node_id: Any = None,
    op_seq: Any = None,
    param: Any = None,
    ids: tuple = (),
) -> Rec:
    """The compact record of an op, node or aten call (see Rec)."""
    step, source = ev.get("step"), ev.get("source")
    return (
        kind,
        ev["seq"],
        step if type(step) is int else NO_STEP,
        _intern(name) if type(name) is str else "",
        _intern(module) if type(module) is str else "",
        _intern(source) if type(source) is str else "",
        flags,
        codec.pack(ev),
        node_id if type(node_id) is int else None,
        op_seq if type(op_seq) is int else None,
        _intern(param) if type(param) is str and param else None,
        ids,
    )


def make_item(ev: dict) -> Rec | Event:
    """Turn one event into what the store keeps: a record for an op, node or aten call, the
    Event otherwise.

    Called on the source's worker thread, so the UI thread only appends.
    """
    kind = ev.get("kind")
    if kind == OP:
        nodes = ev.get("nodes")
        ids = (
            tuple(n["id"] for n in nodes if type(n) is dict and type(n.get("id")) is int)
            if nodes
            else ()
        )
        flags = _flags(ev, "inputs", "outputs")
        return _record(OP, ev, ev.get("name"), ev.get("module"), flags, ids=ids)
    if kind == GRAD:
        flags = _flags(ev, "grad_outputs", "grad_inputs")
        return _record(
            GRAD,
            ev,
            ev.get("node"),
            "",
            flags,
            ev.get("node_id"),
            ev.get("op_seq"),
            ev.get("param"),
        )
    if kind == ATEN:
        flags = _flags(ev, "inputs", "outputs")
        if ev.get("accumulate"):
            flags |= FLAG_ACCUMULATE
        return _record(
            ATEN, ev, ev.get("name"), ev.get("module"), flags, ev.get("node_id"), ev.get("op_seq")
        )
    return ev if isinstance(ev, Event) else Event(ev)


def prepare(events: Iterable[dict]) -> list[Rec | Event]:
    """make_item over a batch, skipping records that are not events (no kind, no int seq)."""
    out: list[Rec | Event] = []
    for ev in events:
        if not isinstance(ev, dict) or not isinstance(ev.get("kind"), str):
            continue
        if type(ev.get("seq")) is not int:
            continue
        out.append(make_item(ev))
    return out
