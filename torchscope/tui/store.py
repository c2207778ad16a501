"""The UI's model of a trace: events indexed by step, with bounded memory.

No textual imports here (and no torch): sources fill an :class:`Inbox` from a worker thread, and
the app drains it on a timer and applies it to an :class:`EventStore` on the UI thread.

Memory: op and grad events, by far the most numerous, are kept as records (plain tuples) that
hold the few fields the lists need (name, module, source, node ids, NaN/Inf flags) plus the
event's msgpack bytes; the full event is decoded again on demand (the detail panel, visible rows).
That is about 5x smaller than the decoded dicts, and invisible to the garbage collector. UI code
reads records through :class:`Row` views. Aten calls (the tracer's aten level) are records too,
kept per step under their op or node (not timeline rows), counted like rows. Whole steps are
evicted, least recently used first, when more than ``max_events`` rows are resident; the newest
step and pinned (viewed) steps are never evicted. An evicted step keeps its counts and can be
loaded again when the source can reload it (a trace file, or a live session that records).
"""

from __future__ import annotations

import bisect
import math
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter
from typing import Any

from torchscope.protocol import codec
from torchscope.protocol.events import (
    ALERT,
    ATEN,
    EDIT,
    ERROR,
    GRAD,
    GRAPH,
    OP,
    PAUSE,
    RESUME,
    SESSION,
    Event,
)
from torchscope.protocol.history import HISTORY, Bucket, RunHistory, StepPoint
from torchscope.tui.format import is_check, short_name, source_cell
from torchscope.tui.stepping import StepperView

__all__ = [
    "FLAG_ACCUMULATE",
    "FLAG_INF_IN",
    "FLAG_INF_OUT",
    "FLAG_NAN_IN",
    "FLAG_NAN_OUT",
    "AtenRow",
    "CallHits",
    "Changes",
    "EventStore",
    "FieldPattern",
    "HistoryIndex",
    "Inbox",
    "NameMatch",
    "PendingRow",
    "Row",
    "SeriesIndex",
    "StepData",
    "StepInfo",
    "make_item",
    "prepare",
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

# Step states.
RESIDENT = "resident"  # events in memory
ON_DISK = "on disk"  # not in memory, the source can load it
LOADING = "loading"  # requested from the source
EVICTED = "evicted"  # dropped from memory and nothing can bring it back


_intern = sys.intern


def _int(value: Any) -> int | None:
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

_seq_key = itemgetter(SEQ)


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

    @property
    def is_aten(self) -> bool:
        return self.t[KIND] == ATEN

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
        self.step = _step_of(ev)
        name = ev.get("node") if self.kind == GRAD else ev.get("name")
        self.name = name if isinstance(name, str) else "?"
        module = ev.get("module")
        self.module = module if isinstance(module, str) else ""
        source = ev.get("source")
        self.source = source if isinstance(source, str) else ""
        param = ev.get("param")
        self.param = param if isinstance(param, str) and param else None
        self.node_id = _int(ev.get("node_id"))
        self.op_seq = _int(ev.get("op_seq"))
        self.nodes = ()
        ins, outs = ("grad_outputs", "grad_inputs") if self.kind == GRAD else ("inputs", "outputs")
        self.flags = _flags(ev, ins, outs)

    @property
    def is_op(self) -> bool:
        return self.kind == OP

    def __repr__(self) -> str:
        return f"PendingRow({self.kind} step {self.step} {self.name})"


def _step_of(ev: dict) -> int:
    step = _int(ev.get("step"))
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


#: The least rank of a loss (see countpass) the store takes: the output of the op at the root
#: of the step's backward (2) or a ``loss`` an event carries (3). The last one-value op before
#: any backward (1) is a guess (a ``sqrt``, a ``sub``, a NaN before the loss exists), not the
#: loss: a step whose backward has not run shows no loss.
LOSS_KNOWN = 2


@dataclass
class StepInfo:
    """What the step list shows for one step. Counts survive eviction."""

    step: int
    n_ops: int = 0
    n_grads: int = 0
    n_aten: int = 0  # aten calls (the aten level)
    n_graph_nodes: int = 0  # nodes in this step's backward graphs
    n_alerts: int = 0
    n_events: int = 0
    state: str = RESIDENT
    counted: bool = True  # False while a replay's counts are still being gathered
    first_seq: int | None = None
    last_seq: int | None = None
    # The overview (a replay's count pass): the step's loss and its global gradient norm.
    loss: float | None = None
    loss_rank: int = 0  # 3: a loss hint, 2: the backward's root op (see LOSS_KNOWN)
    grad_sq: float = 0.0  # sum of the squared norms of the gradients AccumulateGrad received
    grad_norms: int = 0
    #: a backward of this step is still running (a grad event came after its last graph
    #: event): its gradient norm so far is partial, not the step's
    backward_open: bool = False
    overview_done: bool = False  # the count pass is past this step

    @property
    def grad_norm(self) -> float | None:
        """sqrt of the sum of squares of the parameters' gradient norms; None if none."""
        return math.sqrt(self.grad_sq) if self.grad_norms else None

    @property
    def nodes(self) -> int:
        """Backward nodes: from the graph events, or the grad events before a graph came."""
        return self.n_graph_nodes or self.n_grads


class StepData:
    """The resident events of one step and the indices between them.

    ``rows``/``ops``/``grads`` hold records (tuples, seq order); the accessors below return
    :class:`Row` views.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.rows: list[Rec] = []  # ops and grads together, seq (= time) order
        self.ops: list[Rec] = []
        self.grads: list[Rec] = []
        self.graphs: list[Event] = []
        self.alerts: list[Event] = []
        self.others: list[Event] = []  # step markers, errors
        self.op_by_seq: dict[int, Rec] = {}
        self.node_grads: dict[int, tuple[Rec, ...]] = {}
        self.op_nodes: dict[int, tuple[int, ...]] = {}
        self.graph_nodes: dict[int, dict] = {}  # node id -> node map from the graph event
        # The aten level: calls (records, kind ATEN) under their op (op seq) or node (node
        # id); not timeline rows. They count as resident events like the rows.
        self.aten: dict[int, Rec] = {}  # seq -> record
        self.aten_by_op: dict[int, tuple[Rec, ...]] = {}
        self.aten_by_node: dict[int, tuple[Rec, ...]] = {}
        self.alert_seqs: set[int] = set()
        self.edit_seqs: set[int] = set()  # events whose tensors were changed by hand (✎)
        self.version = 0  # bumped on every change
        self.reorders = 0  # bumped when a row was inserted before the end of ``rows``
        self._hay: list[str] = []  # filter fields per row (lines), built on the first filter
        self._hay_reorders = 0

    def __len__(self) -> int:
        return (
            len(self.rows) + len(self.aten) + len(self.graphs) + len(self.alerts) + len(self.others)
        )

    # -- views -----------------------------------------------------------------------------
    def module_of(self, t: Rec) -> str:
        """An op's module; for a grad, the module of the op that created its node."""
        if t[MODULE] or t[KIND] == OP:
            return t[MODULE]
        op = self.op_by_seq.get(t[OP_SEQ]) if t[OP_SEQ] is not None else None
        return op[MODULE] if op is not None else ""

    def view(self, t: Rec) -> Row:
        return Row(t, self.module_of(t))

    def row(self, index: int) -> Row:
        return self.view(self.rows[index])

    def haystack(self, t: Rec) -> tuple[str, ...]:
        """What the timeline's search and filter match, each field on its own (see
        :class:`FieldPattern`): the name as shown (``F.linear``) and in full, the module,
        the parameter, the source as shown (``train.py:20``) and in full. Empty ones left out."""
        name, source = t[NAME] or "", t[SOURCE] or ""
        shown_name, shown_source = short_name(name), source_cell(source)
        fields = (
            shown_name,
            name if name != shown_name else "",
            self.module_of(t) or "",
            t[PARAM] or "",
            shown_source,
            source if source != shown_source else "",
        )
        return tuple(f for f in fields if f)

    def haystacks(self) -> list[str]:
        """``haystack`` of every row as lines (one field a line: what ``FieldPattern`` searches
        in one go), in row order; kept once built (a filter typed key by key over 100k rows
        then costs one regex search per row, nothing else)."""
        hay = self._hay
        if self._hay_reorders != self.reorders or len(hay) > len(self.rows):
            hay.clear()
            self._hay_reorders = self.reorders
        if len(hay) < len(self.rows):
            f, join = self.haystack, "\n".join
            hay.extend(join(f(t)) for t in self.rows[len(hay) :])
        return hay

    # -- lookups ---------------------------------------------------------------------------
    def row_index(self, seq: int) -> int | None:
        i = bisect.bisect_left(self.rows, seq, key=_seq_key)
        return i if i < len(self.rows) and self.rows[i][SEQ] == seq else None

    def has_row(self, kind: str | None, seq: int) -> bool:
        """Whether the timeline can show event ``seq`` (of ``kind`` when given): an op or
        node row, or an aten call under one."""
        if kind == ATEN or (kind is None and seq in self.aten):
            t = self.aten.get(seq)
            return t is not None and self.aten_parent(t) is not None
        i = self.row_index(seq)
        return i is not None and (kind is None or self.rows[i][KIND] == kind)

    def op(self, seq: int | None) -> Row | None:
        t = None if seq is None else self.op_by_seq.get(seq)
        return None if t is None else Row(t)

    def nodes_of_op(self, op_seq: int) -> tuple[int, ...]:
        return self.op_nodes.get(op_seq, ())

    def grads_of_node(self, node_id: int | None) -> list[Row]:
        if node_id is None:
            return []
        return [self.view(t) for t in self.node_grads.get(node_id, ())]

    def grads_of_op(self, op_seq: int) -> list[Row]:
        """Grad rows of the nodes an op created, in the order they ran."""
        recs = [t for nid in self.nodes_of_op(op_seq) for t in self.node_grads.get(nid, ())]
        recs.sort(key=_seq_key)
        return [self.view(t) for t in recs]

    def graph_of_node(self, node_id: int) -> dict | None:
        return self.graph_nodes.get(node_id)

    # -- the aten level ----------------------------------------------------------------------
    def aten_of(self, row: Row | Rec | Any) -> tuple[Rec, ...]:
        """The aten calls of an op or node row, in seq order: an op's (those that ran inside
        it), a node's (those that ran for this run of it, then the engine's sums after it,
        marked ``FLAG_ACCUMULATE``). Empty for anything else (a pending row, an aten call)."""
        if getattr(row, "pending", False):
            return ()
        t = row.t if isinstance(row, Row) else row
        if type(t) is not tuple or not self.aten:
            return ()
        if t[KIND] == OP:
            return self.aten_by_op.get(t[SEQ], ())
        if t[KIND] != GRAD or t[NODE_ID] is None:
            return ()
        calls = self.aten_by_node.get(t[NODE_ID])
        if not calls:
            return ()
        runs = self.node_grads.get(t[NODE_ID], (t,))
        if len(runs) == 1:
            return calls
        # The node ran more than once in this step (retain_graph): this run's calls are those
        # after the previous run's event, and its sums those before the next run's.
        seq = t[SEQ]
        before = max((g[SEQ] for g in runs if g[SEQ] < seq), default=-1)
        after = min((g[SEQ] for g in runs if g[SEQ] > seq), default=None)
        out = []
        for a in calls:
            if a[FLAGS] & FLAG_ACCUMULATE:
                if a[SEQ] > seq and (after is None or a[SEQ] < after):
                    out.append(a)
            elif before < a[SEQ] < seq:
                out.append(a)
        return tuple(out)

    def aten_parents(self) -> list[Rec]:
        """The op and node rows that may have aten calls (``aten_of`` them to be sure: a
        node that ran twice may have calls for one run only). Read from the call indices,
        so rows without calls cost nothing."""
        out = [t for seq in self.aten_by_op if (t := self.op_by_seq.get(seq)) is not None]
        for nid in self.aten_by_node:
            out.extend(self.node_grads.get(nid, ()))
        return out

    def aten_parent(self, t: Rec) -> Rec | None:
        """The op or node row record an aten call is shown under, if it is in this step."""
        if t[OP_SEQ] is not None:
            return self.op_by_seq.get(t[OP_SEQ])
        nid = t[NODE_ID]
        runs = self.node_grads.get(nid, ()) if nid is not None else ()
        if not runs:
            return None
        seq = t[SEQ]
        if t[FLAGS] & FLAG_ACCUMULATE:  # after its node: the last run before it
            prior = [g for g in runs if g[SEQ] < seq]
            return max(prior, key=_seq_key) if prior else None
        later = [g for g in runs if g[SEQ] > seq]  # before its node: the first run after it
        return min(later, key=_seq_key) if later else None

    def _add_aten(self, t: Rec) -> None:
        seq = t[SEQ]
        if seq in self.aten:
            return  # duplicate (snapshot overlapping the stream)
        self.aten[seq] = t
        if t[OP_SEQ] is not None:
            index, key = self.aten_by_op, t[OP_SEQ]
        elif t[NODE_ID] is not None:
            index, key = self.aten_by_node, t[NODE_ID]
        else:
            return  # no parent: kept (and counted) but shown under nothing
        have = index.get(key)
        if have is None:
            index[key] = (t,)
        elif have[-1][SEQ] < seq:
            index[key] = (*have, t)
        else:
            index[key] = tuple(sorted((*have, t), key=_seq_key))

    # -- mutation (UI thread) ----------------------------------------------------------------
    def _add_row(self, t: Rec) -> None:
        if t[KIND] == ATEN:
            self._add_aten(t)
            return
        rows = self.rows
        seq = t[SEQ]
        if rows and rows[-1][SEQ] >= seq:
            i = bisect.bisect_left(rows, seq, key=_seq_key)
            if i < len(rows) and rows[i][SEQ] == seq:
                return  # duplicate (snapshot overlapping the stream)
            rows.insert(i, t)
            self.reorders += 1
        else:
            rows.append(t)
        if t[KIND] == OP:
            ops = self.ops
            if ops and ops[-1][SEQ] > seq:
                bisect.insort(ops, t, key=_seq_key)
            else:
                ops.append(t)
            self.op_by_seq[seq] = t
            for nid in t[NODES]:
                self._link(seq, nid)
            return
        grads = self.grads
        if grads and grads[-1][SEQ] > seq:
            bisect.insort(grads, t, key=_seq_key)
        else:
            grads.append(t)
        nid = t[NODE_ID]
        if nid is not None:
            have = self.node_grads.get(nid)
            self.node_grads[nid] = (t,) if have is None else (*have, t)
            op_seq = t[OP_SEQ]
            if op_seq is not None:
                self._link(op_seq, nid)

    def _link(self, op_seq: int, node_id: int) -> None:
        ids = self.op_nodes.get(op_seq)
        if ids is None:
            self.op_nodes[op_seq] = (node_id,)
        elif node_id not in ids:
            self.op_nodes[op_seq] = (*ids, node_id)

    def _add_graph(self, ev: Event) -> None:
        self.graphs.append(ev)
        for node in ev.get("nodes") or ():
            if not isinstance(node, dict) or type(node.get("id")) is not int:
                continue
            nid = node["id"]
            self.graph_nodes[nid] = node
            op_seq = _int(node.get("op_seq"))
            if op_seq is not None:
                self._link(op_seq, nid)


@dataclass
class Changes:
    """What one apply() changed, so widgets refresh only what they must."""

    steps_added: bool = False
    steps_changed: set[int] = field(default_factory=set)  # counts or state
    events_changed: set[int] = field(default_factory=set)  # resident rows
    loaded: set[int] = field(default_factory=set)  # whole steps loaded (or the last part)
    started: set[int] = field(default_factory=set)  # the first part of a step streaming in
    evicted: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)  # empty trailing steps dropped
    alerts_added: int = 0
    events: int = 0
    status: dict[str, Any] = field(default_factory=dict)
    progress: tuple[float, float, str] | None = None
    progress_done: bool = False
    errors: list[str] = field(default_factory=list)
    session: bool = False
    # step-through: the paused point changed (or ended); the breakpoint list changed; command
    # replies ``(tag, token, cmd, fields, result or message)``, tag "reply" or "refused".
    paused_changed: bool = False
    breakpoints_changed: bool = False
    replies: list[tuple] = field(default_factory=list)
    history: bool = False  # the run's history (loss, gradient norms per step) changed

    def __bool__(self) -> bool:
        return bool(
            self.history
            or self.paused_changed
            or self.breakpoints_changed
            or self.replies
            or self.steps_added
            or self.steps_changed
            or self.events_changed
            or self.loaded
            or self.started
            or self.evicted
            or self.removed
            or self.alerts_added
            or self.status
            or self.progress
            or self.progress_done
            or self.errors
            or self.session
        )


class EventStore:
    """All the UI knows about a trace. Touched only on the UI thread."""

    def __init__(
        self,
        *,
        max_events: int = 250_000,
        max_alerts: int = 10_000,
        reloadable: bool = False,
        decoded_cache: int = 256,
        live: bool = False,
    ) -> None:
        self.max_events = max(1, max_events)
        self.live = live  # pause/resume events describe the job now (not in a replay)
        self.stepper = StepperView()
        self.max_alerts = max_alerts
        self.reloadable = reloadable
        self.steps: dict[int, StepInfo] = {}
        self.order: list[int] = []  # sorted step numbers
        self._data: OrderedDict[int, StepData] = OrderedDict()  # LRU: oldest use first
        self.alerts: list[Event] = []
        self._alert_seqs: set[int] = set()
        # eager checks among the alerts, by step (a check is not a NaN/Inf alert)
        self.checks: dict[int, int] = {}
        self.errors: list[Event] = []
        self.edits: list[Event] = []  # tensors changed by hand (edit events): the run's numbers
        self._edit_seqs: set[Any] = set()
        self.session: Event | None = None
        self.ended = False  # a live job said it ended
        self.has_aten = False  # aten calls came (a recording or job at the aten level)
        self.complete = True  # a replay's file says it is complete (status "complete")
        self.pinned: set[int] = set()
        self.resident_events = 0
        self.events_applied = 0
        self.evictions = 0
        self.overview_version = 0  # bumped when a step's loss or gradient norm changes
        self._decoded: OrderedDict[int, Event] = OrderedDict()
        self._decoded_max = decoded_cache
        self._partial: dict[int, StepInfo] = {}  # steps streaming in: their counts so far
        #: steps streaming in: (parts done, parts in all, events so far)
        self.loading: dict[int, tuple[int, int, int]] = {}
        #: The run's history (``history`` events, a live job's ``history`` reply): every step's
        #: loss and gradient norms, traced or not; ``history_index`` is it as flat arrays.
        self.history = RunHistory()
        self.history_index = HistoryIndex()
        self.history_version = 0

    # -- reading -----------------------------------------------------------------------------
    def __contains__(self, step: int) -> bool:
        return step in self.steps

    @property
    def newest_step(self) -> int | None:
        return self.order[-1] if self.order else None

    def info(self, step: int) -> StepInfo | None:
        return self.steps.get(step)

    def data(self, step: int | None) -> StepData | None:
        """Resident events of a step (and mark it recently used), or None."""
        if step is None:
            return None
        data = self._data.get(step)
        if data is not None:
            self._data.move_to_end(step)
        return data

    def is_resident(self, step: int) -> bool:
        return step in self._data

    def event(self, row: Row | Rec) -> Event:
        """The full event behind a row, decoded from its bytes (a small cache of recent ones)."""
        t = row.t if isinstance(row, Row) else row
        seq = t[SEQ]
        ev = self._decoded.get(seq)
        if ev is not None and ev.get("kind") == t[KIND]:
            self._decoded.move_to_end(seq)
            return ev
        ev = Event(codec.unpack(t[RAW]))
        self._decoded[seq] = ev
        if len(self._decoded) > self._decoded_max:
            self._decoded.popitem(last=False)
        return ev

    def step_index(self, step: int) -> int | None:
        i = bisect.bisect_left(self.order, step)
        return i if i < len(self.order) and self.order[i] == step else None

    def nan_alerts(self, info: StepInfo) -> int:
        """A step's alerts that are not eager checks (the step list's ⚠)."""
        return max(0, info.n_alerts - self.checks.get(info.step, 0))

    def find_alert(self, seq: int) -> Event | None:
        for a in self.alerts:
            if a.get("seq") == seq:
                return a
        return None

    # -- pinning -----------------------------------------------------------------------------
    def pin(self, steps: Iterable[int]) -> None:
        """Steps being shown: never evicted."""
        self.pinned = set(steps)

    # -- applying ----------------------------------------------------------------------------
    def apply(self, items: Iterable[tuple]) -> Changes:
        """Apply drained inbox items (see Inbox). Returns what changed."""
        ch = Changes()
        for item in items:
            tag = item[0]
            if tag == "events":
                self._ingest(item[1], ch)
            elif tag == "step":
                self._replace_step(item[1], item[2], ch)
            elif tag == "step_part":
                self._step_part(*item[1:7], ch)
            elif tag == "step_abort":
                self._step_abort(item[1], ch)
            elif tag == "index":
                self._index(item[1], ch)
            elif tag == "counts":
                self._counts(item[1], item[2], ch, item[3] if len(item) > 3 else None)
            elif tag == "overview":
                self._overview(item[1], item[2], ch)
            elif tag == HISTORY:  # a source's history batch (a file's count pass)
                if isinstance(item[1], dict):
                    self._take_history(item[1], ch)
            elif tag == "status":
                ch.status.update(item[1])
                if "complete" in item[1]:
                    self.complete = bool(item[1]["complete"]) or bool(item[1].get("truncated"))
                state = item[1].get("state")
                if state in ("ended", "disconnected", "unreachable"):
                    ch.paused_changed |= self.stepper.clear()
                if state == "ended":  # the job is gone, and its breakpoints with it
                    ch.breakpoints_changed |= self.stepper.forget()
                    self.ended = True
            elif tag in ("reply", "refused"):
                if tag == "reply" and isinstance(item[4], dict):
                    paused, bps = self.stepper.on_state(item[4].get("state"))
                    ch.paused_changed |= paused
                    ch.breakpoints_changed |= bps
                    if item[2] == HISTORY:  # the whole history, asked for on attach
                        self._take_history(item[4], ch)
                ch.replies.append(item)
            elif tag == "progress":
                ch.progress = (item[1], item[2], item[3])
            elif tag == "progress_done":
                ch.progress = None
                ch.progress_done = True
            elif tag == "error":
                ch.errors.append(item[1])
            elif tag == "unavailable":
                info = self.steps.get(item[1])
                if info is not None and info.state == LOADING:
                    info.state = EVICTED
                    ch.steps_changed.add(item[1])
                ch.errors.append(item[2])
        # After every batch, not only those that changed a step: what completes the verdict
        # (the last counts, the file's "complete" status, the load ending) comes in any order.
        self._drop_empty_tail(ch)
        self._evict(ch)
        return ch

    def _drop_empty_tail(self, ch: Changes) -> None:
        """Forget the last step when it never began: the step the last ``optimizer.step()``
        opened, with no op, node or alert (complete counts; a live job only once it ended)."""
        if not self.order or (self.live and not self.ended):
            return
        step = self.order[-1]
        info = self.steps[step]
        if len(self.order) < 2 or not info.counted or info.state == LOADING:
            return
        if info.n_ops or info.n_grads or info.n_graph_nodes or info.n_alerts:
            return
        if info.state == ON_DISK and not self.complete:
            return  # a file still being written: the step may yet begin
        self.order.pop()
        del self.steps[step]
        data = self._data.pop(step, None)
        if data is not None:
            self.resident_events -= _resident_rows(data)
        ch.removed.add(step)
        ch.steps_changed.discard(step)
        ch.events_changed.discard(step)
        ch.loaded.discard(step)

    def ingest(self, events: Iterable[dict]) -> Changes:
        """Prepare and apply events in one go (tests, and callers on the UI thread)."""
        return self.apply([("events", prepare(events))])

    def _info(self, step: int, ch: Changes) -> StepInfo:
        info = self.steps.get(step)
        if info is None:
            info = self.steps[step] = StepInfo(step)
            if not self.order or step > self.order[-1]:
                self.order.append(step)
            else:
                bisect.insort(self.order, step)
            ch.steps_added = True
        return info

    def _stepdata(self, step: int, info: StepInfo) -> StepData | None:
        data = self._data.get(step)
        if data is None:
            if info.state not in (RESIDENT,) and info.n_events:
                # Evicted or on disk: new events for it would give a partial view; count only.
                return None
            data = self._data[step] = StepData(step)
            info.state = RESIDENT
        else:
            self._data.move_to_end(step)
        return data

    def _ingest(self, items: list[Rec | Event], ch: Changes) -> None:
        # The hot path of a live session: the common case (an op or grad row for the same
        # step as the previous item) is handled inline.
        cur_step: int | None = None
        info: StepInfo | None = None
        data: StepData | None = None
        applied = 0
        for item in items:
            if type(item) is tuple:
                step = item[STEP_]
            else:
                kind = item.get("kind")
                if kind == SESSION:
                    self.session = item
                    ch.session = True
                    continue
                if kind == HISTORY:  # not a step's event: the run's points (no step row)
                    self._take_history(item, ch)
                    continue
                if self.live and kind in (PAUSE, RESUME):
                    stepper = self.stepper
                    if kind == PAUSE:
                        ch.paused_changed |= stepper.on_pause_event(item)
                    else:
                        ch.paused_changed |= stepper.on_resume_event(item)
                step = _step_of(item)
            if step != cur_step or info is None:
                if cur_step is not None:
                    ch.steps_changed.add(cur_step)
                    if data is not None:
                        ch.events_changed.add(cur_step)
                cur_step = step
                info = self._info(step, ch)
                data = self._stepdata(step, info)
            applied += 1
            if type(item) is tuple:
                info.n_events += 1
                seq = item[SEQ]
                if info.first_seq is None or seq < info.first_seq:
                    info.first_seq = seq
                if info.last_seq is None or seq > info.last_seq:
                    info.last_seq = seq
                if item[KIND] == OP:
                    info.n_ops += 1
                elif item[KIND] == GRAD:
                    info.n_grads += 1
                    info.backward_open = True
                else:
                    info.n_aten += 1
                    self.has_aten = True
                if data is not None:
                    data._add_row(item)
                    data.version += 1
                    self.resident_events += 1
            else:
                self._count(info, item, ch)
                if data is not None:
                    self._place(data, item)
                    self.resident_events += 1
        if cur_step is not None:
            ch.steps_changed.add(cur_step)
            if data is not None:
                ch.events_changed.add(cur_step)
        ch.events += applied
        self.events_applied += applied

    def _count(self, info: StepInfo, item: Rec | Event, ch: Changes) -> None:
        info.n_events += 1
        seq = item[SEQ] if type(item) is tuple else item.get("seq")
        if type(seq) is int:
            if info.first_seq is None or seq < info.first_seq:
                info.first_seq = seq
            if info.last_seq is None or seq > info.last_seq:
                info.last_seq = seq
        if type(item) is tuple:
            if item[KIND] == OP:
                info.n_ops += 1
            elif item[KIND] == GRAD:
                info.n_grads += 1
                info.backward_open = True
            else:
                info.n_aten += 1
                self.has_aten = True
            return
        kind = item.get("kind")
        if kind == GRAPH:  # emitted once its backward call returns
            nodes = item.get("nodes")
            info.n_graph_nodes += len(nodes) if isinstance(nodes, list) else 0
            info.backward_open = False
        elif kind == ALERT:
            info.n_alerts += 1
            self._add_alert(item, ch)
        elif kind == ERROR and len(self.errors) < self.max_alerts:
            self.errors.append(item)
        elif kind == EDIT and item.get("seq") not in self._edit_seqs:
            self._edit_seqs.add(item.get("seq"))  # a step loaded again counts no edit twice
            self.edits.append(item)

    def _add_alert(self, ev: Event, ch: Changes) -> None:
        seq = ev.get("seq")
        if seq in self._alert_seqs or len(self.alerts) >= self.max_alerts:
            return
        self._alert_seqs.add(seq)
        if is_check(ev):
            step = _step_of(ev)
            self.checks[step] = self.checks.get(step, 0) + 1
        if self.alerts and _alert_key(self.alerts[-1]) > _alert_key(ev):
            bisect.insort(self.alerts, ev, key=_alert_key)
        else:
            self.alerts.append(ev)
        ch.alerts_added += 1

    @staticmethod
    def _place(data: StepData, item: Rec | Event) -> None:
        if type(item) is tuple:
            data._add_row(item)
        else:
            kind = item.get("kind")
            if kind == GRAPH:
                data._add_graph(item)
            elif kind == ALERT:
                data.alerts.append(item)
                # the ⚠ of a row: a NaN/Inf alert names it (an eager check names its
                # compiled call, which its tag and detail show)
                if type(item.get("event_seq")) is int and not is_check(item):
                    data.alert_seqs.add(item["event_seq"])
            else:
                if kind == EDIT and type(item.get("at")) is int:
                    data.edit_seqs.add(item["at"])
                data.others.append(item)
        data.version += 1

    def _replace_step(self, step: int, items: list[Rec | Event], ch: Changes) -> None:
        """A whole step loaded from the source: its events replace whatever was resident."""
        self._step_part(step, items, True, True, 1, 1, ch)

    def _step_part(
        self,
        step: int,
        items: list[Rec | Event],
        first: bool,
        last: bool,
        done: int,
        total: int,
        ch: Changes,
    ) -> None:
        """Part of a step the source is loading (a huge step streams in, chunk by chunk).
        The first part replaces whatever was resident and is shown at once (``ch.started``);
        the step stays LOADING, its counts unchanged, until the last part makes them exact
        (``ch.loaded``). Parts of a load that was aborted or evicted meanwhile are ignored."""
        info = self._info(step, ch)
        if first:
            old = self._data.pop(step, None)
            if old is not None:
                self.resident_events -= _resident_rows(old)
            self._data[step] = StepData(step)
            self._partial[step] = StepInfo(step)
            ch.started.add(step)
        fresh = self._partial.get(step)
        data = self._data.get(step)
        if fresh is None or data is None:
            return
        before = _resident_rows(data)
        for item in items:
            if type(item) is not tuple and item.get("kind") == SESSION:
                if self.session is None:
                    self.session = item
                    ch.session = True
                continue
            if type(item) is not tuple and item.get("kind") == HISTORY:
                self._take_history(item, ch)
                continue
            self._count(fresh, item, ch)
            self._place(data, item)
        self.resident_events += _resident_rows(data) - before
        data.version += 1
        ch.steps_changed.add(step)
        ch.events_changed.add(step)
        if not last:
            info.state = LOADING
            self.loading[step] = (done, total, fresh.n_events)
            return
        del self._partial[step]
        self.loading.pop(step, None)
        # Loaded counts are exact.
        for name in ("n_ops", "n_grads", "n_aten", "n_graph_nodes", "n_alerts", "n_events"):
            setattr(info, name, getattr(fresh, name))
        info.first_seq, info.last_seq = fresh.first_seq, fresh.last_seq
        info.state = RESIDENT
        info.counted = True
        ch.loaded.add(step)

    def _step_abort(self, step: int, ch: Changes) -> None:
        """The source gave up loading ``step`` (another step was asked for): drop the part."""
        if self._partial.pop(step, None) is None:
            return
        self.loading.pop(step, None)
        data = self._data.pop(step, None)
        if data is not None:
            self.resident_events -= _resident_rows(data)
        info = self.steps.get(step)
        if info is not None:
            info.state = ON_DISK
        ch.evicted.add(step)
        ch.steps_changed.add(step)

    def _index(self, entries: list[tuple[int, bool]], ch: Changes) -> None:
        """Steps known to exist in a file, not loaded: ``(step, counted)``."""
        for step, counted in entries:
            info = self.steps.get(step)
            if info is None:
                info = self._info(step, ch)
                info.state = ON_DISK
                info.counted = counted
                ch.steps_changed.add(step)

    def _counts(
        self,
        counts: dict[int, tuple],
        final: Iterable[int],
        ch: Changes,
        losses: dict[int, tuple] | None = None,
    ) -> None:
        """Counts from a replay's background pass: ``{step: (ops, grads, graph_nodes, alerts,
        events, alert_events[, grad_sq, grad_norms[, aten]])}``; ``final`` lists steps whose
        counts are now complete; ``losses``: ``{step: (value, rank)}`` (see countpass)."""
        for step, (n_ops, n_grads, n_gnodes, n_alerts, n_events, alerts, *grad) in counts.items():
            n_aten = grad[2] if len(grad) > 2 else 0
            info = self.steps.get(step)
            if info is None:
                info = self._info(step, ch)
                info.state = ON_DISK
                info.counted = False
            for a in alerts:
                self._add_alert(a, ch)
            if grad and not info.overview_done:
                info.grad_sq += grad[0]
                info.grad_norms += grad[1]
                self.overview_version += 1
                ch.steps_changed.add(step)
            if info.counted:
                continue  # exact already (loaded, or a previous pass finished it)
            info.n_ops += n_ops
            info.n_grads += n_grads
            info.n_aten += n_aten
            self.has_aten |= n_aten > 0
            info.n_graph_nodes += n_gnodes
            info.n_alerts += n_alerts
            info.n_events += n_events
            ch.steps_changed.add(step)
        for step, (value, rank) in (losses or {}).items():
            if type(rank) is not int or rank < LOSS_KNOWN:
                continue
            info = self.steps.get(step) or self._info(step, ch)
            if isinstance(value, (int, float)) and rank >= info.loss_rank:
                info.loss, info.loss_rank = float(value), rank
                self.overview_version += 1
                ch.steps_changed.add(step)
        for step in final:
            info = self.steps.get(step)
            if info is not None:
                info.overview_done = True
            if info is not None and not info.counted:
                info.counted = True
                ch.steps_changed.add(step)

    def _overview(
        self, grads: dict[int, tuple[float, int]], losses: dict[int, tuple], ch: Changes
    ) -> None:
        """A live session's loss and gradient norms (``LiveOverview``), for steps whose
        events came: ``grads`` ``{step: (sum of squared norms, how many)}`` adds up,
        ``losses`` ``{step: (value, rank)}`` replaces a loss of lower or equal rank."""
        for step, (sq, n) in grads.items():
            info = self.steps.get(step)
            if info is None or not n:
                continue
            info.grad_sq += sq
            info.grad_norms += n
            self.overview_version += 1
            ch.steps_changed.add(step)
        for step, (value, rank) in losses.items():
            info = self.steps.get(step)
            if info is None or not isinstance(value, (int, float)) or type(rank) is not int:
                continue
            if rank >= max(LOSS_KNOWN, info.loss_rank):
                info.loss, info.loss_rank = float(value), rank
                self.overview_version += 1
                ch.steps_changed.add(step)

    def overview(self) -> tuple[list[float | None], list[float | None]]:
        """Loss and global gradient norm of every step, in step order (None: not known)."""
        steps = self.steps
        losses = [steps[s].loss for s in self.order]
        norms = [steps[s].grad_norm for s in self.order]
        return losses, norms

    # -- the run's history -------------------------------------------------------------------
    def take_history(self, wire: dict) -> Changes:
        """Take a ``history`` event's (or reply's) ``points`` and ``buckets`` (tests, and
        callers on the UI thread)."""
        ch = Changes()
        self._take_history(wire, ch)
        return ch

    def _take_history(self, wire: dict, ch: Changes) -> None:
        points = [
            StepPoint.from_wire(p)
            for p in wire.get("points") or ()
            if isinstance(p, dict) and type(p.get("step")) is int
        ]
        buckets = [
            Bucket.from_wire(b)
            for b in wire.get("buckets") or ()
            if isinstance(b, dict) and type(b.get("first")) is int and type(b.get("last")) is int
        ]
        if (not points and not buckets) or self._holds(points, buckets):
            return  # nothing, or seen already (a recording's step loaded again)
        hist = self.history
        newest = hist.points[-1].step if hist.points else None
        last_bucket = hist.buckets[-1].last if hist.buckets else None
        in_order = all(points[i].step < points[i + 1].step for i in range(len(points) - 1))
        if (
            in_order
            and (newest is None or not points or points[0].step >= newest)
            and (last_bucket is None or not buckets or buckets[0].first > last_bucket)
            and (not buckets or not hist.points or buckets[-1].last < hist.points[0].step)
        ):
            # The usual case, a live job's new steps: appended (RunHistory folds the oldest).
            hist.buckets.extend(buckets)
            for p in points:
                hist.add(p)
            dirty = points[0].step if points else None
        else:
            # Out of order: the whole history (the attach reply, a recording's step loaded
            # again) overlapping what live events brought. Merged by step, the newer word on
            # a step winning, into a fresh history.
            self.history = hist = _merged_history(hist, points, buckets)
            self.history_index = HistoryIndex()
            dirty = None
        self.history_index.sync(hist, dirty)
        self.history_version += 1
        self.overview_version += 1  # the step list's scale and sparkline read the history too
        ch.history = True
        ch.steps_added = True  # the step list has rows for the history's steps

    def _holds(self, points: list[StepPoint], buckets: list[Bucket]) -> bool:
        """Whether the history has these points (equal) and buckets (by range) already."""
        index = self.history_index
        if any(index.point(p.step) != p for p in points):
            return False
        held = {(b.first, b.last) for b in index.buckets} if buckets else set()
        return all((b.first, b.last) in held for b in buckets)

    def mark_loading(self, step: int) -> None:
        info = self.steps.get(step)
        if info is not None and step not in self._data:
            info.state = LOADING

    def _evict(self, ch: Changes) -> None:
        if self.resident_events <= self.max_events:
            return
        newest = self.newest_step
        for step in list(self._data):
            if self.resident_events <= self.max_events:
                break
            if step == newest or step in self.pinned:
                continue
            data = self._data.pop(step)
            self.resident_events -= _resident_rows(data)
            self._partial.pop(step, None)  # a load still streaming: its later parts are ignored
            self.loading.pop(step, None)
            info = self.steps[step]
            info.state = ON_DISK if self.reloadable else EVICTED
            self.evictions += 1
            ch.evicted.add(step)
            ch.steps_changed.add(step)


def _resident_rows(data: StepData) -> int:
    return len(data)


def _alert_key(ev: Event) -> tuple[int, int]:
    return (_step_of(ev), ev.get("seq") if type(ev.get("seq")) is int else 0)


def _merged_history(old: RunHistory, points: list[StepPoint], buckets: list[Bucket]) -> RunHistory:
    """``old`` and a batch that overlaps it, as one history in step order: a step's point
    from the batch replaces the one held; buckets are kept once each (by their range), and
    none that covers steps held at full resolution."""
    by_step = {p.step: p for p in old.points}
    by_step.update((p.step, p) for p in points)
    first = min(by_step) if by_step else None
    seen: dict[tuple[int, int], Bucket] = {}
    for b in (*old.buckets, *buckets):
        if first is None or b.last < first:
            seen.setdefault((b.first, b.last), b)
    out = RunHistory(keep=old.keep, bucket=old.bucket)
    out.buckets = sorted(seen.values(), key=lambda b: b.first)
    for step in sorted(by_step):
        out.add(by_step[step])
    return out


class SeriesIndex:
    """One series of the history (loss, a gradient norm) as flat lists, step order: ``xs``
    and ``ys`` the steps with a finite value and those values, ``bad_xs``/``bad_ys`` the
    steps whose value is NaN or Inf. Plain lists so a plot's column costs two bisects and a
    ``min``/``max`` over a slice (C loops), not a Python loop over its points."""

    __slots__ = ("bad_xs", "bad_ys", "xs", "ys")

    def __init__(self) -> None:
        self.xs: list[int] = []
        self.ys: list[float] = []
        self.bad_xs: list[int] = []
        self.bad_ys: list[float] = []

    def __len__(self) -> int:
        return len(self.xs) + len(self.bad_xs)

    def append(self, step: int, value: float | None) -> None:
        if value is None:
            return
        if math.isfinite(value):
            self.xs.append(step)
            self.ys.append(value)
        else:
            self.bad_xs.append(step)
            self.bad_ys.append(value)

    def drop_before(self, step: int) -> None:
        k = bisect.bisect_left(self.xs, step)
        del self.xs[:k], self.ys[:k]
        k = bisect.bisect_left(self.bad_xs, step)
        del self.bad_xs[:k], self.bad_ys[:k]

    def drop_from(self, step: int) -> None:
        k = bisect.bisect_left(self.xs, step)
        del self.xs[k:], self.ys[k:]
        k = bisect.bisect_left(self.bad_xs, step)
        del self.bad_xs[k:], self.bad_ys[k:]

    def value_at(self, step: int) -> float | None:
        """The value at ``step`` (NaN/Inf included), None when it has none."""
        for xs, ys in ((self.xs, self.ys), (self.bad_xs, self.bad_ys)):
            i = bisect.bisect_left(xs, step)
            if i < len(xs) and xs[i] == step:
                return ys[i]
        return None

    def span(self, a: int, b: int) -> tuple[float, float] | None:
        """min and max of the finite values of steps ``a`` <= step < ``b``, or None."""
        i = bisect.bisect_left(self.xs, a)
        j = bisect.bisect_left(self.xs, b, lo=i)
        if i == j:
            return None
        if j - i == 1:
            return self.ys[i], self.ys[i]
        part = self.ys[i:j]
        return min(part), max(part)

    def bad_in(self, a: int, b: int) -> bool:
        """Whether a step ``a`` <= step < ``b`` has a NaN or Inf value."""
        i = bisect.bisect_left(self.bad_xs, a)
        return i < len(self.bad_xs) and self.bad_xs[i] < b


class HistoryIndex:
    """The store's :class:`RunHistory` as flat arrays for the step list, the plot and the
    heatmap: ``points`` (a list, indexable where the history's deque is not), ``steps``,
    the ``loss`` and ``grad_norm`` series and, built on first use, one series per module
    (``module_series``). Kept in step with the history incrementally (new steps appended,
    the oldest dropped as the history folds them), so a live job's history events cost what
    they bring, not the 100k steps held."""

    def __init__(self) -> None:
        self.points: list[StepPoint] = []
        self.steps: list[int] = []
        # step - (its index since the first step ever held): equal values mark a run of
        # consecutive steps, so the step list finds runs by bisection (see ``run_end``)
        self._runs: list[int] = []
        self._dropped = 0
        self.loss = SeriesIndex()
        self.grad_norm = SeriesIndex()
        self.buckets: list[Bucket] = []
        self.version = 0
        self._modules: dict[str, SeriesIndex] | None = None
        self._modules_upto = 0  # points read into the module series
        # the newest steps that keep per-module values in the history (RunHistory's
        # module_keep): the module series keep no more, or a long live session would hold
        # every module's norm for every step the UI ever saw
        self.module_keep: int | None = None

    def __len__(self) -> int:
        return len(self.points)

    @property
    def first_step(self) -> int | None:
        """The oldest step the history covers (a bucket's, else a point's)."""
        if self.buckets:
            return self.buckets[0].first
        return self.steps[0] if self.steps else None

    @property
    def last_step(self) -> int | None:
        if self.steps:
            return self.steps[-1]
        return self.buckets[-1].last if self.buckets else None

    def point(self, step: int) -> StepPoint | None:
        i = bisect.bisect_left(self.steps, step)
        return self.points[i] if i < len(self.steps) and self.steps[i] == step else None

    def run_end(self, i: int, hi: int) -> int:
        """The end (exclusive, at most ``hi``) of the run of consecutive steps at ``i``."""
        return bisect.bisect_right(self._runs, self._runs[i], lo=i, hi=hi)

    def sync(self, hist: RunHistory, dirty_from: int | None = None) -> None:
        """Catch up with ``hist``: drop what it folded, re-read steps from ``dirty_from`` on
        (points replaced or updated), append the new ones."""
        self.version += 1
        self.buckets = hist.buckets
        self.module_keep = getattr(hist, "module_keep", None)
        if not hist.points:
            self._truncate(0)
            return
        first = hist.points[0].step
        if self.steps and self.steps[0] < first:
            k = bisect.bisect_left(self.steps, first)
            del self.points[:k], self.steps[:k], self._runs[:k]
            self._dropped += k
            for s in (self.loss, self.grad_norm, *(self._modules or {}).values()):
                s.drop_before(first)
            self._modules_upto = max(0, self._modules_upto - k)
        if dirty_from is not None and self.steps and dirty_from <= self.steps[-1]:
            self._truncate(bisect.bisect_left(self.steps, dirty_from))
        last = self.steps[-1] if self.steps else None
        fresh: list[StepPoint] = []
        for p in reversed(hist.points):
            if last is not None and p.step <= last:
                break
            fresh.append(p)
        fresh.reverse()
        base = self._dropped
        for p in fresh:
            step = p.step
            self._runs.append(step - base - len(self.steps))
            self.points.append(p)
            self.steps.append(step)
            self.loss.append(step, p.loss)
            self.grad_norm.append(step, p.grad_norm)

    def _truncate(self, k: int) -> None:
        if k >= len(self.steps):
            return
        step = self.steps[k]
        del self.points[k:], self.steps[k:], self._runs[k:]
        for s in (self.loss, self.grad_norm, *(self._modules or {}).values()):
            s.drop_from(step)
        self._modules_upto = min(self._modules_upto, k)

    def module_series(self) -> dict[str, SeriesIndex]:
        """Per-module gradient norms (module path -> series), in the order modules first
        appear; read on first use (most views never need them) and kept up to date after."""
        if self._modules is None:
            self._modules = {}
            self._modules_upto = 0
        mods = self._modules
        keep, steps = self.module_keep, self.steps
        cutoff = steps[-keep] if keep is not None and 0 < keep < len(steps) else None
        if keep == 0:
            cutoff = steps[-1] + 1 if steps else None
        if cutoff is not None:
            self._modules_upto = max(self._modules_upto, bisect.bisect_left(steps, cutoff))
            for s in mods.values():
                s.drop_before(cutoff)
        for p in islice(self.points, self._modules_upto, None):
            if p.module_norms:
                for name, value in p.module_norms.items():
                    s = mods.get(name)
                    if s is None:
                        s = mods[name] = SeriesIndex()
                    s.append(p.step, value)
        self._modules_upto = len(self.points)
        return mods


class Inbox:
    """Thread-safe hand-off from a source's worker thread to the UI thread.

    Items are tuples; the app drains all of them on its timer and applies them in one batch:
    ``("events", [record|Event])``, ``("step", step, [record|Event])`` (a whole step loaded),
    ``("step_part", step, [record|Event], first, last, done, total)`` (a step streaming in,
    ``done`` of ``total`` parts) and ``("step_abort", step)``,
    ``("index", [(step, counted)])``, ``("counts", {step: (...)}, final_steps)``,
    ``("overview", {step: (grad_sq, grad_norms)}, {step: (loss, rank)})`` (live),
    ``("status", {...})``, ``("progress", done, total, label)``, ``("progress_done",)``,
    ``("error", message)``, ``("unavailable", step, message)``, and the answers to commands
    (see ``EventSource.command``): ``("reply", token, cmd, fields, result)``,
    ``("refused", token, cmd, fields, one_line_message)``.

    ``max_pending`` bounds buffered events: past it, ``put_events`` refuses the batch (the
    caller counts it as dropped), the same policy the tracer's PUB socket has.
    """

    def __init__(self, max_pending: int = 500_000) -> None:
        self._lock = threading.Lock()
        self._items: deque[tuple] = deque()
        self._pending_events = 0
        self.max_pending = max_pending
        self.dropped = 0
        self.wakeup: Any = None  # optional callable(): nudges the UI when something arrives

    def put(self, *item: Any) -> None:
        with self._lock:
            self._items.append(item)

    def put_events(self, items: list[Rec | Event]) -> bool:
        if not items:
            return True
        with self._lock:
            if self._pending_events + len(items) > self.max_pending:
                self.dropped += len(items)
                return False
            self._pending_events += len(items)
            self._items.append(("events", items))
        return True

    def put_step_part(
        self, step: int, items: list, first: bool, last: bool, done: int, total: int
    ) -> None:
        """Part of a step being loaded (see EventStore._step_part). Never refused: the source
        waits while ``pending_events`` is high instead."""
        with self._lock:
            self._pending_events += len(items)
            self._items.append(("step_part", step, items, first, last, done, total))

    def status(self, **values: Any) -> None:
        self.put("status", values)

    def drain(self, max_events: int | None = None) -> list[tuple]:
        """Take buffered items. With ``max_events``, stop after roughly that many events so one
        UI frame never applies an unbounded backlog (the rest waits for the next tick)."""
        with self._lock:
            if max_events is None:
                items = list(self._items)
                self._items.clear()
                self._pending_events = 0
                return items
            out: list[tuple] = []
            taken = 0
            while self._items and taken < max_events:
                item = self._items.popleft()
                if item[0] == "events":
                    taken += len(item[1])
                    self._pending_events -= len(item[1])
                elif item[0] == "step_part":
                    taken += len(item[2])
                    self._pending_events -= len(item[2])
                out.append(item)
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def pending_events(self) -> int:
        return self._pending_events


class RateMeter:
    """Events per second over a sliding window."""

    def __init__(self, window: float = 2.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if n:
            self._samples.append((now, n))
            self._total += n
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window:
            _, n = self._samples.popleft()
            self._total -= n

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return self._total / self.window


class FieldPattern:
    r"""A case-insensitive regex matched against each field of a row on its own (so ``^`` and
    ``$`` anchor within one field, and nothing matches across two): ``search`` takes one
    text, a row's fields (``StepData.haystack``), or those fields as lines
    (``StepData.haystacks``), and matches when any field does. Has ``re.Pattern``'s
    ``pattern``, ``flags`` and ``search``, so the graph panel and the aten call match
    (``NameMatch``) use it as one.

    Over many rows, ``prefilter`` (the same regex with ``re.MULTILINE``, over the fields as
    lines) comes first: one C-level search a row, and it matches every row where a field
    does (``^``/``$`` meet line ends where they meet field ends). Only the rows it keeps are
    checked field by field, since it may also match across two lines (``\s``, ``[^x]``)."""

    __slots__ = ("_field", "flags", "pattern", "prefilter")

    def __init__(self, text: str) -> None:
        field = re.compile(text, re.IGNORECASE)
        self._field = field.search
        self.prefilter = re.compile(text, re.IGNORECASE | re.MULTILINE).search
        self.pattern = field.pattern
        self.flags = field.flags

    def search(self, text: str | tuple[str, ...]) -> bool | None:
        """For one text (several lines: each on its own), or a row's fields: True when
        one matches, else None."""
        fields = text.split("\n") if isinstance(text, str) else text
        return True if any(map(self._field, fields)) else None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FieldPattern)
            and other.pattern == self.pattern
            and other.flags == self.flags
        )

    def __hash__(self) -> int:
        return hash((FieldPattern, self.pattern, self.flags))

    def __repr__(self) -> str:
        return f"FieldPattern({self.pattern!r})"


def compile_filter(text: str) -> FieldPattern | None:
    """The timeline's search and filter: a case-insensitive regex matched field by field (see
    :class:`FieldPattern`), or None for no filter. Raises re.error."""
    text = text.strip()
    if not text:
        return None
    return FieldPattern(text)


# -- search and filter over aten calls ---------------------------------------------------------
# An aten call is matched on its name alone: its module and source line are those of its op or
# node (the tracer gives it theirs), so a search for a module or a line finds that row once,
# not again in each of its calls.
class NameMatch:
    """``pattern`` over aten call names, each distinct name searched once (a step has many
    calls and few names)."""

    def __init__(self, pattern: re.Pattern[str] | FieldPattern) -> None:
        self.pattern = pattern
        self._seen: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        hit = self._seen.get(name)
        if hit is None:
            hit = self._seen[name] = self.pattern.search(name) is not None
        return hit


class CallHits:
    """The aten calls of one step that a pattern matches, by the seq of the op or node row
    they are shown under (the timeline's filter keeps those rows, for context). Incremental:
    each ``update`` reads the calls that came since, and again the matching calls whose row
    had not come yet (an op's calls come before the op, a node's before its event)."""

    def __init__(self, data: StepData, pattern: re.Pattern[str] | FieldPattern) -> None:
        self.data = data
        self.match = NameMatch(pattern)
        self.by_row: dict[int, tuple[Rec, ...]] = {}
        self._read = 0  # calls of data.aten read (a dict only grows, in arrival order)
        self._waiting: list[Rec] = []

    def update(self) -> list[int]:
        """Read what came; the seqs of the rows that got their first matching call."""
        data, match = self.data, self.match
        fresh = [t for t in islice(data.aten.values(), self._read, None) if match(t[NAME])]
        self._read = len(data.aten)
        todo, self._waiting = self._waiting + fresh, []
        first: list[int] = []
        for t in todo:
            parent = data.aten_parent(t)
            if parent is None:
                if t[OP_SEQ] is not None or t[NODE_ID] is not None:  # its row may yet come
                    self._waiting.append(t)
                continue
            have = self.by_row.get(parent[SEQ])
            if have is None:
                self.by_row[parent[SEQ]] = (t,)
                first.append(parent[SEQ])
            else:
                self.by_row[parent[SEQ]] = tuple(sorted((*have, t), key=_seq_key))
        return first

    def calls(self) -> list[Rec]:
        """Every matching call shown under a row, in seq order."""
        return sorted((t for calls in self.by_row.values() for t in calls), key=_seq_key)
