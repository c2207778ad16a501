"""Step-through debugging, the UI's side of it, without textual (and without torch).

- :class:`StepperView`: what the UI knows of the job's stepper: where it is paused, its
  breakpoints, its mode. Fed by the ``pause``/``resume`` events of the stream (in order, so
  authoritative) and by the ``state`` every stepping command's reply carries (which can be a
  few milliseconds stale: see :meth:`StepperView.on_state`).
- :func:`spec_text`: a breakpoint as the text ``--break-on`` and the breakpoint list take.
- :func:`spec_from_event`: the breakpoint the ``b`` dialog makes from an event.
- :func:`tensor_choices` / :class:`ValuesView`: the tensors of a pause point and the slice of
  values fetched from one of them with ``inspect``.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.events import ATEN, GRAD

__all__ = [
    "INSPECT_COUNT",
    "REPLAY_REFUSAL",
    "StepperView",
    "ValuesView",
    "bad_kind",
    "event_name",
    "pause_key",
    "pause_story",
    "spec_from_event",
    "spec_text",
    "tensor_choices",
]

#: Values fetched per ``inspect`` request (one page of the values section).
INSPECT_COUNT = 1000
#: What a source that cannot reach a running job answers to any command.
REPLAY_REFUSAL = "replay: the job is not running"
# A ``state`` reply saying "not paused" may predate a pause the stream already reported (the
# job emits the pause event an instant before its stepper records the pause). Such a pause is
# only dropped on a reply once it is older than this; its resume event normally comes first.
_STALE_REPLY_SECONDS = 2.0


def event_name(ev: dict) -> str:
    """What an event is called: an op's or aten call's name, a backward node's; ``?``."""
    name = ev.get("node") if ev.get("kind") == GRAD else ev.get("name")
    return str(name) if name else "?"


def pause_key(pause: dict | None) -> Any:
    """What identifies one pause (the job's ``since`` timestamp)."""
    return None if pause is None else pause.get("since")


def pause_event(pause: dict) -> dict:
    ev = pause.get("event")
    return ev if isinstance(ev, dict) else {}


# The sides of an event that came in and went out (an op's, a node's, an aten call's).
_SIDES: dict[object, tuple[str, str]] = {GRAD: ("grad_outputs", "grad_inputs")}


def bad_kind(summaries: Any) -> str | None:
    """``NaN`` or ``Inf`` when a summary in the list holds one (NaN first), else None."""
    found = None
    for s in summaries if isinstance(summaries, list) else ():
        stats = s.get("stats") if isinstance(s, dict) else None
        if isinstance(stats, dict):
            if stats.get("nan"):
                return "NaN"
            if stats.get("inf"):
                found = "Inf"
    return found


def _first(summaries: Any) -> dict | None:
    if isinstance(summaries, list):
        for s in summaries:
            if isinstance(s, dict):
                return s
    return None


def pause_story(pause: dict, stepper: StepperView | None = None) -> str:
    """Why the job is paused, as a sentence the status bar can cut from the right:
    ``NaN first appears: torch.sqrt · blocks.0.attn · job.py:29 · -84 → nan`` for a value
    breakpoint at the value's origin, ``breakpoint 2 (op:^F.gelu$): F.gelu · …`` for another,
    ``stepped: …``, ``paused: …``; ``before`` when the event has not run yet."""
    from torchscope.analysis.render import compact_stat
    from torchscope.session.format import short_name, source_cell

    ev = pause_event(pause)
    reason = str(pause.get("reason") or "paused")
    phase = pause.get("phase")
    ins, outs = _SIDES.get(ev.get("kind"), ("inputs", "outputs"))
    head = {"step": "stepped", "next step": "at the next step"}.get(reason, reason)
    if reason == "origin":  # a recording's cursor at an alert's origin
        head = f"{bad_kind(ev.get(outs)) or 'NaN/Inf'} first appears"
    if reason.startswith("breakpoint"):
        bp_id = reason.removeprefix("breakpoint").strip()
        # The pause's own copy first: the list of breakpoints may not have arrived yet.
        bp = pause.get("breakpoint") if isinstance(pause.get("breakpoint"), dict) else None
        if bp is None and stepper is not None and bp_id.isdigit():
            bp = stepper.breakpoint(int(bp_id))
        bad = bad_kind(ev.get(outs)) if phase != "before" else None
        if bp is not None and bad is not None and (bp.get("nan") or bp.get("inf")):
            head = f"{bad} first appears" if bad_kind(ev.get(ins)) is None else f"{bad} here"
        elif bp is not None:
            head = f"{reason} ({spec_text(bp)})"
    parts = [short_name(event_name(ev))]
    if ev.get("module"):
        parts.append(str(ev["module"]))
    if ev.get("source"):
        parts.append(source_cell(str(ev["source"])))
    if phase == "before":
        parts.append("before it runs")
    else:
        first_in, first_out = _first(ev.get(ins)), _first(ev.get(outs))
        if first_out is not None:
            came = compact_stat(first_in) + " → " if first_in is not None else ""
            parts.append(came + compact_stat(first_out))
    return f"{head}: " + " · ".join(parts)


class StepperView:
    """The job's stepper as the UI knows it. Touched only on the UI thread."""

    def __init__(self) -> None:
        self.paused: dict[str, Any] | None = None  # {phase, event, reason, stack, since, step}
        self.mode: str | None = None  # "run", "pause" (requested), "step", "next"
        self.breakpoints: list[dict[str, Any]] = []
        self.auto_resumed = 0
        self.lease: float | None = None  # seconds a pause lasts without its UI (the job's)
        self.pg_timeout: float | None = None  # torchrun: how long the other ranks may wait
        self.known = False  # a state reply came: the job takes stepping commands
        self.resumed_by: str | None = None  # what ended the last pause
        self.version = 0  # bumped when ``paused`` changes to another pause (or to none)
        self._from_stream = False
        self._adopted = 0.0
        self._last_seq = -1
        self._ended: list[Any] = []  # keys of pauses known to be over (newest last)

    # -- the stream ------------------------------------------------------------------------
    def on_pause_event(self, ev: dict) -> bool:
        """A ``pause`` event; True when the paused point changed."""
        seq = ev.get("seq")
        if type(seq) is int:
            if seq <= self._last_seq:
                return False  # seen (a snapshot overlapping the stream)
            self._last_seq = seq
        pause = {k: ev.get(k) for k in ("phase", "event", "reason", "stack", "since")}
        pause["step"] = ev.get("step")
        if not isinstance(pause["event"], dict):
            pause["event"] = {}
        changed = pause_key(pause) != pause_key(self.paused) or self.paused is None
        self._set(pause, stream=True, changed=changed)
        return changed

    def on_resume_event(self, ev: dict) -> bool:
        """A ``resume`` event; True when a pause ended."""
        seq = ev.get("seq")
        if type(seq) is int:
            if seq <= self._last_seq:
                return False
            self._last_seq = seq
        self.resumed_by = ev.get("by") if isinstance(ev.get("by"), str) else None
        if self.mode in ("pause", "step", "next"):
            self.mode = None  # used up or replaced; the next reply says
        return self.clear()

    # -- replies ---------------------------------------------------------------------------
    def on_state(self, state: Any) -> tuple[bool, bool]:
        """The ``state`` of a reply: (paused point changed, breakpoints changed)."""
        if not isinstance(state, dict):
            return False, False
        self.known = True
        if isinstance(state.get("mode"), str):
            self.mode = state["mode"]
        if type(state.get("auto_resumed")) is int:
            self.auto_resumed = state["auto_resumed"]
        for key, attr in (("lease_s", "lease"), ("pg_timeout_s", "pg_timeout")):
            value = state.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                setattr(self, attr, float(value))
        bps_changed = False
        bps = state.get("breakpoints")
        if isinstance(bps, list):
            bps = [b for b in bps if isinstance(b, dict) and type(b.get("id")) is int]
            if bps != self.breakpoints:
                self.breakpoints = bps
                bps_changed = True
        changed = False
        paused = state.get("paused", False)
        if isinstance(paused, dict):
            key = pause_key(paused)
            if key in self._ended:
                pass  # a pause the stream already saw end: this reply is stale
            elif self.paused is None or key != pause_key(self.paused):
                pause = dict(paused)
                ev = pause.get("event")
                pause["event"] = ev if isinstance(ev, dict) else {}
                pause.setdefault("step", pause["event"].get("step"))
                self._set(pause, stream=False, changed=True)
                changed = True
        elif paused is None and self.paused is not None:
            young = time.monotonic() - self._adopted < _STALE_REPLY_SECONDS
            if not (self._from_stream and young):
                changed = self.clear()
        return changed, bps_changed

    # -- both ------------------------------------------------------------------------------
    def _set(self, pause: dict, *, stream: bool, changed: bool) -> None:
        self.paused = pause
        self._from_stream = stream
        if changed:
            self._adopted = time.monotonic()
            self.version += 1

    def clear(self) -> bool:
        """The job is not paused (any more): True when it was."""
        if self.paused is None:
            return False
        self._ended.append(pause_key(self.paused))
        del self._ended[:-64]
        self.paused = None
        self.version += 1
        return True

    def forget(self) -> bool:
        """The job ended: no breakpoints, no mode. True when there were breakpoints."""
        had = bool(self.breakpoints)
        self.breakpoints = []
        self.mode = None
        self.known = False
        return had

    def breakpoint(self, bp_id: int) -> dict | None:
        return next((b for b in self.breakpoints if b.get("id") == bp_id), None)


# -- breakpoints as text ---------------------------------------------------------------------


def spec_text(spec: dict[str, Any]) -> str:
    """A breakpoint (spec or the job's dict of one) in ``--break-on`` syntax, which
    :func:`torchscope.protocol.breakpoints.parse_break_spec` reads back."""
    parts: list[str] = []
    if spec.get("nan"):
        parts.append(str(spec["nan"]))
    if spec.get("op") is not None:
        parts.append(f"op:{spec['op']}")
    if spec.get("node") is not None:
        parts.append(f"node:{spec['node']}")
    if spec.get("aten") is not None:
        parts.append(f"aten:{spec['aten']}")
    if spec.get("module") is not None:
        parts.append(f"module:{spec['module']}")
    if spec.get("source") is not None:
        parts.append(f"line:{spec['source']}")
    if spec.get("grad_norm") is not None:
        parts.append(f"gradnorm:{spec['grad_norm']!r}")
    if spec.get("step") is not None:
        parts.append(f"step:{spec['step']}")
    if spec.get("from_step") is not None:
        parts.append(f"from:{spec['from_step']}")
    for action in ("log", "edit"):  # a breakpoint with an action: last, it takes the rest
        if spec.get(action) is not None:
            parts.append(f"{action}:{spec[action]}")
    return ",".join(parts) or "?"


def exact(text: str) -> str:
    """A regex matching exactly ``text``."""
    return f"^{re.escape(text)}$"


def spec_from_event(ev: dict, choice: str, nan: bool = False) -> dict[str, Any] | None:
    """The breakpoint "same op/node name" (``choice="op"``; an aten call's: ``aten:``, which
    stops at its calls), "same module" (``"module"``) or "same source line" (``"source"``)
    as ``ev``, AND ``nan`` when asked; None when ``ev`` has no such field."""
    spec: dict[str, Any] = {}
    if choice == "op":
        name = event_name(ev)
        if name == "?":
            return None
        spec["aten" if ev.get("kind") == ATEN else "op"] = exact(name)
    elif choice == "module":
        module = ev.get("module")
        if not isinstance(module, str) or not module:
            return None
        spec["module"] = exact(module)
    elif choice == "source":
        source = ev.get("source")
        if not isinstance(source, str) or not re.search(r".:\d+$", source):
            return None
        spec["source"] = source
    else:
        raise ValueError(f"unknown breakpoint choice {choice!r}")
    if nan:
        spec["nan"] = "nan"
    return spec


# -- values of a pause point -----------------------------------------------------------------


def _groups(pause: dict) -> tuple[str, ...]:
    ev = pause_event(pause)
    after = pause.get("phase") == "after"
    if ev.get("kind") == GRAD:
        return ("grad_outputs", "grad_inputs") if after else ("grad_outputs",)
    return ("inputs", "outputs") if after else ("inputs",)


def tensor_choices(pause: dict | None) -> list[tuple[str, int, dict]]:
    """``(group, index, summary)`` of each tensor the job holds at this pause, in order (a
    ``None`` gradient has no values and is left out)."""
    if pause is None:
        return []
    ev = pause_event(pause)
    out = []
    for group in _groups(pause):
        sums = ev.get(group)
        if not isinstance(sums, list):
            continue
        for i, s in enumerate(sums):
            if isinstance(s, dict):
                out.append((group, i, s))
    return out


def default_choice(choices: list[tuple[str, int, dict]]) -> int:
    """What ``v`` shows first: what the op or node produced (outputs, grad_inputs) when it
    has run, else what it got."""
    for i, (group, _, _) in enumerate(choices):
        if group in ("outputs", "grad_inputs"):
            return i
    return 0


def numel_of(summary: dict | None) -> int | None:
    shape = summary.get("shape") if isinstance(summary, dict) else None
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        return None
    return math.prod(shape)


@dataclass
class ValuesView:
    """The values section of a pause: which tensor, which slice, what came back."""

    key: Any  # pause_key of the pause these belong to
    choices: list[tuple[str, int, dict]]
    current: int = -1  # index into choices; -1: nothing asked yet
    start: int = 0
    count: int = INSPECT_COUNT
    result: dict[str, Any] | None = None
    loading: bool = False
    error: str | None = None
    version: int = 0
    requested: tuple = field(default=())  # (current, start) of the request in flight
    mark: int | None = None  # flat index to highlight (the first NaN/Inf ``!`` found)
    note: str | None = None  # one line under the values (the ``!`` search's progress)

    @property
    def choice(self) -> tuple[str, int, dict] | None:
        if 0 <= self.current < len(self.choices):
            return self.choices[self.current]
        return None

    @property
    def numel(self) -> int | None:
        if self.result is not None and type(self.result.get("numel")) is int:
            return self.result["numel"]
        choice = self.choice
        return numel_of(choice[2]) if choice is not None else None

    def label(self, i: int | None = None) -> str:
        choice = self.choices[self.current if i is None else i]
        return f"{choice[0]}[{choice[1]}]"

    def bump(self) -> None:
        self.version += 1
