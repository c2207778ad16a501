"""One step of a trace as the UI holds it: its counts (:class:`StepInfo`, kept when its events
are evicted) and its resident events with the indices between them (:class:`StepData`)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from torchscope.protocol.events import ATEN, GRAD, OP, Event
from torchscope.session.format import short_name, source_cell
from torchscope.session.rows import (
    FLAG_ACCUMULATE,
    FLAGS,
    KIND,
    MODULE,
    NAME,
    NODE_ID,
    NODES,
    OP_SEQ,
    PARAM,
    SEQ,
    SOURCE,
    Rec,
    Row,
    int_or_none,
    seq_key,
)

__all__ = [
    "EVICTED",
    "LOADING",
    "LOSS_KNOWN",
    "ON_DISK",
    "RESIDENT",
    "StepData",
    "StepInfo",
]

# Step states.
RESIDENT = "resident"  # events in memory
ON_DISK = "on disk"  # not in memory, the source can load it
LOADING = "loading"  # requested from the source
EVICTED = "evicted"  # dropped from memory and nothing can bring it back


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
        i = bisect.bisect_left(self.rows, seq, key=seq_key)
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
        recs.sort(key=seq_key)
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
            return max(prior, key=seq_key) if prior else None
        later = [g for g in runs if g[SEQ] > seq]  # before its node: the first run after it
        return min(later, key=seq_key) if later else None

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
            index[key] = tuple(sorted((*have, t), key=seq_key))

    # -- mutation (UI thread) ----------------------------------------------------------------
    def _add_row(self, t: Rec) -> None:
        if t[KIND] == ATEN:
            self._add_aten(t)
            return
        rows = self.rows
        seq = t[SEQ]
        if rows and rows[-1][SEQ] >= seq:
            i = bisect.bisect_left(rows, seq, key=seq_key)
            if i < len(rows) and rows[i][SEQ] == seq:
                return  # duplicate (snapshot overlapping the stream)
            rows.insert(i, t)
            self.reorders += 1
        else:
            rows.append(t)
        if t[KIND] == OP:
            ops = self.ops
            if ops and ops[-1][SEQ] > seq:
                bisect.insort(ops, t, key=seq_key)
            else:
                ops.append(t)
            self.op_by_seq[seq] = t
            for nid in t[NODES]:
                self._link(seq, nid)
            return
        grads = self.grads
        if grads and grads[-1][SEQ] > seq:
            bisect.insort(grads, t, key=seq_key)
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
            op_seq = int_or_none(node.get("op_seq"))
            if op_seq is not None:
                self._link(op_seq, nid)
