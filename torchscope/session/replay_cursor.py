"""Stepping through a recording as through a live job: a paused cursor that ``s``, ``n``, ``c``
and breakpoints move forward, and ``S``, ``N``, ``C`` move back. No textual, no torch.

A live job pauses *before* an op or node runs or *after*; a recording holds every event once
it ran, so every position here is an *after* point (:data:`AFTER`): a name or line breakpoint,
which stops a live job before the op, lands on the op's row, with both sides known.

The moves, and what each lands on (:class:`Landed`):

=====  ===========================================================================================
``s``  the next op or node row (into the next step at a step's end). From an aten call (where a
       ``nan`` or ``aten:`` breakpoint landed): the next call under the same row, then the row
       after it (a live step from an aten call goes on at the aten level too).
``S``  the previous row; from an aten call, the previous call under the same row, then the row.
``n``  the first row of the next step that has rows (a live ``next``: the first point of a
       later training step).
``N``  the first row of the previous step that has rows.
``c``  the next event a breakpoint hits (the protocol's own matcher:
       :func:`torchscope.protocol.breakpoints.first_hit`). ``nan`` / ``inf`` hit where the value
       first appears, as the job judges it: the event an alert names (``event_seq``; the aten
       call, ``aten_seq``, when the recording has the aten level), never the later events that
       merely carry the NaN. ``anynan`` hits every event whose outputs hold NaN/Inf (the
       recorded flags), ``gradnorm:X`` a node whose recorded gradient norm is above X. No
       breakpoint, or none hit: the last row of the recording, and the note says so.
``C``  the same, backwards; the first row of the recording when nothing is hit.
space  a recording is always paused: :meth:`ReplayCursor.place` makes the selected row the
       paused position ("pause here").
=====  ===========================================================================================

**Steps on disk.** A move may need a step that is not in memory (a trace file loads steps on
request: ``ON_DISK``/``LOADING`` in :mod:`.steps`). Then the cursor does not move
and the answer is :class:`NeedStep`: ask the source for that step (``store.mark_loading(step)``
and ``source.request_step(step)``, unless it is already ``LOADING``), and call the same move
again once the step is resident (its number in ``Changes.loaded``). The cursor remembers how
far a ``c``/``C`` scan got, so the retry goes on from the step it needed instead of scanning the
earlier ones again (as long as nothing moved the cursor meanwhile). Steps the counts say have no
row are skipped unloaded, and so are steps where no enabled breakpoint can hit: a ``nan``/
``inf`` breakpoint only loads the steps whose (counted) alerts name an origin of that kind.

:func:`first_origin` gives where a recording with alerts opens: the first NaN/Inf origin.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from torchscope.protocol.breakpoints import (
    AFTER,
    BEFORE,
    Breakpoint,
    BreakpointError,
    first_hit,
)
from torchscope.protocol.events import ATEN, CONSEQUENCES, GRAD, OP, Event
from torchscope.session.checks import is_check
from torchscope.session.rows import (
    FLAG_INF_OUT,
    FLAG_NAN_OUT,
    FLAGS,
    KIND,
    MODULE,
    NAME,
    SEQ,
    SOURCE,
    Rec,
)
from torchscope.session.stepper_view import spec_text
from torchscope.session.steps import EVICTED, StepData
from torchscope.session.store import EventStore

__all__ = [
    "KEYS",
    "Landed",
    "NeedStep",
    "Position",
    "ReplayBreakpoints",
    "ReplayCursor",
    "Result",
    "Stay",
    "first_origin",
]

_seq_key = itemgetter(SEQ)


@dataclass(frozen=True)
class Position:
    """A paused position in a recording: an op (``kind`` "op"), node ("grad") or aten call
    ("aten") of ``step``, by its ``seq``. Always after the event ran (``phase``)."""

    step: int
    kind: str
    seq: int
    phase: str = AFTER


@dataclass(frozen=True)
class Landed:
    """The cursor moved to ``position``. ``reason`` says why it stopped there, as a live
    pause's reason does ("step", "step back", "next step", "previous step", "breakpoint N",
    "origin", "end", "start"); ``note`` is one line worth telling the user ("" when the move
    speaks for itself): the alert's words at a NaN/Inf origin, "no breakpoint: ..." at the end.
    """

    position: Position
    reason: str
    note: str = ""

    def pause(self, store: EventStore) -> dict[str, Any]:
        """The position as a live pause reads (``StepperView.paused``): phase, event,
        reason, stack (none in a recording), since (a key unique to the position), step."""
        pos = self.position
        rec = record_at(store.data(pos.step), pos)
        event: dict[str, Any] = dict(store.event(rec)) if rec is not None else {}
        return {
            "phase": pos.phase,
            "event": event,
            "reason": self.reason,
            "stack": [],
            "since": ("replay", pos.step, pos.seq),
            "step": pos.step,
        }


@dataclass(frozen=True)
class NeedStep:
    """The move needs ``step`` in memory. The cursor did not move: load the step and make
    the same move again once it is resident."""

    step: int


@dataclass(frozen=True)
class Stay:
    """Nowhere to move (the start or the end of the recording, no step after this one);
    ``note`` says so."""

    note: str


Result = Landed | NeedStep | Stay


# -- the recording's positions ---------------------------------------------------------------


def record_at(data: StepData | None, pos: Position) -> Rec | None:
    """The record of the event at ``pos`` in its resident step, or None."""
    if data is None:
        return None
    if pos.kind == ATEN:
        return data.aten.get(pos.seq)
    i = data.row_index(pos.seq)
    return data.rows[i] if i is not None else None


def _pos(step: int, t: Rec) -> Position:
    return Position(step, t[KIND], t[SEQ])


def _calls(data: StepData, row: Rec) -> tuple[Rec, ...]:
    return data.aten_of(row) if data.aten else ()


def _locate(data: StepData, pos: Position) -> tuple[int, int] | None:
    """``(row index, call index)`` of ``pos`` in ``data``: call index -1 for the row itself.
    None when the event is not there (or is an aten call shown under no row)."""
    if pos.kind == ATEN:
        t = data.aten.get(pos.seq)
        parent = data.aten_parent(t) if t is not None else None
        i = data.row_index(parent[SEQ]) if parent is not None else None
        if parent is None or i is None:
            return None
        calls = _calls(data, parent)
        j = next((k for k, c in enumerate(calls) if c[SEQ] == pos.seq), None)
        return None if j is None else (i, j)
    i = data.row_index(pos.seq)
    return None if i is None else (i, -1)


def _walk(data: StepData, start: Position | None, forward: bool, calls: bool) -> Iterator[Rec]:
    """The events of a step in the timeline's order (each row, then the aten calls under it
    when ``calls``), strictly after ``start`` (before it, backwards); all of them when
    ``start`` is None or of another step."""
    rows = data.rows
    n = len(rows)
    if start is None or start.step != data.step:
        i, j = (0, None) if forward else (n - 1, None)
    else:
        at = _locate(data, start)
        if at is None:  # not here: from where its seq would be
            i = bisect.bisect_right(rows, start.seq, key=_seq_key)
            i, j = (i, None) if forward else (i - 1, None)
        elif forward:
            i, j = at[0], at[1] + 1  # the calls after it under the same row, then the rows
        else:
            i, j = at
            if j < 0:
                i, j = i - 1, None
    if forward:
        if j is not None:
            if calls or (start is not None and start.kind == ATEN):
                yield from _calls(data, rows[i])[j:]
            i += 1
        for k in range(i, n):
            yield rows[k]
            if calls:
                yield from _calls(data, rows[k])
    else:
        if j is not None:  # inside row i's calls: those before it, then the row
            yield from reversed(_calls(data, rows[i])[:j])
            yield rows[i]
            i -= 1
        for k in range(i, -1, -1):
            if calls:
                yield from reversed(_calls(data, rows[k]))
            yield rows[k]


def _origin_alerts(alerts: Iterable[Event]) -> Iterator[Event]:
    """The alerts that name where a NaN/Inf first appeared (or entered from outside the
    traced ops): what a live ``nan``/``inf`` breakpoint stops at. Not the eager checks, nor
    the step-end counts of an origin's consequences."""
    for a in alerts:
        # An arrival (another rank made the value: ``where: "arrival"``) is no origin here.
        # An overflow (a loss scaler's, which it skips) is no origin either.
        if is_check(a) or a.get("where") in (CONSEQUENCES, "arrival", "overflow"):
            continue
        if type(a.get("event_seq")) is int and type(a.get("step")) is int:
            yield a


def first_origin(store: EventStore) -> Landed | None:
    """Where a recording with alerts opens: its first NaN/Inf origin (the aten call that made
    the value when the recording has the aten level), or None without one. The step may not
    be in memory: select it as any jump does (the main screen's ``_go`` loads the step and
    lands once it is resident). Final once every step is counted (alerts of a file arrive
    with the counts, step by step)."""
    for a in _origin_alerts(store.alerts):
        step, seq = a["step"], a["event_seq"]
        if type(a.get("aten_seq")) is int:
            pos = Position(step, ATEN, a["aten_seq"])
        else:
            pos = Position(step, GRAD if a.get("where") == "backward" else OP, seq)
        return Landed(pos, "origin", str(a.get("message") or ""))
    return None


# -- breakpoints ---------------------------------------------------------------------------


def _compile(specs: Iterable[dict[str, Any] | Breakpoint]) -> list[Breakpoint]:
    """Breakpoints from specs as the UI holds them (``StepperView.breakpoints``: the job's
    dicts with ``id``, ``hits``, ``enabled``; or bare specs, numbered in order). Disabled ones
    are left out. Raises BreakpointError for a spec that cannot work."""
    out = []
    for n, spec in enumerate(specs, 1):
        if isinstance(spec, Breakpoint):
            bp = Breakpoint.from_spec(spec.id, {k: getattr(spec, k) for k in Breakpoint.KEYS})
        else:
            given = spec.get("id")
            bp = Breakpoint.from_spec(
                given if type(given) is int else n, {k: spec.get(k) for k in Breakpoint.KEYS}
            )
        if bp.enabled:
            out.append(bp)
    return out


def _hits_calls(bp: Breakpoint) -> bool:
    """Whether ``bp`` can stop at an aten call (``aten:``, or where a NaN/Inf is made)."""
    return bp.aten is not None or bp.nan in ("nan", "inf")


def _may_hit_in(bp: Breakpoint, step: int, origins: set[str] | None) -> bool:
    """Whether ``bp`` can hit anywhere in ``step``; ``origins``: the kinds of value the
    step's alerts say first appear there (None: not known yet)."""
    if bp.step is not None and step != bp.step:
        return False
    if bp.from_step is not None and step < bp.from_step:
        return False
    return not (bp.nan in ("nan", "inf") and origins is not None and bp.nan not in origins)


class ReplayBreakpoints:
    """A recording's breakpoints, answering the job's breakpoint commands (``break_add``,
    ``break_enable``, ``break_delete``, ``break_list``, ``state``) the way a job does: the
    reply ``{"state": {"paused": None, "mode": None, "breakpoints": [...]}}`` that
    ``StepperView.on_state`` reads. So the ``b`` and ``B`` screens work on a replay when its
    source answers these commands here instead of refusing them. Raises BreakpointError
    (one line) as the job does."""

    COMMANDS = ("break_add", "break_enable", "break_delete", "break_list", "state")

    def __init__(self) -> None:
        self.breakpoints: dict[int, Breakpoint] = {}
        self._next = 1

    def answer(self, cmd: str, fields: dict[str, Any]) -> dict[str, Any]:
        if cmd == "break_add":
            spec = {k: v for k, v in fields.items() if v is not None and k in Breakpoint.KEYS}
            bp = Breakpoint.from_spec(self._next, spec)
            self._next += 1
            self.breakpoints[bp.id] = bp
        elif cmd in ("break_enable", "break_delete"):
            bp_id = fields.get("bp")
            if bp_id not in self.breakpoints:
                raise BreakpointError(f"no breakpoint {bp_id}")
            if cmd == "break_delete":
                del self.breakpoints[bp_id]
            else:
                self.breakpoints[bp_id].enabled = bool(fields.get("enabled", True))
        elif cmd not in ("break_list", "state"):
            raise ValueError(f"command '{cmd}' is not supported by a recording")
        return {"state": self.state()}

    def state(self) -> dict[str, Any]:
        return {"paused": None, "mode": None, "breakpoints": self.as_dicts()}

    def as_dicts(self) -> list[dict[str, Any]]:
        return [bp.to_dict() for bp in self.breakpoints.values()]


# -- the cursor ------------------------------------------------------------------------------

#: The keys and the moves they make (``ReplayCursor.move(key)``).
KEYS = {
    "s": "step",
    "S": "step_back",
    "n": "next",
    "N": "prev",
    "c": "cont",
    "C": "cont_back",
}


class ReplayCursor:
    """The paused position in a recording and the moves from it. Touched on the UI thread.

    ``position`` is None until something places it (:meth:`place`, :meth:`open`, a move):
    then forward moves start before the first event and backward ones after the last.
    Breakpoints: :meth:`set_breakpoints` with the specs the UI holds.
    """

    def __init__(
        self, store: EventStore, breakpoints: Iterable[dict[str, Any] | Breakpoint] = ()
    ) -> None:
        self.store = store
        self.position: Position | None = None
        self.breakpoints: list[Breakpoint] = []
        self._specs: list[Any] = []
        self._resume: tuple[str, Position | None, int] | None = None  # (move, from, step)
        self._origins_seen = -1
        self._origins: dict[int, dict[int, Event]] = {}  # step -> event_seq -> alert
        self.set_breakpoints(breakpoints)

    # -- setting -------------------------------------------------------------------------
    def set_breakpoints(self, specs: Iterable[dict[str, Any] | Breakpoint]) -> None:
        """The breakpoints ``c``/``C`` stop at (disabled ones are ignored). Raises
        BreakpointError for a spec that cannot work."""
        specs = list(specs)
        if specs != self._specs:
            self.breakpoints = _compile(specs)
            self._specs = specs
            self._resume = None

    def place(self, step: int, kind: str, seq: int) -> Landed:
        """Pause here (space on the selected row; a jump the user made)."""
        self.position = Position(step, kind if kind in (OP, GRAD, ATEN) else OP, seq)
        self._resume = None
        return Landed(self.position, "paused")

    def open(self) -> Landed | None:
        """Place the cursor at the recording's first NaN/Inf origin (see :func:`first_origin`);
        None (and the cursor unchanged) when there is none."""
        landed = first_origin(self.store)
        if landed is not None:
            self.position = landed.position
            self._resume = None
        return landed

    def move(self, key: str) -> Result:
        """The move a key makes (:data:`KEYS`)."""
        return getattr(self, KEYS[key])()

    # -- single moves --------------------------------------------------------------------
    def step(self) -> Result:
        """``s``: the next op or node (see the module's table)."""
        return self._single(True)

    def step_back(self) -> Result:
        """``S``: the previous op or node."""
        return self._single(False)

    def _single(self, forward: bool) -> Result:
        pos = self.position
        reason = "step" if forward else "step back"
        if pos is not None:
            data = self.store.data(pos.step)
            if data is None:
                return self._need(pos.step)
            for t in _walk(data, pos, forward, calls=False):
                return self._land(Landed(_pos(pos.step, t), reason))
        for step in self._steps_from(pos, forward, include=pos is None):
            rows = self._rows_of(step)
            if isinstance(rows, NeedStep):
                return rows
            if rows is not None:
                t = rows.rows[0] if forward else rows.rows[-1]
                return self._land(Landed(_pos(step, t), reason))
        return Stay("at the end of the recording" if forward else "at the start of the recording")

    def next(self) -> Result:
        """``n``: the first row of the next step that has one."""
        return self._step_start(True)

    def prev(self) -> Result:
        """``N``: the first row of the previous step that has one."""
        return self._step_start(False)

    def _step_start(self, forward: bool) -> Result:
        pos = self.position
        include = pos is None and forward
        for step in self._steps_from(pos, forward, include=include):
            data = self._rows_of(step)
            if isinstance(data, NeedStep):
                return data
            if data is not None:
                reason = "next step" if forward else "previous step"
                return self._land(Landed(_pos(step, data.rows[0]), reason))
        if forward:
            return Stay("no step after this one: this is the last")
        return Stay("no step before this one: this is the first")

    # -- continue ------------------------------------------------------------------------
    def cont(self) -> Result:
        """``c``: the next breakpoint hit; the end of the recording without one."""
        return self._cont(True)

    def cont_back(self) -> Result:
        """``C``: the previous breakpoint hit; the start of the recording without one."""
        return self._cont(False)

    def _cont(self, forward: bool) -> Result:
        bps = self.breakpoints
        if not bps:
            return self._to_edge(forward, "no breakpoint")
        move = "cont" if forward else "cont_back"
        pos = self.position
        resume = self._resume
        self._resume = None
        from_step: int | None = None
        if resume is not None and resume[0] == move and resume[1] == pos:
            from_step = resume[2]  # the steps before it were scanned: nothing there
        calls = any(_hits_calls(bp) for bp in bps)
        for step in self._steps_from(pos, forward, include=True):
            if from_step is not None and (step < from_step if forward else step > from_step):
                continue
            here = pos is not None and step == pos.step
            if not here and not self._may_hit(step):
                continue
            data = self.store.data(step)
            if data is None:
                if self._gone(step):
                    continue
                self._resume = (move, pos, step)
                return NeedStep(step)
            hit = self._scan(data, pos if here else None, forward, calls)
            if hit is not None:
                return self._land(hit)
        return self._to_edge(forward, "no breakpoint hit " + ("after" if forward else "before"))

    def _to_edge(self, forward: bool, why: str) -> Result:
        """The last row of the recording (the first, backwards), saying ``why``."""
        where = "end" if forward else "start"
        for step in self._steps_from(None, not forward, include=True):
            data = self._rows_of(step)
            if isinstance(data, NeedStep):
                return data
            if data is None:
                continue
            t = data.rows[-1] if forward else data.rows[0]
            target = _pos(step, t)
            if target == self.position:
                return Stay(f"{why}: at the {where} of the recording")
            return self._land(Landed(target, where, f"{why}: at the {where} of the recording"))
        return Stay("the recording has no op or node")

    def _scan(
        self, data: StepData, start: Position | None, forward: bool, calls: bool
    ) -> Landed | None:
        """The first event of ``data`` after ``start`` (before it, backwards) a breakpoint
        hits, as a live job judges it at its after point (name and line conditions, which a
        job checks before the event, hold after it as well)."""
        step = data.step
        bps = [bp for bp in self.breakpoints if _may_hit_in(bp, step, None)]
        if not bps:
            return None
        origins = self._origins_in(data)
        calls = calls and bool(data.aten)
        values = any(bp.needs_stats for bp in bps)
        norms = any(bp.grad_norm is not None for bp in bps)
        # Breakpoints that all want where a value first appears hit nowhere else.
        only_origins = all(bp.nan in ("nan", "inf") for bp in bps)
        seen: dict[tuple, bool] = {}  # static verdicts by (kind, name, module, source)
        module_of = data.module_of
        for t in _walk(data, start, forward, calls):
            if only_origins and t[SEQ] not in origins:
                continue
            kind = t[KIND]
            if kind == ATEN:
                parent = data.aten_parent(t)
                module = t[MODULE] or (module_of(parent) if parent is not None else "")
            else:
                module = module_of(t)
            key = (kind, t[NAME], module, t[SOURCE])
            verdict = seen.get(key)
            if verdict is False:
                continue
            ev = {
                "kind": kind,
                "seq": t[SEQ],
                "step": step,
                "node" if kind == GRAD else "name": t[NAME],
                "module": module,
                "source": t[SOURCE],
            }
            if verdict is None:
                verdict = seen[key] = any(bp.static_match(ev) for bp in bps)
            if not verdict:
                continue
            if values:
                flags = t[FLAGS]
                out = {
                    "nan": int(bool(flags & FLAG_NAN_OUT)),
                    "inf": int(bool(flags & FLAG_INF_OUT)),
                }
                ev["grad_inputs" if kind == GRAD else "outputs"] = [{"stats": out}]
                if norms and kind == GRAD:
                    full = self.store.event(t)
                    ev["grad_inputs"] = full.get("grad_inputs")
                    ev["grad_outputs"] = full.get("grad_outputs")
            alert = origins.get(t[SEQ])

            def origin(_: dict, alert: Event | None = alert) -> str | None:
                return None if alert is None else str(alert.get("what"))

            reason = first_hit(bps, BEFORE, ev, origin) or first_hit(bps, AFTER, ev, origin)
            if reason is None:
                continue
            return Landed(_pos(step, t), reason, self._note(reason, alert))
        return None

    def _note(self, reason: str, alert: Event | None) -> str:
        """What a hit says: the alert's words at a NaN/Inf origin, else the condition."""
        bp = next((b for b in self.breakpoints if reason == f"breakpoint {b.id}"), None)
        if bp is None:
            return reason
        if alert is not None and bp.nan in ("nan", "inf"):
            return str(alert.get("message") or reason)
        return f"{reason}: {spec_text(bp.to_dict())}"
        return None

    # -- steps ---------------------------------------------------------------------------
    def _steps_from(self, pos: Position | None, forward: bool, *, include: bool) -> list[int]:
        """The recording's steps from ``pos``'s (itself when ``include``) on, in the
        direction of the move; all of them when ``pos`` is None."""
        order = self.store.order
        if pos is None:
            return list(order) if forward else order[::-1]
        if forward:
            i = (
                bisect.bisect_left(order, pos.step)
                if include
                else bisect.bisect_right(order, pos.step)
            )
            return order[i:]
        i = bisect.bisect_right(order, pos.step) if include else bisect.bisect_left(order, pos.step)
        return order[:i][::-1]

    def _gone(self, step: int) -> bool:
        """Not in memory and nothing can bring it back (a live job's evicted step)."""
        info = self.store.info(step)
        return info is None or info.state == EVICTED

    def _rowless(self, step: int) -> bool:
        """The counts say the step has no op or node (known once it is counted)."""
        info = self.store.info(step)
        return info is not None and info.counted and not (info.n_ops or info.n_grads)

    def _may_hit(self, step: int) -> bool:
        """Whether any breakpoint may hit in ``step``, from what is known without its
        events: its counts and its alerts (those of a counted step are all known)."""
        if self._rowless(step):
            return False
        store = self.store
        info = store.info(step)
        known = (
            info is not None
            and (info.counted or store.is_resident(step))
            and len(store.alerts) < store.max_alerts
        )
        kinds = {str(a.get("what")) for a in self._step_origins(step).values()} if known else None
        return any(_may_hit_in(bp, step, kinds) for bp in self.breakpoints)

    def _step_origins(self, step: int) -> dict[int, Event]:
        alerts = self.store.alerts
        if self._origins_seen != len(alerts):
            index: dict[int, dict[int, Event]] = {}
            for a in _origin_alerts(alerts):
                index.setdefault(a["step"], {}).setdefault(a["event_seq"], a)
            self._origins, self._origins_seen = index, len(alerts)
        return self._origins.get(step, {})

    def _origins_in(self, data: StepData) -> dict[int, Event]:
        """The step's origins by the seq of the event a live ``nan`` breakpoint stops at:
        the aten call that made the value when it is shown, else the op or node."""
        out: dict[int, Event] = {}
        for seq, a in self._step_origins(data.step).items():
            call = a.get("aten_seq")
            if type(call) is int:
                t = data.aten.get(call)
                if t is not None and data.aten_parent(t) is not None:
                    seq = call
            out.setdefault(seq, a)
        return out

    def _rows_of(self, step: int) -> StepData | NeedStep | None:
        """The step's events when it has rows; None to pass it by (no row, or gone for
        good); NeedStep when it must be loaded first."""
        if self._rowless(step):
            return None
        data = self.store.data(step)
        if data is None:
            return None if self._gone(step) else self._need(step)
        return data if data.rows else None

    # -- answers -------------------------------------------------------------------------
    def _need(self, step: int) -> NeedStep:
        self._resume = None
        return NeedStep(step)

    def _land(self, landed: Landed) -> Landed:
        self.position = landed.position
        self._resume = None
        return landed
