"""Chrome / Perfetto trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

One process per recording (its pid, named after the script and rank). Tracks:

- the training thread: each step is a slice that encloses its forward ops, one complete
  (``"ph": "X"``) slice per op with its recorded ``duration_us``;
- the autograd thread: each backward call is a slice that encloses one slice per backward
  node that ran, in the order they ran;
- alerts (NaN/Inf origins) are instant events on the track of the op or node they name;
- pauses (a breakpoint, a UI's pause or step): one slice each on a "paused" track, from the
  pause to the resume, as long as the job really stood still; the training track resumes
  after it.

Timing, honestly: a step starts at its recorded wall-clock time (relative to the first
step); ops are laid end to end from there with their measured durations, because the time
between two ops (Python, the tracer) is not recorded. Backward nodes have no recorded
duration: each gets a nominal 1 µs (``args.duration: "not recorded"``), and the forward
track waits for the backward call to end, as the training thread does. So slice order and
op durations are real; gaps are not. Times are kept in integer nanoseconds so nesting is
exact, and written in microseconds (the format's unit).

Everything streams: events are read chunk by chunk and written as they are laid out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import IO, Any

from torchscope.protocol.events import (
    ALERT,
    ATEN,
    ERROR,
    GRAD,
    OP,
    PAUSE,
    RESUME,
    SESSION,
    STAT_KEYS,
    STEP,
    Event,
)
from torchscope.protocol.jsontext import json_safe

TRAIN_TID = 1
PAUSE_TID = 999  # its own track, after any autograd threads
NODE_NS = 1_000  # nominal duration of a backward node: not recorded


def _safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    return x


def tensor_args(s: dict | None) -> Any:
    """A tensor summary as a flat map Perfetto shows in its args panel."""
    if s is None:
        return None
    out: dict[str, Any] = {
        "shape": "x".join(map(str, s["shape"])) if isinstance(s.get("shape"), list) else "?",
        "dtype": s.get("dtype"),
    }
    if s.get("param"):
        out["param"] = s["param"]
    stats = s.get("stats")
    if stats:
        for k in STAT_KEYS:
            if k in stats:
                out[k] = _safe(stats[k])
    values = s.get("values")
    if isinstance(values, list) and len(values) <= 16:
        out["values"] = [_safe(v) for v in values]
    return out


def _tensors(ev: Event, fld: str, args: dict) -> None:
    for i, s in enumerate(ev.get(fld) or ()):
        args[f"{fld}[{i}]"] = tensor_args(s)


def _us(ns: int) -> float:
    return ns / 1000


class _Layout:
    """Lays events out on the tracks and yields trace-event dicts."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t0: float | None = None  # wall clock of the first step, seconds
        self.cursor = 0  # ns: where the next slice on the training track may start
        self.step: Any = None
        self.step_start: int | None = None
        self.step_ops = 0
        self.bw: tuple | None = None  # (step, backward id) of the open backward call
        self.bw_start = 0
        self.bw_nodes = 0
        self.bw_tid: int | None = None
        self.grad_tids: dict[str, int] = {}
        # seq -> (ts ns, tid), for alerts (looked up by their event_seq, None for none)
        self.where: dict[int | None, tuple[int, int]] = {}
        self.train_thread = "MainThread"
        self.threads_named = False
        self.pause: tuple[int, Event] | None = None  # (ts ns, the pause event) until resumed
        self.paused_any = False
        # Aten calls come before their op or node's event: they wait for it, then nest in it.
        self.calls: list[Event] = []

    def _x(self, name: str, cat: str, ts: int, dur: int, tid: int, args: dict) -> dict:
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": _us(ts),
            "dur": _us(dur),
            "pid": self.pid,
            "tid": tid,
            "args": args,
        }

    def _close_backward(self) -> Iterator[dict]:
        if self.bw is None:
            return
        step, backward = self.bw
        yield self._x(
            f"backward {backward}" if backward is not None else "backward",
            "backward",
            self.bw_start,
            max(self.cursor - self.bw_start, 1),
            self.bw_tid or 2,
            {"step": step, "backward": backward, "nodes": self.bw_nodes},
        )
        self.bw = None

    def _close_step(self) -> Iterator[dict]:
        yield from self._close_backward()
        if self.step_start is None:
            return
        if self.cursor == self.step_start:  # a step that began but traced nothing
            self.step_start = None
            return
        yield self._x(
            f"step {self.step}",
            "step",
            self.step_start,
            max(self.cursor - self.step_start, 1),
            TRAIN_TID,
            {"step": self.step, "ops": self.step_ops},
        )
        self.step_start = None

    def _enter_step(self, step: Any, wall: float | None) -> Iterator[dict]:
        if step == self.step and self.step_start is not None:
            return
        yield from self._close_step()
        self.step = step
        if wall is not None:
            if self.t0 is None:
                self.t0 = wall
            self.cursor = max(self.cursor, round((wall - self.t0) * 1e9))
        self.step_start = self.cursor
        self.step_ops = 0

    def _grad_tid(self, thread: Any) -> int:
        name = thread if isinstance(thread, str) else "autograd"
        tid = self.grad_tids.get(name)
        if tid is None:
            tid = self.grad_tids[name] = 2 + len(self.grad_tids)
        return tid

    def feed(self, ev: Event) -> Iterator[dict]:
        kind = ev.get("kind")
        step = ev.get("step") if type(ev.get("step")) is int else None
        if kind == SESSION:
            return
        if kind == STEP:
            t = ev.get("t")
            yield from self._enter_step(step, float(t) if isinstance(t, (int, float)) else None)
            return
        if kind == OP:
            yield from self._enter_step(step, None)
            yield from self._close_backward()
            if isinstance(ev.get("thread"), str):
                self.train_thread = ev["thread"]
            dur_us = ev.get("duration_us")
            dur = max(round(dur_us * 1000), 1) if isinstance(dur_us, (int, float)) else 1
            if not math.isfinite(dur):
                dur = 1
            args: dict[str, Any] = {
                "seq": ev.get("seq"),
                "step": step,
                "module": ev.get("module"),
                "source": ev.get("source"),
                "function": ev.get("function"),
                "grad_fn": ev.get("grad_fn"),
            }
            _tensors(ev, "inputs", args)
            _tensors(ev, "outputs", args)
            self.where[ev["seq"]] = (self.cursor, TRAIN_TID)
            calls = self._calls_of("op_seq", ev.get("seq"))
            yield self._x(str(ev.get("name")), "forward", self.cursor, dur, TRAIN_TID, args)
            yield from self._nested(calls, self.cursor, dur, TRAIN_TID)
            self.cursor += dur
            self.step_ops += 1
            return
        if kind == GRAD:
            yield from self._enter_step(step, None)
            tid = self._grad_tid(ev.get("thread"))
            key = (step, ev.get("backward"))
            if self.bw != key or self.bw_tid != tid:
                yield from self._close_backward()
                self.bw, self.bw_start, self.bw_nodes, self.bw_tid = key, self.cursor, 0, tid
            args = {
                "seq": ev.get("seq"),
                "step": step,
                "node_id": ev.get("node_id"),
                "op_seq": ev.get("op_seq"),
                "module": ev.get("module"),
                "param": ev.get("param"),
                "source": ev.get("source"),
                "duration": "not recorded",
            }
            _tensors(ev, "grad_outputs", args)
            _tensors(ev, "grad_inputs", args)
            self.where[ev["seq"]] = (self.cursor, tid)
            calls = self._calls_of("node_id", ev.get("node_id"))
            dur = max(NODE_NS, sum(_call_ns(c) for c in calls))  # its kernels fit inside
            yield self._x(str(ev.get("node")), "backward", self.cursor, dur, tid, args)
            yield from self._nested(calls, self.cursor, dur, tid)
            self.cursor += dur
            self.bw_nodes += 1
            return
        if kind == ATEN:
            yield from self._enter_step(step, None)
            if ev.get("accumulate") or (ev.get("op_seq") is None and ev.get("node") is None):
                # The engine's own sum after a node, or a call of no traced op: on its own.
                tid = self._grad_tid(ev.get("thread")) if ev.get("node") else TRAIN_TID
                dur = _call_ns(ev)
                yield self._x(str(ev.get("name")), "aten", self.cursor, dur, tid, _call_args(ev))
                self.cursor += dur
            else:
                self.calls.append(ev)
            return
        if kind == PAUSE:
            yield from self._close_pause(None)
            self.pause = (self.cursor, ev)
            return
        if kind == RESUME:
            yield from self._close_pause(ev)
            return
        if kind in (ALERT, ERROR):
            ts, tid = self.where.get(ev.get("event_seq"), (self.cursor, TRAIN_TID))
            args = {
                k: _safe(v)
                for k, v in ev.items()
                if k != "kind" and not isinstance(v, (dict, list))
            }
            yield {
                "name": f"{kind}: {ev.get('what') or ev.get('where') or ''}".rstrip(": "),
                "cat": kind,
                "ph": "i",
                "s": "t",
                "ts": _us(ts),
                "pid": self.pid,
                "tid": tid,
                "args": args,
            }

    def _calls_of(self, key: str, value: Any) -> list[Event]:
        """The waiting aten calls of this op or node (the others wait on)."""
        if not self.calls or value is None:
            return []
        mine = [c for c in self.calls if c.get(key) == value]
        if mine:
            self.calls = [c for c in self.calls if c.get(key) != value]
        return mine

    def _nested(self, calls: list[Event], start: int, dur: int, tid: int) -> Iterator[dict]:
        """Aten calls as child slices of their op or node, one after the other within it."""
        at, end = start, start + dur
        for call in calls:
            length = max(min(_call_ns(call), end - at), 1)
            yield self._x(str(call.get("name")), "aten", at, length, tid, _call_args(call))
            at = min(at + length, end - 1)

    def _close_pause(self, resume: Event | None) -> Iterator[dict]:
        """The slice of the pause still open; ``resume`` None: the recording ends (or pauses
        again) without its resume."""
        if self.pause is None:
            return
        ts, ev = self.pause
        self.pause = None
        since, until = ev.get("since"), resume.get("t") if resume is not None else None
        dur = 1
        if isinstance(since, (int, float)) and isinstance(until, (int, float)):
            seconds = until - since
            if math.isfinite(seconds) and seconds > 0:
                dur = max(round(seconds * 1e9), 1)
        event = ev.get("event")
        event = event if isinstance(event, dict) else {}
        what = event.get("name") or event.get("node") or "?"
        args = {
            "reason": _safe(ev.get("reason")),
            "at": f"{what} ({ev.get('phase')})",
            "seq": event.get("seq"),
            "set by": _safe(ev.get("by")),
            "resumed by": _safe(resume.get("by")) if resume is not None else "not recorded",
        }
        self.paused_any = True
        yield self._x(f"paused: {ev.get('reason')}", "pause", ts, dur, PAUSE_TID, args)
        self.cursor += dur  # the job stood still for that long; what comes next starts after

    def finish(self) -> Iterator[dict]:
        yield from self._close_pause(None)
        yield from self._close_step()

    def metadata(self, session: dict) -> Iterator[dict]:
        script = session.get("script") or "torchscope"
        rank = session.get("rank")
        name = f"{script.rsplit('/', 1)[-1]}" + (f" (rank {rank})" if rank is not None else "")
        yield {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": name}}
        yield {
            "name": "thread_name",
            "ph": "M",
            "pid": self.pid,
            "tid": TRAIN_TID,
            "args": {"name": f"training thread ({self.train_thread})"},
        }
        if self.paused_any:
            yield {
                "name": "thread_name",
                "ph": "M",
                "pid": self.pid,
                "tid": PAUSE_TID,
                "args": {"name": "paused (step-through)"},
            }
        for thread, tid in self.grad_tids.items():
            yield {
                "name": "thread_name",
                "ph": "M",
                "pid": self.pid,
                "tid": tid,
                "args": {"name": f"autograd ({thread})"},
            }


def _call_ns(ev: Event) -> int:
    dur_us = ev.get("duration_us")
    if isinstance(dur_us, (int, float)) and math.isfinite(dur_us):
        return max(round(dur_us * 1000), 1)
    return 1


def _call_args(ev: Event) -> dict[str, Any]:
    args: dict[str, Any] = {
        k: ev.get(k) for k in ("seq", "step", "op_seq", "node_id", "node", "module", "accumulate")
    }
    _tensors(ev, "outputs", args)
    return args


def trace_events(events: Iterable[Event]) -> Iterator[dict]:
    """Trace-event dicts for a recording's events, laid out as described above."""
    it = iter(events)
    session: dict = {}
    first = next(it, None)
    if first is not None and first.get("kind") == SESSION:
        session = first
    pid = session.get("pid")
    layout = _Layout(pid if isinstance(pid, int) else 1)
    if first is not None:
        yield from layout.feed(first)
    for ev in it:
        if ev.get("kind") == SESSION and not session:
            session = ev
        yield from layout.feed(ev)
    yield from layout.finish()
    yield from layout.metadata(session)


_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _dump(obj: dict) -> str:
    try:
        return _encode(obj)
    except (ValueError, TypeError):
        return _encode(json_safe(obj))


def write(events: Iterable[Event], out: IO[str], metadata: dict | None = None) -> int:
    """Write the JSON object format (``{"traceEvents": [...]}``) one event per line; returns
    how many trace events were written."""
    out.write('{"displayTimeUnit":"ms","otherData":')
    out.write(_dump({"producer": "torchscope", **(metadata or {})}))
    out.write(',"traceEvents":[\n')
    n = 0
    for te in trace_events(events):
        if n:
            out.write(",\n")
        out.write(_dump(te))
        n += 1
    out.write("\n]}\n")
    return n
