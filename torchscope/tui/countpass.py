"""Per-step counts of a trace file, computed in a child process.

A replay lists steps from the file's chunk index at once, but how many ops, nodes and alerts
each step has is only known by decoding every chunk: seconds to minutes for a large file. Done
on a thread, each chunk's decode holds the GIL for tens of milliseconds and the UI stutters;
done here, in its own process, it also runs on another core.

    python -m torchscope.tui.countpass FILE

writes length-prefixed msgpack records to stdout::

    {"counts": {step: [ops, grads, graph_nodes, alerts, events]}, "alerts": [alert events],
     "final": [steps whose counts are complete], "done": chunks_done, "total": chunks}
    {"error": "one line"}

Imports neither torch nor textual.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from torchscope.protocol import codec
from torchscope.protocol.events import ALERT, GRAD, GRAPH, OP, SESSION
from torchscope.protocol.tracefile import TraceFileError, TraceReader

_LEN = struct.Struct("<I")
NO_STEP = -1
_BIG = 2**63


def _step_of(ev: dict) -> int:
    step = ev.get("step")
    return step if type(step) is int else NO_STEP


class Counter:
    """Counts by step: ``[ops, grads, graph_nodes, alerts, events]`` and the alert events."""

    def __init__(self) -> None:
        self.counts: dict[int, list[int]] = {}
        self.alerts: list[dict] = []

    def add(self, events: Iterable[dict]) -> None:
        for ev in events:
            kind = ev.get("kind")
            if kind == SESSION:
                continue
            step = _step_of(ev)
            c = self.counts.get(step)
            if c is None:
                c = self.counts[step] = [0, 0, 0, 0, 0]
            c[4] += 1
            if kind == OP:
                c[0] += 1
            elif kind == GRAD:
                c[1] += 1
            elif kind == GRAPH:
                nodes = ev.get("nodes")
                c[2] += len(nodes) if isinstance(nodes, list) else 0
            elif kind == ALERT:
                c[3] += 1
                self.alerts.append(dict(ev))

    def take(self) -> tuple[dict[int, list[int]], list[dict]]:
        out = self.counts, self.alerts
        self.counts, self.alerts = {}, []
        return out


def passes(
    reader: TraceReader, every: float = 0.1, *, each_chunk: bool = False
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
            yield {
                "counts": counts,
                "alerts": alerts,
                "final": final,
                "done": done,
                "total": len(chunks),
            }
        elif each_chunk:
            yield None
    if not chunks:
        yield {"counts": {}, "alerts": [], "final": [], "done": 0, "total": 0}


def write_record(out: BinaryIO, record: dict[str, Any]) -> None:
    data = codec.pack(record)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def read_records(stream: BinaryIO) -> Iterator[dict[str, Any]]:
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = sys.stdout.buffer
    if len(args) != 1:
        write_record(out, {"error": "usage: python -m torchscope.tui.countpass FILE"})
        return 2
    try:
        with TraceReader(args[0]) as reader:
            for record in passes(reader):
                if record is not None:
                    write_record(out, record)
    except (TraceFileError, OSError) as exc:
        write_record(out, {"error": str(exc)})
        return 2
    except BrokenPipeError:  # the UI went away
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
