"""The UI's model of a trace: events indexed by step, with bounded memory.

No textual imports here (and no torch): sources fill an
:class:`~torchscope.session.inbox.Inbox` from a worker thread, and the app drains it on a
timer and applies it to an :class:`EventStore` on the UI thread.

Op, node and aten call events are kept as compact records (see :mod:`.rows`). Aten calls are
kept per step under their op or node (not timeline rows), counted like rows. Whole steps are
evicted, least recently used first, when more than ``max_events`` rows are resident; the newest
step and pinned (viewed) steps are never evicted. An evicted step keeps its counts and can be
loaded again when the source can reload it (a trace file, or a live session that records).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol import codec
from torchscope.protocol.events import (
    ALERT,
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
from torchscope.session.checks import is_check
from torchscope.session.history_index import HistoryIndex
from torchscope.session.items import (
    Answer,
    Counts,
    ErrorMessage,
    Events,
    HistoryBatch,
    InboxItem,
    NewSession,
    Overview,
    Progress,
    ProgressDone,
    Refused,
    Reply,
    Status,
    StepAbort,
    StepIndex,
    StepPart,
    Unavailable,
    WholeStep,
)
from torchscope.session.rows import KIND, RAW, SEQ, STEP_, Rec, Row, prepare, step_of
from torchscope.session.stepper_view import StepperView
from torchscope.session.steps import (
    EVICTED,
    LOADING,
    LOSS_KNOWN,
    ON_DISK,
    RESIDENT,
    StepData,
    StepInfo,
)

__all__ = ["Changes", "EventStore"]


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
    # step-through: the paused point changed (or ended); the breakpoint list changed; the
    # answers to commands, in the order they came.
    paused_changed: bool = False
    breakpoints_changed: bool = False
    replies: list[Answer] = field(default_factory=list)
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
        self.order_version = 0  # bumped when a step joins or leaves ``order``
        self._data: OrderedDict[int, StepData] = OrderedDict()  # LRU: oldest use first
        self.alerts: list[Event] = []
        self._alert_seqs: set[Any] = set()  # as the alerts carry them (maybe no int)
        # eager checks among the alerts, by step (a check is not a NaN/Inf alert)
        self.checks: dict[int, int] = {}
        self.errors: list[Event] = []
        self.edits: list[Event] = []  # tensors changed by hand (edit events): the run's numbers
        self._edit_seqs: set[Any] = set()
        self.session: Event | None = None
        self.ended = False  # a live job said it ended
        self.has_aten = False  # aten calls came (a recording or job at the aten level)
        self.complete = True  # a replay's file says it is complete (status "complete")
        # Steps dropped as an empty tail: a file's step index, sent again with a later load,
        # must not bring one back (its counts are final by then, so it would stay for good).
        self._dropped: set[int] = set()
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

    # -- pinning -----------------------------------------------------------------------------
    def pin(self, steps: Iterable[int]) -> None:
        """Steps being shown: never evicted."""
        self.pinned = set(steps)

    # -- applying ----------------------------------------------------------------------------
    def apply(self, items: Iterable[InboxItem]) -> Changes:
        """Apply drained inbox items (see :mod:`.items`). Returns what changed."""
        ch = Changes()
        for item in items:
            match item:
                case Events(items=events):
                    self._ingest(events, ch)
                case WholeStep(step=step, items=events):
                    self._replace_step(step, events, ch)
                case StepPart(step, events, first, last, done, total):
                    self._step_part(step, events, first, last, done, total, ch)
                case StepAbort(step=step):
                    self._step_abort(step, ch)
                case StepIndex(entries=entries):
                    self._index(entries, ch)
                case Counts(counts=counts, final=final, losses=losses):
                    self._counts(counts, final, ch, losses)
                case Overview(grads=grads, losses=losses):
                    self._overview(grads, losses, ch)
                case HistoryBatch(wire=wire):  # a source's history batch (a file's count pass)
                    self._take_history(wire, ch)
                case Status(values=values):
                    self._status(values, ch)
                case Reply(token=token, cmd=cmd, fields=fields, result=result):
                    if isinstance(result, dict):
                        paused, bps = self.stepper.on_state(result.get("state"))
                        ch.paused_changed |= paused
                        ch.breakpoints_changed |= bps
                        if cmd == HISTORY:  # the whole history, asked for on attach
                            self._take_history(result, ch)
                    ch.replies.append(Answer("reply", token, cmd, fields, result))
                case Refused(token=token, cmd=cmd, fields=fields, message=message):
                    ch.replies.append(Answer("refused", token, cmd, fields, message))
                case Progress(done=done, total=total, label=label):
                    ch.progress = (done, total, label)
                case ProgressDone():
                    ch.progress = None
                    ch.progress_done = True
                case ErrorMessage(message=message):
                    ch.errors.append(message)
                case Unavailable(step=step, message=message):
                    info = self.steps.get(step)
                    if info is not None and info.state == LOADING:
                        info.state = EVICTED
                        ch.steps_changed.add(step)
                    ch.errors.append(message)
                case NewSession():
                    pass  # the app starts a fresh store there; this one has nothing to do
                case _:
                    raise TypeError(f"not an inbox item: {item!r}")
        # After every batch, not only those that changed a step: what completes the verdict
        # (the last counts, the file's "complete" status, the load ending) comes in any order.
        self._drop_empty_tail(ch)
        self._evict(ch)
        return ch

    def _status(self, values: dict[str, Any], ch: Changes) -> None:
        ch.status.update(values)
        if "complete" in values:
            self.complete = bool(values["complete"]) or bool(values.get("truncated"))
        state = values.get("state")
        if state in ("ended", "disconnected", "unreachable"):
            ch.paused_changed |= self.stepper.clear()
        if state == "ended":  # the job is gone, and its breakpoints with it
            ch.breakpoints_changed |= self.stepper.forget()
            self.ended = True

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
        self.order_version += 1
        del self.steps[step]
        self._dropped.add(step)
        data = self._data.pop(step, None)
        if data is not None:
            self.resident_events -= _resident_rows(data)
        ch.removed.add(step)
        ch.steps_changed.discard(step)
        ch.events_changed.discard(step)
        ch.loaded.discard(step)

    def ingest(self, events: Iterable[dict]) -> Changes:
        """Prepare and apply events in one go (tests, and callers on the UI thread)."""
        return self.apply([Events(prepare(events))])

    def _info(self, step: int, ch: Changes) -> StepInfo:
        info = self.steps.get(step)
        if info is None:
            info = self.steps[step] = StepInfo(step)
            if not self.order or step > self.order[-1]:
                self.order.append(step)
            else:
                bisect.insort(self.order, step)
            self.order_version += 1
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
            if isinstance(item, tuple):
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
                step = step_of(item)
            if step != cur_step or info is None:
                if cur_step is not None:
                    ch.steps_changed.add(cur_step)
                    if data is not None:
                        ch.events_changed.add(cur_step)
                cur_step = step
                info = self._info(step, ch)
                data = self._stepdata(step, info)
            applied += 1
            if isinstance(item, tuple):
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
        seq = item[SEQ] if isinstance(item, tuple) else item.get("seq")
        if type(seq) is int:
            if info.first_seq is None or seq < info.first_seq:
                info.first_seq = seq
            if info.last_seq is None or seq > info.last_seq:
                info.last_seq = seq
        if isinstance(item, tuple):
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
            step = step_of(ev)
            self.checks[step] = self.checks.get(step, 0) + 1
        if self.alerts and _alert_key(self.alerts[-1]) > _alert_key(ev):
            bisect.insort(self.alerts, ev, key=_alert_key)
        else:
            self.alerts.append(ev)
        ch.alerts_added += 1

    @staticmethod
    def _place(data: StepData, item: Rec | Event) -> None:
        if isinstance(item, tuple):
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
            if not isinstance(item, tuple) and item.get("kind") == SESSION:
                if self.session is None:
                    self.session = item
                    ch.session = True
                continue
            if not isinstance(item, tuple) and item.get("kind") == HISTORY:
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
            if info is None and step not in self._dropped:
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
    seq = ev.get("seq")
    return (step_of(ev), seq if type(seq) is int else 0)


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
