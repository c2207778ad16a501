"""Per-step counts of a trace file, computed in a child process.

A replay lists steps from the file's chunk index at once, but how many ops, nodes and alerts
each step has is only known by decoding every chunk: seconds to minutes for a large file. Done
on a thread, each chunk's decode holds the GIL for tens of milliseconds and the UI stutters;
done here, in its own process, it also runs on another core.

    python -m torchscope.session.countpass FILE

(what :class:`~torchscope.tui.sources.file.FileSource` runs) writes length-prefixed msgpack
records to stdout::

    {"history": [a history event]}
    {"counts": {step: [ops, grads, graph_nodes, alerts, events, grad_sq, grad_norms, aten]},
     "loss": {step: [value, rank]}, "alerts": [alert events],
     "final": [steps whose counts are complete], "done": chunks_done, "total": chunks}
    {"error": "one line"}

Counts are what the chunks decoded since the previous record added (the reader sums them);
``grad_sq`` is the sum of the squared norms of the gradients AccumulateGrad nodes received
(``grad_norms`` of them): the step's global gradient norm is its square root; ``aten`` counts
its aten calls (the aten level). ``loss`` is the
step's loss as known so far (it replaces the previous one): a ``loss`` field an event carries
(rank 3), else the one-value output of the op whose backward node ran first in the step, the
root of its backward (rank 2), else the one-value output of the step's last op before any
backward (rank 1). A ``history`` record carries one of the file's ``history`` events (the run's
loss and gradient norms), which only a decoded chunk shows: it comes ahead of the counts of the
chunk that held it.

:class:`LiveOverview` runs the same :class:`Counter` over a live session's events.

Imports neither torch nor textual.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any, Protocol

from torchscope.protocol import codec
from torchscope.protocol.events import ALERT, ATEN, GRAD, GRAPH, HISTORY, OP, SESSION, Event
from torchscope.protocol.tracefile import ChunkInfo, TraceFileError, TraceReader
from torchscope.session.inbox import Inbox
from torchscope.session.items import Overview
from torchscope.session.module_norms import grad_norm_of
from torchscope.session.rows import NO_STEP, step_of

_LEN = struct.Struct("<I")
_BIG = 2**63


def scalar_of(summaries: Any) -> float | None:
    """The value of a one-value tensor, when ``summaries`` is exactly one such summary."""
    if type(summaries) is not list or len(summaries) != 1:
        return None
    s = summaries[0]
    if type(s) is not dict:
        return None
    shape = s.get("shape")
    if type(shape) is not list or any(d != 1 for d in shape):
        return None
    values = s.get("values")
    if type(values) is list and len(values) == 1 and _is_num(values[0]):
        return float(values[0])
    stats = s.get("stats")
    if type(stats) is dict and _is_num(stats.get("mean")):
        return float(stats["mean"])
    return None


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Chunks(Protocol):
    """What the count pass reads: a :class:`TraceReader`, or a reader wrapping one."""

    @property
    def chunks(self) -> Sequence[ChunkInfo]: ...

    def read_chunk(self, i: int) -> list[Event]: ...


class _Loss:
    """What is known of one step's loss (see the module doc)."""

    __slots__ = ("backward", "rank", "scalars", "value")

    def __init__(self) -> None:
        self.rank = 0
        self.value: float | None = None
        self.backward = False  # a backward node of this step ran
        self.scalars: dict[int, float] = {}  # one-value op outputs before the backward, by seq


class Counter:
    """Counts by step: ``[ops, grads, graph_nodes, alerts, events, grad_sq, grad_norms, aten]``, the
    alert events and the steps' losses (see the module doc)."""

    def __init__(self) -> None:
        self.counts: dict[int, list] = {}
        self.alerts: list[dict] = []
        self.losses: dict[int, _Loss] = {}
        self.loss_changed: set[int] = set()

    def _loss(self, step: int, value: float, rank: int) -> None:
        state = self.losses.get(step)
        if state is None:
            state = self.losses[step] = _Loss()
        if rank >= state.rank and (rank, value) != (state.rank, state.value):
            state.rank, state.value = rank, value
            self.loss_changed.add(step)

    def add(self, events: Iterable[dict]) -> None:
        losses = self.losses
        for ev in events:
            kind = ev.get("kind")
            if kind == SESSION:
                continue
            step = step_of(ev)
            c = self.counts.get(step)
            if c is None:
                c = self.counts[step] = [0, 0, 0, 0, 0, 0.0, 0, 0]
            c[4] += 1
            hint = ev.get("loss")
            if hint is not None and _is_num(hint):
                self._loss(step, float(hint), 3)
            if kind == OP:
                c[0] += 1
                state = losses.get(step)
                if state is None:
                    state = losses[step] = _Loss()
                if not state.backward:
                    value = scalar_of(ev.get("outputs"))
                    if value is not None:
                        seq = ev.get("seq")
                        if type(seq) is int:
                            state.scalars[seq] = value
                            if len(state.scalars) > 64:
                                del state.scalars[next(iter(state.scalars))]
                        if state.rank <= 1:
                            self._loss(step, value, 1)
            elif kind == GRAD:
                c[1] += 1
                norm = grad_norm_of(ev)
                if norm is not None:
                    c[5] += norm * norm
                    c[6] += 1
                state = losses.get(step)
                if state is None:
                    state = losses[step] = _Loss()
                if not state.backward:
                    state.backward = True
                    op_seq = ev.get("op_seq")
                    root = state.scalars.get(op_seq) if type(op_seq) is int else None
                    if root is not None:
                        self._loss(step, root, 2)
                    state.scalars = {}
            elif kind == ATEN:
                c[7] += 1
            elif kind == GRAPH:
                nodes = ev.get("nodes")
                c[2] += len(nodes) if isinstance(nodes, list) else 0
            elif kind == ALERT:
                c[3] += 1
                self.alerts.append(dict(ev))

    def take(self) -> tuple[dict[int, list], list[dict]]:
        out = self.counts, self.alerts
        self.counts, self.alerts = {}, []
        return out

    def take_losses(self) -> dict[int, list]:
        """Losses that changed since the last call: ``{step: [value, rank]}``."""
        out = {}
        for step in self.loss_changed:
            state = self.losses[step]
            out[step] = [state.value, state.rank]
        self.loss_changed = set()
        return out

    def forget(self, steps: Iterable[int]) -> None:
        """Drop the loss state of steps whose counts are complete."""
        for step in steps:
            self.losses.pop(step, None)


def passes(
    reader: Chunks, every: float = 0.1, *, each_chunk: bool = False
) -> Iterator[dict[str, Any] | None]:
    """Decode every chunk; yield a record (see the module doc) at most every ``every`` s.
    With ``each_chunk``, also yield None after every other chunk, so a caller on a thread can
    do other work between chunks."""
    chunks = reader.chunks
    suffix_min = [_BIG] * (len(chunks) + 1)
    for i in range(len(chunks) - 1, -1, -1):
        first = chunks[i].first_step
        suffix_min[i] = min(first if first != NO_STEP else _BIG, suffix_min[i + 1])
    counter = Counter()
    seen: set[int] = set()
    finalized: set[int] = set()
    last = time.monotonic()
    for i in range(len(chunks)):
        counter.add(reader.read_chunk(i))
        seen.update(counter.counts)
        done = i + 1
        now = time.monotonic()
        if now - last >= every or done == len(chunks):
            last = now
            bound = suffix_min[done] if done < len(chunks) else _BIG
            final = sorted(s for s in seen if s < bound and s not in finalized)
            finalized.update(final)
            counts, alerts = counter.take()
            losses = counter.take_losses()
            counter.forget(final)
            yield {
                "counts": counts,
                "loss": losses,
                "alerts": alerts,
                "final": final,
                "done": done,
                "total": len(chunks),
            }
        elif each_chunk:
            yield None
    if not chunks:
        yield {"counts": {}, "loss": {}, "alerts": [], "final": [], "done": 0, "total": 0}


def write_record(out: IO[bytes], record: dict[str, Any]) -> None:
    data = codec.pack(record)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def read_records(stream: IO[bytes]) -> Iterator[dict[str, Any]]:
    """Records written by :func:`write_record`, until the stream ends."""
    while True:
        head = stream.read(_LEN.size)
        if len(head) < _LEN.size:
            return
        (n,) = _LEN.unpack(head)
        data = stream.read(n)
        if len(data) < n:
            return
        record = codec.unpack(data)
        if isinstance(record, dict):
            yield record


class _HistoryTap:
    """The reader the count pass decodes through: it keeps the ``history`` events of the
    chunks decoded, to go out with the next record (a few per chunk at most: the agent sends
    one per batch of steps or per second)."""

    def __init__(self, reader: TraceReader) -> None:
        self._reader = reader
        self.chunks = reader.chunks
        self._found: list[dict[str, Any]] = []

    def read_chunk(self, i: int) -> list[Event]:
        events = self._reader.read_chunk(i)
        self._found.extend(dict(e) for e in events if e.get("kind") == HISTORY)
        return events

    def take(self, record: dict[str, Any]) -> None:
        """Move the events found into ``record["history"]``; they leave its counts: a step
        (or the stepless -1) that only a ``history`` event names is no recorded step."""
        found, self._found = self._found, []
        record["history"] = found
        counts = record.get("counts")
        if not found or not isinstance(counts, dict):
            return
        for event in found:
            c = counts.get(step_of(event))
            if isinstance(c, list) and len(c) > 4:
                c[4] -= 1  # the "events" count (see countpass)
        for step in [s for s, c in counts.items() if isinstance(c, list) and not any(c)]:
            del counts[step]


def count_passes(
    reader: TraceReader, *, each_chunk: bool = False
) -> Iterator[dict[str, Any] | None]:
    """:func:`passes`, each record with ``history``: the ``history`` events of the
    chunks decoded since the previous record, in file order."""
    tap = _HistoryTap(reader)
    for record in passes(tap, each_chunk=each_chunk):
        if record is not None:
            tap.take(record)
        yield record


def main(argv: list[str] | None = None) -> int:
    """The counting child (``FileSource``'s ``"process"`` pass): the records on stdout, each
    ``history`` event in a record of its own ahead of its counts (one event is within the
    codec's limit; the first of a ``record PID`` file holds the whole run so far)."""
    args = sys.argv[1:] if argv is None else argv
    out = sys.stdout.buffer
    if len(args) != 1:
        write_record(out, {"error": "usage: python -m torchscope.session.countpass FILE"})
        return 2
    try:
        with TraceReader(args[0]) as reader:
            for record in count_passes(reader):
                if record is None:
                    continue
                for event in record.pop("history"):
                    write_record(out, {"history": [event]})
                write_record(out, record)
    except BrokenPipeError:  # the UI went away
        return 0
    except (TraceFileError, OSError) as exc:
        write_record(out, {"error": str(exc)})
        return 2
    return 0


class LiveOverview:
    """The Steps panel's loss and global gradient norm for events as they stream in (a live
    session, the demo): the same :class:`Counter` the count pass runs over a
    recording, fed on the source's thread. ``feed`` gives the store's :class:`Overview` item."""

    def __init__(self) -> None:
        self.counter = Counter()

    def feed(self, events: Iterable[Any]) -> Overview | None:
        counter = self.counter
        counter.add(e for e in events if isinstance(e, dict))
        counts, _ = counter.take()
        grads = {s: (c[5], c[6]) for s, c in counts.items() if c[6]}
        losses = {s: (v[0], v[1]) for s, v in counter.take_losses().items()}
        if counts:  # the loss of a step is settled once a later one runs: forget it
            newest = max(counts)
            counter.forget([s for s in counter.losses if s < newest - 1])
        if not grads and not losses:
            return None
        return Overview(grads, losses)

    def put(self, inbox: Inbox, events: Iterable[Any]) -> None:
        item = self.feed(events)
        if item is not None:
            inbox.put(item)


if __name__ == "__main__":
    sys.exit(main())
