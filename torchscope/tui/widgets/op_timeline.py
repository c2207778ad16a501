"""The selected step, one line per event, in the order they happened: the forward ops, then
the backward nodes as they ran (then the optimizer's ops, which come after backward).

A virtual list (Line API): only visible lines are rendered, so a step with 100k events moves as
fast as one with ten. Each line: seq, direction, name (op, or node), module (or the parameter
for AccumulateGrad, shortened from the left: ``…attn.proj``), a backward node's gradient flow
(``∇in → ∇out``: ``1 → 2, None``, how many gradients arrived and what it sends on to each
input, so what flows through a node needs no key), shapes, a compact stat (norm, or
mean±std with ``m``), NaN/Inf flags and the source as ``file:line`` (the detail has the path).

While a live job is paused, the event it is paused at is marked (⏸, highlighted). When the
job stopped *before* an op or node, that event does not exist yet: it is shown as a pending
row at the end, from what the pause says about it.

A recording made at the aten level has the aten calls of each op and node: such a row is
marked (``▸+``, ``◂+``); ``→``/``l`` unfolds it into its calls, indented rows under it in the
same columns (``Σ``: the engine summing a tensor's incoming gradients after the node), and
``←``/``h`` folds it again (on a call: back to its row). ``unfold_all`` (the screen's ``A``)
unfolds every such row, in every step and as rows come, until it is turned off; ``→``/``←``
still fold or unfold one row against it. A call made by something other than its row's own
work (autocast's casts, checkpointing's recompute, a torch.func transform) carries a dim tag
after its name (``[recompute]``). Rows with no aten call look and behave as without the aten
level. A compiled module's call (one op: what runs inside is not traced) is tagged
``[compiled]``, the ops of its eager re-run (an eager check) ``[eager]``.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any, ClassVar, TypeGuard

from rich.style import Style
from textual.binding import Binding, BindingType
from textual.events import Click, MouseScrollUp
from textual.message import Message

from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.session.format import (
    event_tag,
    fit_numbers,
    shapes_text,
    short_name,
    short_path,
    source_cell,
    stat_text,
)
from torchscope.session.rows import (
    FLAG_INF_IN,
    FLAG_INF_OUT,
    FLAG_NAN_IN,
    FLAG_NAN_OUT,
    KIND,
    NAME,
    NODE_ID,
    OP_SEQ,
    SEQ,
    AtenRow,
    PendingRow,
    Rec,
    Row,
)
from torchscope.session.search import CallHits, FieldPattern, NameMatch
from torchscope.session.steps import StepData
from torchscope.session.store import EventStore
from torchscope.tui import glyphs
from torchscope.tui.widgets.virtual_list import Cell, VirtualList, fit, rfit


def flow_text(arrived: Any, sent: Any) -> str:
    """A backward node's gradient flow, ``∇in → ∇out``: how many gradients arrived (its
    grad_outputs that are tensors), then what it sends on, input by input: a run of
    tensors as their count, a None (no gradient for that input) as ``None``; ``1 → 2, None``.
    Nothing sent on (an AccumulateGrad): ``1 → -``; not run yet: ``1 →``."""
    n_in = sum(s is not None for s in arrived) if isinstance(arrived, list) else 0
    if not isinstance(sent, list):
        return f"{n_in} →"
    parts: list[str] = []
    run = 0
    for s in sent:
        if s is None:
            if run:
                parts.append(str(run))
                run = 0
            parts.append("None")
        else:
            run += 1
    if run:
        parts.append(str(run))
    return f"{n_in} → {', '.join(parts) or '-'}"


def fit_flow(text: str, width: int) -> str:
    """``flow_text`` in ``width``: in full, else without spaces (``1→2,None``), else with
    ``∅`` for None (``1→2,∅``), else cut."""
    if len(text) > width:
        text = text.replace(" → ", "→").replace(" →", "→").replace(", ", ",")
    if len(text) > width:
        text = text.replace("None", "∅")
    return fit(text, width)


class Columns:
    """Column widths for one content width, sized from the content (``natural``: the widest
    cell of each column in a sample of the step's rows).

    seq, direction, name, module, stat and flags (when a row has any) are always there;
    the gradient flow (``flow``: a backward node's ``∇in → ∇out``, when the step has nodes),
    shapes and source come as room allows and go first when it does not. A column is never
    narrower than its header (``HEADERS``; the module's is ``module / param`` when that fits)
    and never wider than its content or its header: what is left stays blank at the end of
    the line rather than padding a column. A narrow column shortens its text instead of
    dropping: a module path from the left (``…attn.proj``), a number to fewer digits."""

    HEADERS: ClassVar[dict[str, str]] = {
        "name": "name",
        "module": "module",
        "flow": "∇in → ∇out",
        "shapes": "shapes",
        "stat": "stat",
        "flags": "flags",
        "source": "source",
    }
    MODULE_LONG = "module / param"
    # The least each column always gets (its content if shorter; never less than its header)
    FLOOR: ClassVar[dict[str, int]] = {"name": 10, "module": 8, "stat": 7, "flags": 9}
    # When even the floors do not fit: (column, down to), in turn
    SQUEEZE = (("module", 6), ("name", 8), ("stat", 5), ("name", 4), ("stat", 4))
    # Then the room left, in rounds: (column, up to; None: its content). The gradient flow
    # gets the rest of its content last (short of it, it is written without spaces)
    ORDER = (
        ("name", 16),
        ("module", 12),
        ("stat", 10),
        ("name", 24),
        ("module", 24),
        ("flow", 10),
        ("stat", 18),
        ("shapes", 16),
        ("source", 24),
        ("name", None),
        ("module", None),
        ("stat", None),
        ("flags", None),
        ("shapes", None),
        ("source", None),
    )
    OPTIONAL = ("flow", "shapes", "source")
    # The stat lends room down to this to open an optional column that just misses (numbers
    # shorten first: ``norm=14.07`` -> ``14.07``)
    STAT_LENDS = 8
    # An optional column opens only with room for this much of its content (or all of it)
    OPENING: ClassVar[dict[str, int]] = {"flow": 10, "shapes": 8, "source": 16}

    def __init__(self, width: int, natural: dict[str, int] | None = None) -> None:
        nat = {"seq": 4, "name": 24, "stat": 12, "flags": 5, "module": 16, "shapes": 9}
        nat["source"] = 24
        nat["flow"] = 0  # no backward node: no flow column
        if natural:
            nat.update(natural)
        self.seq = max(3, nat["seq"])
        self.dir = 2
        sizes, avail = self._fit(width, nat)
        if sizes["flow"] and not (sizes["shapes"] and sizes["source"]):
            # the gradient flow goes first: shown only where it costs no other column
            without, rest = self._fit(width, dict(nat, flow=0))
            if sum(map(bool, without.values())) >= sum(map(bool, sizes.values())):
                sizes, avail = without, rest
        self.name = sizes["name"]
        self.stat = sizes["stat"]
        self.flags = sizes["flags"]
        self.module = sizes["module"]
        self.flow = sizes["flow"]
        self.shapes = sizes["shapes"]
        self.source = sizes["source"]
        self.spare = max(0, avail)

    def _fit(self, width: int, nat: dict[str, int]) -> tuple[dict[str, int], int]:
        """Each column's width (0: not shown), and the room left."""
        head = self.HEADERS
        # a shown column holds its header: its content or its header, whichever is wider
        want = {k: max(nat[k], len(head[k])) for k in head}
        sizes = dict.fromkeys(head, 0)
        required = ["name", "module", "stat"] + (["flags"] if nat["flags"] > 0 else [])
        for k in required:  # the NaN/Inf marks never vanish, nor name, module and stat
            sizes[k] = max(len(head[k]), min(want[k], self.FLOOR[k]))
        # every shown column costs one separating space
        avail = width - self.seq - 1 - self.dir - sum(sizes[k] + 1 for k in required)
        for k, least in self.SQUEEZE:
            if avail >= 0:
                break
            give = min(-avail, max(0, sizes[k] - max(least, len(head[k]))))
            sizes[k] -= give
            avail += give
        for k, cap in self.ORDER:
            goal = want[k] if cap is None else min(want[k], cap)
            grow = goal - sizes[k]
            if grow <= 0 or avail <= 0:
                continue
            if sizes[k] == 0:  # opening an optional column (no flags: no flags column)
                if k not in self.OPTIONAL or nat[k] <= 0:
                    continue  # a required column, or one with nothing to show
                least = max(len(head[k]), min(want[k], self.OPENING[k]))
                if avail < least + 1:
                    continue  # no room for a useful amount of it
                avail -= 1
            grant = min(grow, avail)
            sizes[k] += grant
            avail -= grant
        for k in self.OPTIONAL:  # a column that just misses: the stat gives up its label
            least = max(len(head[k]), min(want[k], self.OPENING[k]))
            give = least + 1 - avail
            if nat[k] > 0 and not sizes[k] and 0 < give <= sizes["stat"] - self.STAT_LENDS:
                sizes["stat"] -= give
                sizes[k] = least
                avail = 0
        if sizes["flow"] and avail > 0:
            grant = min(want["flow"] - sizes["flow"], avail)
            sizes["flow"] += grant
            avail -= grant
        return sizes, avail

    def module_header(self) -> str:
        """``module / param`` when it fits, else ``module``."""
        return self.MODULE_LONG if self.module >= len(self.MODULE_LONG) else "module"


class OpTimeline(VirtualList):
    """Forward ops and backward nodes of one step, in seq order."""

    HEADER_LINES = 1

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("right,l", "unfold", "Aten calls", show=False),
        Binding("left,h", "fold", "Fold", show=False),
    ]

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "op-timeline--bwd",
        "op-timeline--module",
        "op-timeline--source",
        "op-timeline--seq",
        "op-timeline--paused",
    }

    class FollowChanged(Message):
        """The user turned follow mode off (by moving) or on (``end``)."""

        def __init__(self, following: bool) -> None:
            super().__init__()
            self.following = following

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.store: EventStore | None = None
        self.data: StepData | None = None
        self.step: int | None = None
        self.pattern: FieldPattern | None = None
        self.message = "no step selected"
        self.follow = False
        self.live = False
        self.stat_mode = "norm"
        self.cwd: str | None = None
        self._view: list[int] | None = None  # indices into data.rows matching the filter
        self._hits: CallHits | None = None  # the aten calls the filter matches, by row
        self._seen = (0, 0)  # rows, reorders covered by the view
        self.paused_key: tuple[str, int] | None = None  # (kind, seq) of the paused event
        self.pending: PendingRow | None = None  # the paused event when it has no row
        self._cells: OrderedDict[tuple[int, str], tuple[str, str, str, str]] = OrderedDict()
        self.natural: dict[str, int] = {}  # widest cell per column (a sample): see measure()
        self._natural_key = 0
        self._measured = 0
        self._columns: tuple[tuple[int, int], Columns] | None = None
        # The aten level: rows unfolded into their aten calls. ``unfold_all`` is the default
        # for every row with calls (off: folded); ``_toggled`` holds the rows, by (kind, seq),
        # folded or unfolded by hand against it in this step. Then where the calls are shown:
        # for each unfolded row in view (ascending), its base index (its place without
        # calls), its display index, the calls shown before it, and its calls.
        self.unfold_all = False
        self._toggled: set[tuple[str, int]] = set()
        self._fold_base: list[int] = []
        self._fold_disp: list[int] = []
        self._fold_before: list[int] = []
        self._fold_calls: list[tuple[Rec, ...]] = []
        self._calls_shown = 0
        self._laid: tuple | None = None  # see _layout_state

    # -- model -------------------------------------------------------------------------------
    def set_step(
        self,
        store: EventStore,
        step: int | None,
        data: StepData | None,
        message: str = "",
    ) -> None:
        """Show ``data`` (or ``message`` when the step has no resident events)."""
        self.store = store
        changed = step != self.step or data is not self.data
        if step != self.step:
            self._toggled.clear()  # unfold_all stays: it is for every step
        self.step = step
        self.data = data
        self.message = message or ("no events in this step" if data is not None else "")
        if changed:
            self.cursor = -1
            self._cells.clear()
            self.scroll_to(y=0, animate=False, immediate=True)
        self._rebuild_views()
        self._remeasure(force=changed)
        self.refresh_rows()
        if self.follow:
            self._follow_end()
        elif changed and self.row_count():
            self.move_cursor(0)

    def set_filter(self, pattern: FieldPattern | None) -> None:
        """Keep only rows whose name, module/param or source match ``pattern``, and the aten
        calls whose name it matches, each under its row (kept for context if it does not
        match itself)."""
        keep = self.current_row()
        self.pattern = pattern
        self._rebuild_views()
        self._remeasure(force=True)
        self.refresh_rows()
        index = self._index_of_row(keep)
        if index is not None:
            self.move_cursor(index, center=True)
        elif self.row_count():
            self.move_cursor(0)
        else:
            self.cursor = -1
            self.refresh()

    def view_indices(self) -> list[int] | None:
        """Indices into ``data.rows`` of the rows the filter keeps (None: no filter)."""
        return None if self._view is None else list(self._view)

    def match_positions(self, pattern: FieldPattern) -> list[tuple[int, int]]:
        """Where ``pattern`` matches, in order, among the rows shown (the filter applied):
        ``(base, -1)`` for a row (``base``: its index, aten calls left out) and ``(base, j)``
        for the j-th aten call of that row, shown or folded (see ``position``)."""
        data = self.data
        if data is None:
            return []
        hay = data.haystacks()
        search, first = pattern.search, _prefilter(pattern)
        if self._view is None:
            found = [(i, -1) for i, h in enumerate(hay) if first(h) and search(h)]
        else:
            found = [(j, -1) for j, i in enumerate(self._view) if first(hay[i]) and search(hay[i])]
        if data.aten:
            found.extend(self._call_positions(NameMatch(pattern)))
            found.sort()
        return found

    def _call_positions(self, match: NameMatch) -> list[tuple[int, int]]:
        data = self.data
        assert data is not None
        out = []
        for t in data.aten.values():
            if not match(t[NAME]):
                continue
            parent = data.aten_parent(t)
            base = None if parent is None else self._base_index_of(parent[KIND], parent[SEQ])
            if base is not None:
                out.append((base, data.aten_of(parent).index(t)))
        return out

    def position(self, index: int) -> tuple[int, int]:
        """``index`` (as shown) as a position in ``match_positions``' terms (the pending
        row: after every row)."""
        row = self.row(index)
        if row is None or row.pending:
            return (self._base_count(), -1)
        if isinstance(row, AtenRow):
            base, _, _ = self._locate(index)
            assert self.data is not None
            return (base, self.data.aten_of(row.parent).index(row.t))
        return (self._locate(index)[0], -1)

    def go_to_position(self, pos: tuple[int, int]) -> bool:
        """Put the cursor at ``pos``; an aten call's row unfolds to show it."""
        base, j = pos
        if j < 0:
            if not 0 <= base < self._base_count():
                return False
            self.move_cursor(self._disp_of_base(base), center=True)
            return True
        parent = self._base_row(base)
        calls = self.data.aten_of(parent) if self.data is not None else ()
        return j < len(calls) and self.select(ATEN, calls[j][SEQ])

    def filtered_calls(self) -> list[Rec]:
        """The aten calls the filter keeps (none without a filter), in seq order."""
        return self._hits.calls() if self._hits is not None else []

    def data_changed(self) -> None:
        """The shown step got events (live) or was reloaded."""
        keep = None if self.follow else self.current_row()
        self._update_views()
        self._remeasure()
        self.refresh_rows()
        if self.follow:
            self._follow_end()
        elif keep is not None:
            index = self._index_of_row(keep)
            if index is not None and index != self.cursor:
                self.cursor = index
                self.scroll_to_cursor()
                self.reveal_after_refresh()
        elif self.cursor < 0 and self.row_count():
            self.move_cursor(0)

    def set_paused(self, key: tuple[str, int] | None, pending: PendingRow | None) -> None:
        """Mark the event a job is paused at: ``key`` = (kind, seq) of its row, or a
        ``pending`` row shown after the others. None, None: not paused."""
        if key == self.paused_key and pending is self.pending:
            return
        remeasure = pending is not self.pending
        self.paused_key = key
        self.pending = pending
        if remeasure:
            self._remeasure(force=True)
        self.refresh_rows()

    def paused_index(self) -> int | None:
        """Row index of the paused event (its row or the pending one), if shown."""
        if self.pending is not None:
            return self.row_count() - 1
        if self.paused_key is not None:
            return self.index_of(*self.paused_key)
        return None

    def set_stat_mode(self, mode: str) -> None:
        self.stat_mode = mode
        self._cache.clear()
        self._remeasure(force=True)
        self.refresh()

    def _remeasure(self, *, force: bool = False) -> None:
        """Re-size the columns when the rows changed enough to matter (a live step grows by
        a few rows 30 times a second; its columns settle after its first few hundred)."""
        count = self._base_count()
        last = self._measured
        grown = count < last or count < 500 or count >= last * 1.25
        if force or (grown and count != last):
            self._measured = count
            self.measure()

    def _follow_end(self) -> None:
        count = self.row_count()
        if count and self.cursor != count - 1:
            self.move_cursor(count - 1)

    def _rebuild_views(self) -> None:
        self._view = None
        self._seen = (0, 0)
        self._update_views()

    def _update_views(self) -> None:
        self._update_filter()
        self._relayout()

    def _update_filter(self) -> None:
        data = self.data
        if data is None or self.pattern is None:
            self._view = None
            self._hits = None
            if data is not None:
                self._seen = (len(data.rows), data.reorders)
            return
        search, first = self.pattern.search, _prefilter(self.pattern)
        seen, reorders = self._seen
        if self._view is None or self._hits is None or reorders != data.reorders:
            self._view = []
            self._hits = CallHits(data, self.pattern)
            seen = 0
        view = self._view
        for seq in self._hits.update():  # a row judged before now has a matching call
            i = data.row_index(seq)
            if i is not None and i < seen:
                j = bisect.bisect_left(view, i)
                if j == len(view) or view[j] != i:
                    view.insert(j, i)
        hay = data.haystacks()
        rows, by_row = data.rows, self._hits.by_row
        view.extend(
            i
            for i in range(seen, len(hay))
            if (first(hay[i]) and search(hay[i])) or rows[i][SEQ] in by_row
        )
        self._seen = (len(hay), data.reorders)

    # -- rows --------------------------------------------------------------------------------
    def _base_count(self) -> int:
        if self.data is None:
            return 0
        return len(self._view) if self._view is not None else len(self.data.rows)

    def row_count(self) -> int:
        return self._base_count() + self._calls_shown + (self.pending is not None)

    def calls_shown(self) -> int:
        """Aten call rows shown (unfolded, or kept by the filter)."""
        return self._calls_shown

    def row(self, index: int) -> Row | PendingRow | None:
        data = self.data
        if index < 0:
            return None
        if self.pending is not None and index == self._base_count() + self._calls_shown:
            return self.pending
        if data is None:
            return None
        if not self._fold_disp:
            return self._base_row(index)
        base, call, k = self._locate(index)
        parent = self._base_row(base)
        if parent is None or call < 0:
            return parent
        return AtenRow(self._fold_calls[k][call], parent)

    def _base_row(self, base: int) -> Row | None:
        """The op or node row at ``base``: its index among the rows shown, calls left out."""
        data = self.data
        if data is None or base < 0:
            return None
        if self._view is not None:
            return data.row(self._view[base]) if base < len(self._view) else None
        return data.row(base) if base < len(data.rows) else None

    # -- the aten level: rows unfolded into their calls --------------------------------------
    def _relayout(self) -> None:
        """Place the calls shown (after any change to the rows shown): all of an unfolded
        row's, the ones the filter matches of the others."""
        if self._extend_layout():
            return
        data = self.data
        shown_calls: dict[int, tuple[Rec, ...]] = {}  # base index -> the calls shown under it
        if data is not None and self._hits is not None:  # the filter's: the matching ones
            for seq, calls in self._hits.by_row.items():
                base = self._base_index_of(None, seq)
                if base is not None:
                    shown_calls[base] = calls
        if data is not None and data.aten:
            for kind, seq in self._unfolded_keys():
                base = self._base_index_of(kind, seq)
                if base is None:
                    continue
                calls = data.aten_of(data.rows[base if self._view is None else self._view[base]])
                if calls:
                    shown_calls[base] = calls
        placed = sorted(shown_calls.items(), key=lambda p: p[0])
        shown = 0
        self._fold_base, self._fold_disp, self._fold_before = [], [], []
        self._fold_calls = []
        for base, calls in placed:
            self._fold_base.append(base)
            self._fold_disp.append(base + shown)
            self._fold_before.append(shown)
            self._fold_calls.append(calls)
            shown += len(calls)
        self._calls_shown = shown
        self._laid = self._layout_state()

    # With every row unfolded, a live step's layout grows with it: only what came since the
    # last one is laid out (a full layout visits every row with calls, 30 times a second).
    def _layout_state(self) -> tuple | None:
        """What the layout covers, (step data, its reorders, rows, calls), when it is one
        ``_extend_layout`` can extend: every row unfolded, no filter."""
        data = self.data
        if data is None or not self.unfold_all or self._view is not None:
            return None
        return (data, data.reorders, len(data.rows), len(data.aten))

    def _extend_layout(self) -> bool:
        """Lay out only the rows that came since the last layout and the rows whose calls
        changed, when nothing else did (rows only added at the end). False: do it all."""
        laid, now = self._laid, self._layout_state()
        if laid is None or now is None or laid[0] is not now[0] or laid[1] != now[1]:
            return False
        data, rows_laid, aten_laid = now[0], laid[2], laid[3]
        changed: set[int] = set()  # laid rows whose calls may differ now
        for t in islice(data.aten.values(), aten_laid, None):
            changed.update(self._laid_parents(t[OP_SEQ], t[NODE_ID], rows_laid))
        for t in data.rows[rows_laid:]:  # a node's new run takes calls from its earlier ones
            if t[KIND] == GRAD:
                changed.update(self._laid_parents(None, t[NODE_ID], rows_laid))
        start = len(self._fold_base)  # the first entry whose display index may move
        for base in sorted(changed):
            start = min(start, self._set_calls(base, self._unfolded_calls(data.rows[base])))
        for base in range(rows_laid, len(data.rows)):
            calls = self._unfolded_calls(data.rows[base])
            if calls:
                self._set_calls(base, calls)
        shown = self._fold_before[start - 1] + len(self._fold_calls[start - 1]) if start else 0
        for k in range(start, len(self._fold_base)):
            self._fold_before[k] = shown
            self._fold_disp[k] = self._fold_base[k] + shown
            shown += len(self._fold_calls[k])
        self._calls_shown = shown
        self._laid = now
        return True

    def _laid_parents(self, op_seq: int | None, node_id: int | None, limit: int) -> list[int]:
        """Row indices below ``limit`` of the op ``op_seq``, or of every run of node
        ``node_id``: the rows an aten call of theirs can be shown under."""
        data = self.data
        assert data is not None
        if op_seq is not None:
            recs: tuple = (data.op_by_seq.get(op_seq),)
        elif node_id is not None:
            recs = data.node_grads.get(node_id, ())
        else:
            recs = ()
        found = (data.row_index(t[SEQ]) for t in recs if t is not None)
        return [i for i in found if i is not None and i < limit]

    def _unfolded_calls(self, t: Rec) -> tuple[Rec, ...]:
        """The calls of row ``t`` with every row unfolded (none: folded by hand)."""
        assert self.data is not None
        return () if (t[KIND], t[SEQ]) in self._toggled else self.data.aten_of(t)

    def _set_calls(self, base: int, calls: tuple[Rec, ...]) -> int:
        """Show ``calls`` under row ``base`` (none: no entry); the entry's index. Display
        indices from there on are left to the caller."""
        k = bisect.bisect_left(self._fold_base, base)
        present = k < len(self._fold_base) and self._fold_base[k] == base
        if present and calls:
            self._fold_calls[k] = calls
        elif present:
            for lst in (self._fold_base, self._fold_disp, self._fold_before, self._fold_calls):
                del lst[k]
        elif calls:
            self._fold_base.insert(k, base)
            self._fold_disp.insert(k, 0)
            self._fold_before.insert(k, 0)
            self._fold_calls.insert(k, calls)
        return k

    def _unfolded_keys(self) -> Iterable[tuple[str, int]]:
        """(kind, seq) of the rows to unfold (some may not be shown, or have no calls)."""
        if not self.unfold_all:
            return self._toggled
        assert self.data is not None
        keys = ((t[KIND], t[SEQ]) for t in self.data.aten_parents())
        return [key for key in keys if key not in self._toggled]

    def _locate(self, index: int) -> tuple[int, int, int]:
        """Display ``index`` -> (base index of its row, which call of it or -1, which
        unfolded row it is at or after, -1: before all)."""
        k = bisect.bisect_right(self._fold_disp, index) - 1
        if k < 0:
            return index, -1, k
        at, n = self._fold_disp[k], len(self._fold_calls[k])
        if index == at:
            return self._fold_base[k], -1, k
        if index <= at + n:
            return self._fold_base[k], index - at - 1, k
        return index - self._fold_before[k] - n, -1, k

    def _disp_of_base(self, base: int) -> int:
        k = bisect.bisect_left(self._fold_base, base)  # unfolded rows before it
        if k == 0:
            return base
        return base + self._fold_before[k - 1] + len(self._fold_calls[k - 1])

    def has_calls(self, row: Row | PendingRow | None) -> TypeGuard[Row]:
        """Whether ``row`` is an op or node with aten calls (it can unfold)."""
        data = self.data
        if row is None or data is None or not data.aten or row.pending or row.kind == ATEN:
            return False
        return bool(data.aten_of(row))

    def is_unfolded(self, row: Row | PendingRow | None) -> TypeGuard[Row]:
        if row is None or not self.has_calls(row):
            return False
        return ((row.kind, row.seq) in self._toggled) != self.unfold_all

    def set_unfolded(self, row: Row, on: bool) -> None:
        """Unfold ``row`` into its aten calls (on) or fold them away; the cursor stays on it."""
        if on == self.is_unfolded(row):
            return
        self._toggled ^= {(row.kind, row.seq)}  # against unfold_all, so this flips the row
        self._refold()
        index = self._index_of_row(row)
        if index is not None:
            self.move_cursor(index)
            if on:  # show its calls, as far as they fit under it
                last = index + len(self.data.aten_of(row)) if self.data is not None else index
                top = round(self.scroll_y)
                if last >= top + self.page_height:
                    self.scroll_to(
                        y=min(index, last - self.page_height + 1), animate=False, immediate=True
                    )

    def set_unfold_all(self, on: bool) -> None:
        """Unfold every row's aten calls (on), now and as rows come, or fold them all; the
        cursor stays on its row (on a call that folds away: on the call's op or node)."""
        if on == self.unfold_all:
            return
        keep = self.current_row()
        self.unfold_all = on
        self._toggled.clear()
        self._refold()
        if self.follow:
            self._follow_end()
            return
        index = self._index_of_row(keep)
        if index is None and isinstance(keep, AtenRow):
            index = self._index_of_row(keep.parent)
        if index is not None:
            self.move_cursor(index, center=True)

    def _refold(self) -> None:
        """Show the calls of the rows unfolded now."""
        self._laid = None  # which rows are unfolded changed: all of them are laid out again
        self._relayout()
        self._remeasure(force=True)
        self.refresh_rows()

    def action_unfold(self) -> None:
        """``→``/``l``: unfold the row into its aten calls (unfolded: to its first call)."""
        row = self.current_row()
        if not self.has_calls(row):
            return
        self._user_moved()
        if self.is_unfolded(row):
            self.move_cursor(self.cursor + 1, user=True)
        else:
            self.set_unfolded(row, True)

    def action_fold(self) -> None:
        """``←``/``h``: fold the row's aten calls; on a call, back to its row."""
        row = self.current_row()
        if row is None:
            return
        if isinstance(row, AtenRow):
            self._user_moved()
            index = self._index_of_row(row.parent)
            if index is not None:
                self.move_cursor(index, user=True)
        elif self.is_unfolded(row):
            self._user_moved()
            self.set_unfolded(row, False)

    def current_row(self) -> Row | PendingRow | None:
        return self.row(self.cursor) if self.cursor >= 0 else None

    def _index_of_row(self, row: Row | PendingRow | None) -> int | None:
        if row is None:
            return None
        if row.pending:
            return self.row_count() - 1 if row is self.pending else None
        return self.index_of(row.kind, row.seq)

    def index_of(self, kind: str | None, seq: int) -> int | None:
        """Row index of the event ``seq`` (of ``kind``, when given), or None if not shown
        (an aten call: shown when its row is unfolded)."""
        data = self.data
        if data is None:
            return None
        if kind == ATEN or (kind is None and seq in data.aten):
            return self._call_index(seq)
        base = self._base_index_of(kind, seq)
        if base is None or not self._fold_base:
            return base
        return self._disp_of_base(base)

    def _call_index(self, seq: int) -> int | None:
        data = self.data
        if data is None:
            return None
        t = data.aten.get(seq)
        parent = data.aten_parent(t) if t is not None else None
        if parent is None:
            return None
        base = self._base_index_of(parent[KIND], parent[SEQ])
        k = bisect.bisect_left(self._fold_base, base) if base is not None else 0
        if base is None or k >= len(self._fold_base) or self._fold_base[k] != base:
            return None
        for j, call in enumerate(self._fold_calls[k]):
            if call[SEQ] == seq:
                return self._fold_disp[k] + 1 + j
        return None

    def _base_index_of(self, kind: str | None, seq: int) -> int | None:
        """Index of the op or node row ``seq`` among the rows shown, calls left out."""
        data = self.data
        if data is None:
            return None
        i = data.row_index(seq)
        if i is None or (kind is not None and data.rows[i][KIND] != kind):
            return None
        if self._view is None:
            return i
        j = bisect.bisect_left(self._view, i)
        return j if j < len(self._view) and self._view[j] == i else None

    def select(self, kind: str | None, seq: int, *, center: bool = True) -> bool:
        index = self.index_of(kind, seq)
        data = self.data
        if index is None and data is not None and kind in (ATEN, None) and seq in data.aten:
            parent = data.aten_parent(data.aten[seq])  # an aten call: unfold its row
            if parent is not None and self._base_index_of(parent[KIND], parent[SEQ]) is not None:
                self.set_unfolded(data.view(parent), True)
                index = self.index_of(ATEN, seq)
        if index is None:
            return False
        self.move_cursor(index, center=center)
        return True

    def empty_text(self) -> str:
        if self.data is not None and self.pattern is not None:
            return f"no events match /{self.pattern.pattern}/"
        return self.message

    # -- user moves turn follow off ----------------------------------------------------------
    def _user_moved(self) -> None:
        if self.follow:
            self.follow = False
            self.post_message(self.FollowChanged(False))

    def action_cursor_up(self) -> None:
        self._user_moved()
        super().action_cursor_up()

    def action_cursor_down(self) -> None:
        if self.cursor < self.row_count() - 1:
            self._user_moved()
        super().action_cursor_down()

    def action_page_up(self) -> None:
        self._user_moved()
        super().action_page_up()

    def action_page_down(self) -> None:
        self._user_moved()
        super().action_page_down()

    def action_first(self) -> None:
        self._user_moved()
        super().action_first()

    def action_last(self) -> None:
        super().action_last()
        if self.live and not self.follow:
            self.follow = True
            self.post_message(self.FollowChanged(True))

    async def _on_click(self, event: Click) -> None:
        self._user_moved()
        await super()._on_click(event)

    def on_mouse_scroll_up(self, event: MouseScrollUp) -> None:
        self._user_moved()

    # -- rendering ---------------------------------------------------------------------------
    def columns(self, width: int) -> Columns:
        key = (width, self._natural_key)
        if self._columns is None or self._columns[0] != key:
            self._columns = (key, Columns(width, self.natural))
        return self._columns[1]

    def render_header(self, width: int) -> list[Cell]:
        c = self.columns(width)
        parts = [rfit("seq", c.seq), fit("", c.dir - 1), fit("name", c.name)]
        for label, w in (
            (c.module_header(), c.module),
            (c.HEADERS["flow"], c.flow),
            ("shapes", c.shapes),
        ):
            if w:
                parts.append(fit(label, w))
        parts.append(fit("stat", c.stat))
        if c.flags:
            parts.append(fit("flags", c.flags))
        if c.source:
            parts.append(fit("source", c.source))
        return [(" ".join(parts), None)]

    # -- widths from the content -------------------------------------------------------------
    def measure(self) -> None:
        """Size the columns from a sample of the step's rows (the first ones, the ones in
        view, and an even spread of the rest: a 100k-row step costs a few hundred)."""
        data = self.data
        count = self._base_count()
        if data is None or (count == 0 and self.pending is None):
            self.natural = {}
            self._natural_key += 1
            self._columns = None
            return
        top = max(0, round(self.scroll_y))
        picks = set(range(min(count, 200)))
        picks.update(range(top, min(count, top + 100)))
        stride = max(1, count // 200)
        picks.update(range(0, count, stride))
        nat = {"name": 4, "module": 6, "flow": 0, "shapes": 6, "stat": 4, "flags": 0}
        nat["source"] = 6
        last_seq = 0
        rows: list[Row | PendingRow] = []
        for index in picks:
            row = self._base_row(index) if index < self._base_count() else self.row(index)
            if row is not None:
                rows.append(row)
        if self.pending is not None:  # the paused event: its name in full
            rows.append(self.pending)
        for k, calls in enumerate(self._fold_calls[:50]):  # the calls shown (some of them)
            parent = self._base_row(self._fold_base[k])
            if parent is not None:
                rows.extend(AtenRow(t, parent) for t in calls[:50])
        for row in rows:
            shapes, stat, tag, flow = self._row_cells(row)
            name = self._name_text(row, tag)
            flags, _ = self._flags(row)
            last_seq = max(last_seq, row.seq)
            for col, text in (
                ("name", name),
                ("module", row.param or row.module or "-"),
                ("flow", flow),
                ("shapes", shapes),
                ("stat", stat),
                ("flags", flags),
                ("source", source_cell(row.source)),
            ):
                if len(text) > nat[col]:
                    nat[col] = len(text)
        if data.rows and type(data.rows[-1][SEQ]) is int:
            last_seq = max(last_seq, data.rows[-1][SEQ])
        nat["seq"] = max(4, len(str(last_seq)))
        if nat != self.natural:
            self.natural = nat
            self._natural_key += 1
            self._columns = None
            self._cache.clear()

    @staticmethod
    def _name_text(row: Row | PendingRow, tag: str = "") -> str:
        """The name column's text; its ``tag`` (``[recompute]``, ``[compiled]``) after it."""
        if row.kind == OP:
            name = short_name(row.name)
        elif isinstance(row, AtenRow):  # indented under its op or node
            name = ("  Σ " if row.accumulate else "  ") + row.name
        elif row.kind == ATEN:  # a paused call whose op or node has no row yet: indented too
            name = "  " + row.name
        else:
            name = row.name
        return f"{name} {tag}" if tag else name

    def _row_cells(self, row: Row | PendingRow) -> tuple[str, str, str, str]:
        """(shapes, stat, tag, flow) of a row: what it made, its tag (see event_tag) and,
        for a backward node, its gradient flow (see flow_text; "" for anything else)."""
        if isinstance(row, PendingRow):
            ev = row.event
            tag = event_tag(ev)
            flow = ""
            if row.kind == GRAD:
                flow = flow_text(ev.get("grad_outputs"), ev.get("grad_inputs"))
            sums = ev.get("grad_inputs") if row.kind == GRAD else ev.get("outputs")
            if sums is None:  # paused before it runs: what it gets, and that it has not run
                sums = ev.get("grad_outputs") if row.kind == GRAD else ev.get("inputs")
                return shapes_text(sums), "not run yet", tag, flow
            stat = " ".join(stat_text(s, self.stat_mode) for s in sums[:2])
            return shapes_text(sums), stat, tag, flow
        key = (row.seq, self.stat_mode)
        cells = self._cells.get(key)
        if cells is not None:
            return cells
        ev = self.store.event(row) if self.store is not None else {}
        sums = ev.get("grad_outputs") if row.kind == GRAD else ev.get("outputs")
        shapes = shapes_text(sums)
        if isinstance(sums, list) and sums:
            stat = " ".join(stat_text(s, self.stat_mode) for s in sums[:2])
            if len(sums) > 2:
                stat += " …"
        else:
            stat = "-"
        flow = ""
        if row.kind == GRAD:
            flow = flow_text(sums, ev.get("grad_inputs"))
        cells = (shapes, stat, event_tag(ev), flow)
        self._cells[key] = cells
        if len(self._cells) > 4096:
            self._cells.popitem(last=False)
        return cells

    def render_row(self, index: int, width: int) -> list[Cell]:
        row = self.row(index)
        if row is None:
            return []
        c = self.columns(width)
        shapes, stat, tag, flow = self._row_cells(row)
        call = isinstance(row, AtenRow)
        # an aten call is styled as its op's or node's row (a pending one: by its node, if any)
        if isinstance(row, AtenRow):
            is_op = row.parent.kind == OP
        elif isinstance(row, PendingRow):
            is_op = row.kind == OP or (row.kind == ATEN and not row.event.get("node"))
        else:
            is_op = row.kind == OP
        name = self._name_text(row)
        module = row.param or row.module or "-"
        flags, flag_style = self._flags(row)
        name_style = None if is_op else self.cstyle("bwd")
        if not call and self._kept_for_calls(row):
            name_style = self.cstyle("dim")
        paused = row.pending or (
            self.paused_key is not None and self.paused_key == (row.kind, row.seq)
        )
        if call:
            glyph = glyphs.pause() if paused else ""
        else:
            glyph = glyphs.pause() if paused else ("▸" if is_op else "◂")
            if self.has_calls(row):  # aten calls: "+" folded, "-" unfolded
                glyph += "-" if self.is_unfolded(row) else "+"
        seq = "next" if row.pending and row.seq < 0 else str(row.seq)
        cells: list[Cell] = [
            (rfit(seq, c.seq) + " ", self.cstyle("seq")),
            (fit(glyph, c.dir), self.cstyle("dim") if is_op and not paused else name_style),
            *self._name_cells(name, tag, c.name, name_style),
        ]
        if c.module:
            cells.append((fit(short_path(module, c.module), c.module) + " ", self.cstyle("module")))
        if c.flow:
            cells.append((fit_flow(flow, c.flow) + " ", name_style if flow else None))
        if c.shapes:
            cells.append((fit(shapes, c.shapes) + " ", None))
        stat_style = self.cstyle("error") if row.flags & 12 else None
        cells.append((fit(fit_numbers(stat, c.stat), c.stat) + " ", stat_style))
        if c.flags:
            cells.append((fit(fit_numbers(flags, c.flags), c.flags) + " ", flag_style))
        if c.source:
            source = source_cell(row.source)
            if len(source) > c.source:  # keep the line number: cut the file's name instead
                source = "…" + source[-(c.source - 1) :] if c.source > 1 else "…"
            cells.append((fit(source, c.source), self.cstyle("source")))
        if paused:
            mark = self.cstyle("paused")
            cells = [(text, mark if style is None else style + mark) for text, style in cells]
        return cells

    def _name_cells(self, name: str, tag: str, width: int, style: Style | None) -> list[Cell]:
        """The name column (``width`` and its separating space): the name, then the tag
        dimmed. A name too long is cut before the tag, so the tag stays in sight; a column
        too narrow for both keeps the name."""
        if not tag or width < len(tag) + 6:
            return [(fit(name, width) + " ", style)]
        dim = self.cstyle("dim")
        room = width - len(tag) - 1
        if len(name) <= room:  # the tag right after the name
            return [(name + " ", style), (fit(tag, width - len(name) - 1) + " ", dim)]
        return [(fit(name, room) + " ", style), (tag + " ", dim)]

    def _kept_for_calls(self, row: Row | PendingRow) -> bool:
        """A row the filter keeps only for the aten calls under it that it matches."""
        data, pattern = self.data, self.pattern
        if pattern is None or data is None or isinstance(row, PendingRow) or self._hits is None:
            return False
        return row.seq in self._hits.by_row and not pattern.search(data.haystack(row.t))

    def _flags(self, row: Row | PendingRow) -> tuple[str, Style | None]:
        f = row.flags
        parts = []
        style = None
        if f & (FLAG_NAN_OUT | FLAG_INF_OUT):
            if f & FLAG_NAN_OUT:
                parts.append("NaN")
            if f & FLAG_INF_OUT:
                parts.append("Inf")
            style = self.cstyle("error")
        elif f & (FLAG_NAN_IN | FLAG_INF_IN):
            parts.append("(nan)" if f & FLAG_NAN_IN else "(inf)")
            style = self.cstyle("dim")
        if self.data is not None and not row.pending and row.seq in self.data.alert_seqs:
            parts.insert(0, "⚠")
            style = self.cstyle("warning") if style is None else style
        if self.data is not None and not row.pending and row.seq in self.data.edit_seqs:
            parts.insert(0, "✎")  # its tensor was changed by hand
            style = self.cstyle("warning") if style is None else style
        return " ".join(parts), style


def _prefilter(pattern: Any) -> Callable[[str], Any]:
    """A fast first check over a row's fields as lines: ``FieldPattern.prefilter`` (one C call,
    true wherever a field may match), or nothing to skip for a plain pattern."""
    first = getattr(pattern, "prefilter", None)
    return first if first is not None else _always


def _always(text: str) -> bool:
    return True
