"""A steppable job without torch: scripted events plus a simulated stepper that answers the
step-through commands the way a traced job does. For tests, snapshots and demos of the UI.

``FakeJob(make_trace(...), pause_at=seq)`` starts paused after the op or node ``seq`` (or
``phase="before"`` it); without ``pause_at`` it delivers ``start`` events (default: all) and
"runs" with the rest still to come. Then it follows the stepper's rules on the remaining
events: ``pause`` stops before the next op or node, ``step`` at the next "after" point,
``next`` at the first point of a later training step, ``continue`` at the next breakpoint
(name, module and line conditions before the event, value conditions after it). Every pause
and resume is emitted as a ``pause``/``resume`` event, every command gets the reply a job
sends (``{"state": ...}``, ``inspect`` values, ``arm``'s holder, or a refusal;
``refuse={cmd: message}`` makes it refuse a command; ``history`` answers with the points
given as ``history=``; with ``ends=True`` the session ends once the script ran out, as a
finished job's does). ``received`` records the commands, in order (``queries`` the history
asked for as the UI connects).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterable
from typing import Any

from torchscope.protocol.breakpoints import AFTER, BEFORE, Breakpoint, BreakpointError, first_hit
from torchscope.protocol.events import GRAD, OP, PAUSE, RESUME, Event
from torchscope.session.inbox import Inbox
from torchscope.session.items import Refused, Reply
from torchscope.session.rows import prepare
from torchscope.tui.sources.scripted import ScriptedSource

__all__ = ["FakeJob"]

_SINCE0 = 1_700_000_000.0  # pause timestamps: fixed, so screens are the same every run


def _stub(ev: Event) -> Event:
    """What a job knows of an op or node before it runs (its pause carries this)."""
    stub = Event(ev)
    stub["seq"] = None
    if ev.get("kind") == OP:
        stub["outputs"] = None
        stub.pop("nodes", None)
        stub.pop("duration_us", None)
    else:
        stub["grad_inputs"] = None
    return stub


def _bad(sums: Any) -> str | None:
    for s in sums or ():
        stats = s.get("stats") if isinstance(s, dict) else None
        if isinstance(stats, dict):
            if stats.get("nan"):
                return "nan"
            if stats.get("inf"):
                return "inf"
    return None


def _origin(ev: dict) -> str | None:
    """Where a NaN/Inf first appears: bad on the way out, finite on the way in."""
    ins, outs = ("grad_outputs", "grad_inputs") if ev.get("kind") == GRAD else ("inputs", "outputs")
    out = _bad(ev.get(outs))
    return out if out is not None and _bad(ev.get(ins)) is None else None


class FakeJob(ScriptedSource):
    """A live source whose job pauses, steps and answers ``inspect``, all simulated."""

    can_command = True

    def __init__(
        self,
        events: Iterable[dict],
        *,
        pause_at: int | None = None,
        phase: str = AFTER,
        reason: str = "breakpoint 1",
        start: int | None = None,
        breakpoints: Iterable[dict] = (),
        refuse: dict[str, str] | None = None,
        status: dict[str, Any] | None = None,
        history: list[dict[str, Any]] | None = None,
        ends: bool = False,
    ) -> None:
        script = [e if isinstance(e, Event) else Event(e) for e in events]
        super().__init__(script, status=status)
        self.script: list[Event] = script
        self.history = list(history or ())  # the run's points (StepPoint.to_wire) so far
        self.ends = ends  # the job ends (the session says so) once its script ran out
        self._ended = False
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.queries: list[tuple[str, dict[str, Any]]] = []
        self.refuse = dict(refuse or {})  # cmd -> the error a job would answer it with
        self.pos = 0  # index of the next event to deliver
        self.point: tuple[str, int] | None = None  # (phase, index into script) while paused
        self.job_mode = "run"
        self.step_mark = 0  # "next" goes past this step
        self.breakpoints: dict[int, Breakpoint] = {}
        self._next_bp = 1
        for spec in breakpoints:
            self._add(dict(spec))
        seqs = [e["seq"] for e in events if type(e.get("seq")) is int]
        self._seq = max(seqs, default=0) + 1
        self._pauses = 0
        self._pause_event: Event | None = None
        self._pause_at = pause_at
        self._phase = phase
        self._reason = reason
        self._start = len(script) if start is None else start
        self._inbox: Inbox | None = None
        self._all = []  # what was delivered (reloads): not the events still to come
        self._resumed_from_before = False

    # -- the job -----------------------------------------------------------------------------
    def run(self, inbox: Inbox, stop: threading.Event) -> None:
        self._inbox = inbox
        session = next((e for e in self.script if e.get("kind") == "session"), None)
        keys = ("pid", "rank", "host", "script")
        known = {k: session[k] for k in keys if k in session} if session is not None else {}
        inbox.status(mode="live", connected=True, state="connected", **known, **self.extra_status)
        if self._pause_at is not None:
            index = next(
                (i for i, e in enumerate(self.script) if e.get("seq") == self._pause_at), None
            )
            if index is None:
                raise ValueError(f"no event with seq {self._pause_at}")
            if self._phase == BEFORE:
                self._emit_upto(index)
            else:
                self._emit_upto(self._after(index))
            first = self._reason.split()
            if first[:1] == ["breakpoint"] and first[1:2] and first[1].isdigit():
                bp = self.breakpoints.get(int(first[1]))
                if bp is not None:
                    bp.hits += 1
            self._pause(self._phase, index, self._reason)
        else:
            self._emit_upto(self._start)
        inbox.put(Reply(0, "state", {}, {"state": self.state()}))  # as LiveSource asks
        self.done.set()
        while not stop.is_set():
            try:
                token, cmd, fields = self._commands.get(timeout=0.02)
            except queue.Empty:
                for step in self._take_requests():
                    self._load(step, inbox)
                continue
            if cmd == "history":  # asked by the UI on its own as it connects: a query that
                self.queries.append((cmd, fields))  # neither the keys sent nor moves the job
                inbox.put(Reply(token, cmd, fields, self._history(fields.get("since"))))
                continue
            self.received.append((cmd, fields))
            try:
                result = self._answer(cmd, fields)
            except (BreakpointError, ValueError) as exc:
                inbox.put(Refused(token, cmd, fields, f"{cmd}: {exc}"))
            else:
                inbox.put(Reply(token, cmd, fields, result))
            self._advance()

    def _emit(self, events: list[Event]) -> None:
        if events and self._inbox is not None:
            self._all.extend(events)
            if self._inbox.put_events(prepare(events)) and self.overview is not None:
                self.overview.put(self._inbox, events)

    def _emit_upto(self, index: int) -> None:
        index = min(index, len(self.script))
        if index > self.pos:
            self._emit(self.script[self.pos : index])
            self.pos = index

    def _pause(self, phase: str, index: int, reason: str) -> None:
        ev = self.script[index]
        self.point = (phase, index)
        self._pauses += 1
        line = str(ev.get("source") or ":0").rpartition(":")
        stack = [
            [line[0] or "/work/job/train.py", int(line[2] or 0), ev.get("function") or "forward"],
            ["/work/job/train.py", 88, "train_step"],
            ["/work/job/train.py", 120, "<module>"],
        ]
        self._pause_event = Event(
            kind=PAUSE,
            seq=self._next_seq(),
            step=ev.get("step"),
            phase=phase,
            event=dict(ev) if phase == AFTER else dict(_stub(ev)),
            reason=reason,
            stack=stack,
            since=_SINCE0 + self._pauses,
        )
        self._emit([self._pause_event])

    def _resume(self, by: str) -> None:
        if self.point is None:
            return
        step = self.script[self.point[1]].get("step")
        self._emit([Event(kind=RESUME, seq=self._next_seq(), step=step, by=by)])

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _advance(self) -> None:
        """Run the job from where it is until the mode says stop, or to the end."""
        if self.point is not None:
            return
        i = self.pos
        skip_before = self._resumed_from_before
        self._resumed_from_before = False
        while i < len(self.script):
            ev = self.script[i]
            if ev.get("kind") in (OP, GRAD):
                if not skip_before:
                    reason = self._should_pause(BEFORE, ev)
                    if reason is not None:
                        self._emit_upto(i)
                        self._pause(BEFORE, i, reason)
                        return
                skip_before = False
                reason = self._should_pause(AFTER, ev)
                if reason is not None:
                    self._emit_upto(self._after(i))
                    self._pause(AFTER, i, reason)
                    return
            i += 1
        self._emit_upto(len(self.script))
        if self.job_mode != "pause":
            self.job_mode = "run"
        if self.ends and self._inbox is not None and not self._ended:
            self._ended = True  # the script ran out: the job's process is gone
            self._inbox.status(connected=False, state="ended")

    def _after(self, index: int) -> int:
        """Where the events a job sends once ``index`` ran end: the event, and the alerts
        that name it (a job says what an op made before it pauses after it)."""
        end = index + 1
        seq = self.script[index].get("seq")
        while end < len(self.script):
            ev = self.script[end]
            if ev.get("kind") != "alert" or ev.get("event_seq") != seq:
                break
            end += 1
        return end

    def _should_pause(self, phase: str, ev: dict) -> str | None:
        mode = self.job_mode
        if mode == "pause":
            self.job_mode = "run"
            return "paused"
        if mode == "step" and phase == AFTER:
            self.job_mode = "run"
            return "step"
        if mode == "next" and (ev.get("step") or 0) > self.step_mark:
            self.job_mode = "run"
            return "next step"
        return first_hit(self.breakpoints.values(), phase, ev, _origin)

    # -- commands ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        paused = None
        if self.point is not None and self._pause_event is not None:
            pe = self._pause_event
            paused = {k: pe[k] for k in ("phase", "event", "reason", "stack", "since")}
        return {
            "paused": paused,
            "mode": self.job_mode,
            "breakpoints": [bp.to_dict() for bp in self.breakpoints.values()],
            "auto_resumed": 0,
        }

    def _go(self, mode: str, by: str) -> None:
        self.job_mode = mode
        if self.point is not None:
            phase, index = self.point
            self._resume(by)
            if phase == BEFORE:
                self._resumed_from_before = True
                self.pos = index
            self.step_mark = self.script[index].get("step") or 0
            self.point = None

    def _add(self, spec: dict[str, Any]) -> dict[str, Any]:
        spec = {k: v for k, v in spec.items() if v is not None and k != "id"}
        bp = Breakpoint.from_spec(self._next_bp, spec)
        self._next_bp += 1
        self.breakpoints[bp.id] = bp
        return bp.to_dict()

    def _get(self, bp_id: int) -> Breakpoint:
        bp = self.breakpoints.get(bp_id)
        if bp is None:
            raise BreakpointError(f"no breakpoint {bp_id}")
        return bp

    def _answer(self, cmd: str, fields: dict[str, Any]) -> dict[str, Any]:
        if cmd in self.refuse:
            raise ValueError(self.refuse[cmd])
        if cmd == "ping":
            return {"t": 0.0}
        if cmd == "pause":
            if self.point is None:
                self.job_mode = "pause"
        elif cmd == "step":
            self._go("step", "step")
        elif cmd == "next":
            step_now = self.script[self.point[1]].get("step") if self.point else None
            self._go("next", "next")
            if step_now is None:
                last = self.script[min(self.pos, len(self.script) - 1)]
                self.step_mark = last.get("step") or 0
        elif cmd == "continue":
            self._go("run", "continue")
        elif cmd == "detach":
            self.breakpoints.clear()
            self._go("run", "detach")
        elif cmd == "break_add":
            self._add(fields)
        elif cmd == "break_enable":
            self._get(fields["bp"]).enabled = bool(fields["enabled"])
        elif cmd == "break_delete":
            self._get(fields["bp"])
            del self.breakpoints[fields["bp"]]
        elif cmd == "inspect":
            return self._inspect(**fields)
        elif cmd in ("arm", "disarm"):  # held traced: the hold asked is in ``received``
            return {"holder": 1, "tracing": "traced", "state": self.state()}
        elif cmd not in ("state", "break_list"):
            raise ValueError(f"command '{cmd}' is not supported by this job")
        return {"state": self.state()}

    def _history(self, since: int | None) -> dict[str, Any]:
        points = [p for p in self.history if since is None or p["step"] > since]
        return {"points": points, "buckets": []}

    def _inspect(self, group: str, index: int, start: int = 0, count: int = 1000) -> dict:
        if self.point is None or self._pause_event is None:
            raise BreakpointError("the job is not paused")
        ev = self._pause_event["event"]
        phase = self.point[0]
        if ev.get("kind") == GRAD:
            groups = ("grad_outputs", "grad_inputs") if phase == AFTER else ("grad_outputs",)
        else:
            groups = ("inputs", "outputs") if phase == AFTER else ("inputs",)
        if group not in groups:
            have = ", ".join(groups)
            raise BreakpointError(f"no {group!r} at this point (have {have})")
        sums = ev.get(group) or []
        if not 0 <= index < len(sums):
            raise BreakpointError(f"{group} has {len(sums)} tensors, not index {index}")
        s = sums[index]
        if s is None:
            return {"group": group, "index": index, "values": None}
        shape = list(s.get("shape") or [])
        numel = math.prod(shape)
        stats = s.get("stats") or {}
        bad = stats.get("nan") or 0
        values = [
            math.nan if i < bad else round(math.sin(i + 1) * (1 + index), 4)
            for i in range(start, min(numel, start + count))
        ]
        return {
            "group": group,
            "index": index,
            "shape": shape,
            "dtype": s.get("dtype", "float32"),
            "numel": numel,
            "start": start,
            "values": values,
        }
