"""Step-through control: pause the training thread at ops and nodes, breakpoints, the lease.

The training thread calls :meth:`Stepper.at_point` at four kinds of places: before and after
each forward op (inside the mode) and before and after each backward node (inside its pre-
and post-hook). When the stepper decides to pause, that thread blocks right there until the UI
says continue, step or next, or until the UI stops heartbeating for ``lease_seconds``: a job
never stays paused because its UI died.

Everything the UI calls (``request_*``, breakpoints, ``inspect``) runs on the control thread
and only touches state under ``self._cv``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchscope.analysis.render import short_source
from torchscope.protocol.breakpoints import (
    AFTER,
    Breakpoint,
    BreakpointError,
    action_hits,
    first_hit,
)
from torchscope.protocol.events import ATEN
from torchscope.protocol.expressions import ExpressionError
from torchscope.tracer.armed.interrupt import CANCELLED, EVAL_BUDGET_S, Run, check_budget
from torchscope.tracer.ranks import RankPauses, say, waiting

# What the training thread does next when it is not paused.
RUN = "run"  # until a breakpoint or a pause request
PAUSE = "pause"  # at the next point
STEP = "step"  # at the next "after" point: one op or node, complete
NEXT = "next"  # at the first point of a later training step

MAX_INSPECT = 100_000
# Why an expression a UI asked for was interrupted (or refused before it ran).
ASKER_WENT = "its asker let go"
NO_UI = "no UI is attached any more"
# A breakpoint that paused with no UI attached and ran out its lease pauses again at most
# this often while still nobody is attached (a NaN in every step must not stall the job).
UNATTENDED_QUIET_SECONDS = 60.0


def _cause(reason: str) -> str:
    """What stopped a pause, for its stderr line: ``by breakpoint 2 (op:...)``; a UI's own
    pause request (reason ``paused``) reads ``at a UI's request``, not ``by paused``."""
    return "at a UI's request" if reason == "paused" else f"by {reason}"


@dataclass
class PausePoint:
    """Where the training thread is blocked: the event and the live tensors behind it."""

    phase: str
    event: dict[str, Any]
    tensors: dict[str, list[Any]]  # "inputs"/"outputs" or "grad_outputs"/"grad_inputs"
    stack: list[tuple[str, int, str]]
    reason: str
    since: float = field(default_factory=time.time)
    owner: Any = None  # the UI whose request or breakpoint stopped here; None: command line
    # Runs expressions and edits on the training thread (tracer/armed/evaluate.py); None
    # where this pause cannot (an aten call's).
    evaluator: Any = None
    # The breakpoint that stopped here, as set (its spec): a UI that has not yet read the
    # job's list of breakpoints still tells a NaN breakpoint's pause from another's.
    breakpoint: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        described = {
            "phase": self.phase,
            "event": self.event,
            "reason": self.reason,
            "stack": [list(f) for f in self.stack],
            "since": self.since,
            "by": "command line" if self.owner is None else "a UI",
        }
        if self.breakpoint is not None:
            described["breakpoint"] = self.breakpoint
        return described

    def where(self) -> str:
        ev = self.event
        name = ev.get("name") or ev.get("node") or "?"
        if ev.get("kind") == ATEN and (ev.get("node") or ev.get("op")):
            name += f" inside {ev.get('node') or ev.get('op')}"  # the node, or the op it runs for
        source = short_source(ev.get("source"))  # as the job's own messages name it
        return f"{name} ({self.phase}){f' at {source}' if source else ''}"


def _no_origin(event: dict[str, Any]) -> None:
    return None


# What ended a pause a UI held, as the job says it on stderr (the lease says its own).
_RESUMED_BY = {
    "continue": "the UI continued",
    "detach": "the UI detached",
    "left": "the UI that held the pause went",
}


# Owns the breakpoints of ``on_nan="pause"`` in traced steps (the NaN watch's pause points).
WATCH_OWNER = "the NaN watch"


class Stepper:
    def __init__(
        self,
        *,
        lease_seconds: float = 10.0,
        wait_for_ui: bool = False,
        hold: bool = False,
        attach_hint: str = "",
        note: Callable[[str], None] | None = None,
        job_ui: Any = None,
        eval_budget: float = EVAL_BUDGET_S,
    ) -> None:
        self.lease_seconds = lease_seconds
        # Seconds an expression (a UI's, a logpoint's) runs before it is interrupted.
        self.eval_budget = check_budget(eval_budget)
        # --hold: a pause with no UI attached waits for one instead of resuming after the lease.
        self.hold = hold
        self.attach_hint = attach_hint  # "attach: torchscope tui PID", said with every wait
        self._note = note or say
        # --wait under torchrun: a UI on any rank of the job lets this one go (ranks.JobUiSignal)
        self.job_ui = job_ui
        self.pg_timeout: Callable[[], float | None] | None = None  # multi-rank jobs: ranks.py
        self._pauses: RankPauses | None = None  # where this rank is paused, for the others
        self._paused_since = 0.0
        self._cv = threading.Condition()
        self._mode = PAUSE if wait_for_ui else RUN
        self._next_after_step: int | None = None
        self._waiting_for_ui = wait_for_ui
        self._attached = False
        self._last_contact = 0.0
        self._contacts: dict[Any, float] = {}  # each UI's last message (its own lease)
        self._request_owner: Any = None  # who asked for the pending pause / step / next
        self._quiet_until: dict[int, float] = {}  # breakpoint id -> rate-limited until
        self._quiet_said = False
        self._resume_reason: str | None = None
        self._next_id = 1
        self.breakpoints: dict[int, Breakpoint] = {}
        # Who set each breakpoint (a UI's client id; None: the command line): it goes with them.
        self.owners: dict[int, Any] = {}
        self.paused: PausePoint | None = None
        self._in_aten = False  # the last pause was at an aten call: a step goes to the next
        # A nan/inf breakpoint stopped at the aten call that made the value: the op or node
        # it ran for (the next one to finish) is not stopped at again for the same value.
        self._origin_stopped_inside = False
        self.auto_resumed = 0
        # Expressions and edits a UI asked for at the pause, run by the paused thread
        # (run_at_pause); the latest few kept by id for a client polling a slow one.
        self._tasks: list[Task] = []
        self._running: Task | None = None  # the one the training thread runs now
        self._done: dict[int, Task] = {}
        self._task_ids = 1
        # Who may run expressions in the job (a client id -> None, or why not): the agent
        # says "a client that holds the job"; a trace(live=True) block, a UI that talks to it.
        self.may_evaluate: Callable[[Any], str | None] = self._talks
        # Breakpoints with an action (log, edit), asked after each op and node while any is on.
        self.actions: list[Breakpoint] = []
        # Read on every op by the training thread: a plain attribute, kept current under _cv.
        self.active = self._mode != RUN

    def _refresh(self) -> None:
        self.active = self._mode != RUN or any(bp.enabled for bp in self.breakpoints.values())
        self.actions = [bp for bp in self.breakpoints.values() if bp.enabled and bp.action]

    # -- what the training thread asks ---------------------------------------------------
    def needs_stats(self, event: dict[str, Any]) -> bool:
        """Whether deciding at this after point needs the event's numbers now (a sync)."""
        return any(
            bp.enabled and bp.needs_stats and bp.static_match(event)
            for bp in list(self.breakpoints.values())
        )

    def should_pause(
        self,
        phase: str,
        event: dict[str, Any],
        origin: Callable[[dict], str | None] = lambda e: None,
        *,
        pause_here: bool = True,
    ) -> str | None:
        """The reason to pause at this point, or None. ``origin(event)`` gives the alert
        verdict ("nan"/"inf"/None) once the event's numbers are resolved. ``pause_here``
        False: a UI's pause waits for a later point (breakpoints and steps still stop)."""
        mode = self._mode
        if mode == PAUSE and not pause_here:
            mode = RUN
        if event.get("kind") == ATEN and not (mode == STEP and self._in_aten):
            # Inside an op or node only an aten: breakpoint stops, and a step from where one
            # stopped; a pause or a step from an op or node stops at the next op or node.
            mode = RUN
        if mode == PAUSE:
            return "waiting for a UI" if self._waiting_for_ui else "paused"
        if mode == STEP and phase == AFTER:
            return "step"
        if mode == NEXT and event.get("step", 0) > (self._next_after_step or 0):
            return "next step"
        bps = list(self.breakpoints.values())
        if self._quiet_until:
            now = time.monotonic()
            bps = [bp for bp in bps if self._quiet_until.get(bp.id, 0.0) <= now]
        if phase == AFTER and self._origin_stopped_inside and event.get("kind") != ATEN:
            self._origin_stopped_inside = False
            origin = _no_origin
        return first_hit(bps, phase, event, origin)

    def pause_asked(self) -> bool:
        """Whether a UI's pause waits for the next point (a plain read: asked while waiting)."""
        return self._mode == PAUSE

    def action_hits(
        self, event: dict[str, Any], origin: Callable[[dict], str | None] = lambda e: None
    ) -> list[Breakpoint]:
        """The breakpoints with an action that hold at this event (after it ran)."""
        return action_hits(list(self.actions), event, origin)

    def origin_stopped_inside(self) -> None:
        """The pause just ended was at the aten call where a NaN/Inf first appears."""
        self._origin_stopped_inside = True

    def at_point(self, point: PausePoint) -> str:
        """Block the calling (training) thread until the UI lets it go or the lease ends.

        Returns what resumed it: "continue", "step", "next", "detach", "attached" (--wait:
        a UI came), "left" (the UI that owned the pause went) or "lease".
        """
        pauses = self._rank_pauses()
        if pauses is None:
            return self._at_point(point)
        # Under torchrun the other ranks learn where this one is paused (ranks.RankPauses):
        # one that waits for it says so at once.
        pauses.tell(f"{point.where()}, step {point.event.get('step', '?')}")
        try:
            return self._at_point(point)
        finally:
            pauses.tell(None)

    def _rank_pauses(self) -> RankPauses | None:
        """The job's record of paused ranks (multi-rank jobs, once the process group exists)."""
        if self.pg_timeout is None:
            return None
        if self._pauses is None:
            self._pauses = RankPauses.for_job()
        return self._pauses

    def _at_point(self, point: PausePoint) -> str:
        told = False
        with self._cv:
            self._in_aten = point.event.get("kind") == ATEN
            point.owner = self._owner_of(point.reason)
            self._mode = RUN  # the step/next/pause request that brought us here is used up
            self._next_after_step = None
            self._request_owner = None
            self._resume_reason = None
            # Said before the pause shows: whoever sees the job paused can read why.
            if self._waiting_for_ui:
                if not self._attached:
                    hint = f"; {self.attach_hint}" if self.attach_hint else ""
                    job = " (on any rank of this job)" if self.job_ui is not None else ""
                    self._note(f"waiting for a UI{job} before the first op (--wait){hint}")
            elif not self._attached:
                self._say_unattended(point)
            elif point.reason not in ("step", "next step"):
                # A UI holds it: said once per pause, not at every op the UI steps over.
                told = True
                self._note(f"paused at {point.where()} {_cause(point.reason)} (a UI holds it)")
            self.paused = point
            self._paused_since = time.monotonic()
            if self._waiting_for_ui:
                # --wait: like debugpy's --wait-for-client, the job waits for a UI to connect,
                # then runs until a breakpoint or a pause.
                elsewhere = False
                while not self._attached and self._resume_reason is None and not elsewhere:
                    self._cv.wait(0.5)
                    elsewhere = self.job_ui is not None and self.job_ui.came()
                self._waiting_for_ui = False
                if self._attached and self.job_ui is not None:
                    self.job_ui.announce()
                if elsewhere and not self._attached:
                    self._note("a UI reached another rank of this job: going on")
                if self._resume_reason is None:
                    self._resume_reason = "attached"
            elif not self._attached:
                while self.hold and not self._attached and self._resume_reason is None:
                    self._cv.wait(0.5)
            start = time.monotonic()
            while self._resume_reason is None:
                if self._tasks:
                    self._run_tasks()
                    continue
                left = self.lease_seconds - (time.monotonic() - self._lease_since(point, start))
                if left <= 0:
                    self._lease_ended(point)
                    break
                self._cv.wait(min(left, 0.5))
            # Set by whoever ended the wait (a command, the lease): never None here.
            reason, self._resume_reason = self._resume_reason or "lease", None
            self._refuse_tasks("the job went on before it ran")
            if told and reason in _RESUMED_BY:
                self._note(f"resumed: {_RESUMED_BY[reason]}")
            self.paused = None
            self._refresh()
            return reason

    # -- expressions at the pause (the training thread runs them) ----------------------------
    def _run_tasks(self) -> None:
        """Run the next thing a UI asked at this pause, without the lock (a UI's ping, a
        cancel, its going away must get through while an expression runs). A task's owner
        counts as talking until it is done: a slow expression does not end the lease of the
        pause it runs at; its budget, a cancel or its owner letting go interrupt it."""
        task = self._tasks.pop(0)
        self._running = task
        self._cv.release()
        try:
            task.run()
        finally:
            self._cv.acquire()
            self._running = None
        now = time.monotonic()
        self._last_contact = max(self._last_contact, now)
        if task.owner is not None and task.owner in self._contacts:
            self._contacts[task.owner] = now
        self._cv.notify_all()

    def _stop_tasks(self, why: str, owner: Any = None, everyone: bool = False) -> None:
        """Called under the lock: ``owner``'s expressions (``everyone``: every UI's) go,
        those waiting refused, the one running interrupted."""

        def theirs(task: Task | None) -> bool:
            return task is not None and task.owner is not None and (everyone or task.owner == owner)

        mine = [t for t in self._tasks if theirs(t)]
        for task in mine:
            self._tasks.remove(task)
            task.refuse(f"{why} before it ran")
        running = self._running
        if running is not None and theirs(running):
            running.cancel(why)

    def cancel_task(self, task_id: int, owner: Any) -> Task:
        """``owner`` cancels its expression ``task_id``: refused if it has not started,
        interrupted if it runs (its answer says "interrupted after N s")."""
        with self._cv:
            task = self._done.get(task_id)
            if task is None or task.owner != owner:
                raise BreakpointError(f"no expression {task_id} of yours to cancel")
            if task in self._tasks:
                self._tasks.remove(task)
                task.refuse("cancelled before it ran")
            elif not task.finished.is_set():
                task.cancel(CANCELLED)
        return task

    def _refuse_tasks(self, why: str) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.refuse(why)

    def _talks(self, client: Any) -> str | None:
        if client is None or client in self._contacts:
            return None
        return "expressions run only for a UI attached to this job"

    def run_at_pause(
        self,
        what: Callable[[PausePoint], dict[str, Any]],
        owner: Any,
        wait: float,
        control: Run | None = None,
    ) -> Task:
        """Have the paused training thread run ``what(point)``; wait up to ``wait`` seconds
        for it (the task says whether it is done). ``control``: what interrupts it (its
        budget; a cancel, its owner going). Raises BreakpointError (one line) when the job
        is not paused, or the pause cannot run expressions."""
        with self._cv:
            point = self.paused
            if point is None:
                raise BreakpointError("the job is not paused: expressions run at a pause")
            if point.evaluator is None:
                raise BreakpointError("expressions cannot run at this pause (an aten call)")
            task = Task(self._task_ids, what, point, owner, control)
            self._task_ids += 1
            self._tasks.append(task)
            self._done[task.id] = task
            while len(self._done) > 16:
                self._done.pop(next(iter(self._done)))
            self._cv.notify_all()
        task.finished.wait(wait)
        return task

    def task(self, task_id: int) -> Task:
        with self._cv:
            task = self._done.get(task_id)
        if task is None:
            raise BreakpointError(f"no expression {task_id} (answers are kept for a while only)")
        return task

    def owner_of(self, reason: str) -> Any:
        """Who owns the breakpoint a pause ``reason`` names (None for others)."""
        return self._owner_of(reason)

    def breakpoint_of(self, reason: str) -> dict[str, Any] | None:
        """The spec of the breakpoint a pause ``reason`` names (None for other reasons)."""
        if not reason.startswith("breakpoint "):
            return None
        with self._cv:
            bp = self.breakpoints.get(int(reason.split()[1]))
            return bp.to_dict() if bp is not None else None

    def _owner_of(self, reason: str) -> Any:
        if reason.startswith("breakpoint "):
            return self.owners.get(int(reason.split()[1]))
        return self._request_owner

    def _lease_since(self, point: PausePoint, start: float) -> float:
        """A UI's pause lasts while that UI talks; the command line's while any UI does."""
        if not self._attached:
            return start
        if point.owner is not None and point.owner in self._contacts:
            return max(self._contacts[point.owner], start)
        return max(self._last_contact, start)

    def _say_unattended(self, point: PausePoint) -> None:
        then = "waits for a UI (--hold)" if self.hold else f"resumes in {self.lease_seconds:g} s"
        parts = [f"paused at {point.where()} {_cause(point.reason)}", self.attach_hint, then]
        self._note("; ".join(p for p in parts if p))

    def _lease_ended(self, point: PausePoint) -> None:
        self.auto_resumed += 1
        who = "its UI stopped responding" if self._attached else "no UI is attached"
        self._note(f"paused job resumed by itself after {self.lease_seconds:g} s: {who}")
        if not self._attached and point.reason.startswith("breakpoint "):
            bp_id = int(point.reason.split()[1])
            self._quiet_until[bp_id] = time.monotonic() + UNATTENDED_QUIET_SECONDS
            if not self._quiet_said:
                self._quiet_said = True
                self._note(
                    f"with no UI attached, breakpoint {bp_id} pauses again at most once "
                    f"every {UNATTENDED_QUIET_SECONDS:g} s until a UI attaches"
                )
        self._attached = False
        self._resume_reason = "lease"

    # -- what the UI asks (control thread) -------------------------------------------------
    def contact(self, client: Any = None) -> None:
        """Any message from a UI: it is alive (renews the lease of its pauses)."""
        with self._cv:
            self._attached = True
            self._last_contact = time.monotonic()
            if client is not None:
                self._contacts[client] = self._last_contact
            self._quiet_until.clear()  # someone is here: breakpoints fire as set
            self._cv.notify_all()

    def request_pause(self, owner: Any = None) -> None:
        with self._cv:
            if self.paused is None:
                self._mode = PAUSE
                self._request_owner = owner
                self._refresh()

    def request_continue(self, owner: Any = None) -> None:
        self._resume(RUN, "continue", owner)

    def request_step(self, owner: Any = None) -> None:
        self._resume(STEP, "step", owner)

    def request_next(self, current_step: int, owner: Any = None) -> None:
        with self._cv:
            self._next_after_step = current_step
        self._resume(NEXT, "next", owner)

    def _resume(self, mode: str, why: str, owner: Any = None) -> None:
        with self._cv:
            self._mode = mode
            self._request_owner = owner if mode != RUN else None
            if self.paused is not None:
                self._resume_reason = why
            self._refresh()
            self._cv.notify_all()

    def detach(self) -> None:
        """The UI leaves: forget every breakpoint and let the job run."""
        with self._cv:
            self.breakpoints.clear()
            self.owners.clear()
            self.detach_uis()

    def detach_uis(self) -> None:
        """The last UI left: what it asked for (a pause, a step, waiting for it) ends and a
        pause it was looking at resumes; the command line's breakpoints stay."""
        with self._cv:
            self._attached = False
            self._waiting_for_ui = False
            self._stop_tasks(NO_UI, everyone=True)
            self._mode = RUN
            self._next_after_step = None
            if self.paused is not None:
                self._resume_reason = "detach"
            self._refresh()
            self._cv.notify_all()

    def add_breakpoint(self, spec: dict[str, Any], owner: Any = None) -> dict[str, Any]:
        with self._cv:
            bp = Breakpoint.from_spec(self._next_id, spec)
            self._next_id += 1
            self.breakpoints[bp.id] = bp
            self.owners[bp.id] = owner
            self._refresh()
            return bp.to_dict()

    def release(self, owner: Any) -> int:
        """A UI left: its breakpoints go, what it asked for ends, and a pause it owns
        resumes. Returns how many breakpoints went."""
        with self._cv:
            gone = [i for i, o in self.owners.items() if o == owner and i in self.breakpoints]
            for i in gone:
                del self.breakpoints[i]
                del self.owners[i]
            self._contacts.pop(owner, None)
            if owner is not None:
                self._stop_tasks(ASKER_WENT, owner)
            if self._request_owner == owner and self._request_owner is not None:
                self._mode = RUN
                self._request_owner = None
                self._next_after_step = None
            if self.paused is not None and self.paused.owner == owner and owner is not None:
                self._resume_reason = "left"
            self._refresh()
            self._cv.notify_all()
            return len(gone)

    def set_enabled(self, bp_id: int, enabled: bool) -> dict[str, Any]:
        with self._cv:
            bp = self._get(bp_id)
            bp.enabled = enabled
            self._refresh()
            return bp.to_dict()

    def delete_breakpoint(self, bp_id: int) -> None:
        with self._cv:
            self._get(bp_id)
            del self.breakpoints[bp_id]
            self.owners.pop(bp_id, None)
            self._refresh()

    def _get(self, bp_id: int) -> Breakpoint:
        bp = self.breakpoints.get(bp_id)
        if bp is None:
            raise BreakpointError(f"no breakpoint {bp_id}")
        return bp

    def state(self) -> dict[str, Any]:
        with self._cv:
            paused = self.paused
            out = {
                "paused": paused.describe() if paused is not None else None,
                "mode": self._mode,
                "breakpoints": [bp.to_dict() for bp in self.breakpoints.values()],
                "auto_resumed": self.auto_resumed,
                "lease_s": self.lease_seconds,
                "hold": self.hold,
                "eval_budget_s": self.eval_budget,
            }
            if paused is not None:
                out["paused_s"] = round(time.monotonic() - self._paused_since, 3)
        if self.pg_timeout is not None:
            # How long the other ranks may wait in a collective: what a pause is measured against.
            out["pg_timeout_s"] = self.pg_timeout()
            wait = waiting()
            if wait is not None:  # this rank waits for the others before a collective
                out["waiting"] = wait
        return out

    def inspect(self, group: str, index: int, start: int = 0, count: int = 1000) -> dict[str, Any]:
        """Values of one tensor at the pause point: flat slice ``[start, start+count)``."""
        with self._cv:
            point = self.paused
            if point is None:
                raise BreakpointError("the job is not paused")
            tensors = point.tensors.get(group)
            if tensors is None:
                have = ", ".join(point.tensors) or "nothing"
                raise BreakpointError(f"no {group!r} at this point (have {have})")
            if not 0 <= index < len(tensors):
                raise BreakpointError(f"{group} has {len(tensors)} tensors, not index {index}")
            t = tensors[index]
        if t is None:
            return {"group": group, "index": index, "values": None}
        return _slice_values(t, group, index, start, max(0, min(count, MAX_INSPECT)))


class Task:
    """An expression or edit a UI asked for at a pause, run by the paused training thread."""

    def __init__(
        self,
        task_id: int,
        what: Callable[[PausePoint], dict[str, Any]],
        point: PausePoint,
        owner: Any,
        control: Run | None = None,
    ) -> None:
        self.id = task_id
        self._what = what
        self.point = point
        self.owner = owner
        self.control = control  # interrupts it (tracer/armed/interrupt.py)
        self.since = time.monotonic()
        self.finished = threading.Event()
        self.result: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.result = self._what(self.point)
        except (BreakpointError, ExpressionError) as exc:  # refused in one line (a wrong shape)
            self.error = str(exc)
        except Exception as exc:  # never into the job: one line
            self.error = f"internal error: {type(exc).__name__}: {exc}"
        self.finished.set()

    def refuse(self, why: str) -> None:
        self.error = why
        self.finished.set()

    def cancel(self, why: str) -> None:
        """Interrupt it as it runs (its answer: "interrupted after N s (why)")."""
        if self.control is not None:
            self.control.cancel(why)

    def answer(self) -> dict[str, Any]:
        """The reply: the result, or ``pending`` while the job still runs it. Raises
        BreakpointError with a refusal's one line."""
        if not self.finished.is_set():
            took = time.monotonic() - self.since
            return {
                "pending": self.id,
                "text": f"still running after {took:.0f} s (the job is busy with it; "
                "the pause holds)",
            }
        if self.error is not None:
            raise BreakpointError(self.error)
        return self.result or {}


# How long a control reply waits for an expression before it answers "pending" (the control
# thread serves every UI: it must not sit on one expression).
EVALUATE_WAIT_S = 1.0

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


def stepping_commands(stepper: Stepper, current_step: Callable[[], int]) -> dict[str, Handler]:
    """Control commands of step-through debugging, for a publisher's ``commands`` table.

    Handlers run on the publisher's thread and take (args, client): the client id of the UI
    that asked. Every reply carries the stepper's state and the step the job is in.
    """

    def answer(action: Callable[[dict[str, Any], Any], Any]) -> Handler:
        def handle(args: dict[str, Any], client: Any) -> dict[str, Any]:
            action(args, client)
            return {"state": stepper.state(), "step": current_step()}

        return handle

    def add(args: dict[str, Any], client: Any) -> None:
        if args.get("log") is not None or args.get("edit") is not None:
            refused = stepper.may_evaluate(client)
            if refused is not None:
                raise BreakpointError(refused)
        stepper.add_breakpoint({k: v for k, v in args.items() if v is not None}, owner=client)

    def at_pause(name: str) -> Handler:
        """``evaluate`` / ``edit``: run on the paused thread by its evaluator, for a client
        that may (see ``Stepper.may_evaluate``); ``poll`` asks again for a slow one."""

        def handle(args: dict[str, Any], client: Any) -> dict[str, Any]:
            if args.get("poll") is not None:  # its asker's, even after it let go of the job
                task = stepper.task(args["poll"])
                if task.owner != client:
                    raise BreakpointError(f"no expression {args['poll']} of yours")
                return task.answer()
            refused = stepper.may_evaluate(client)
            if refused is not None:
                raise BreakpointError(refused)
            if args.get("cancel") is not None:
                task = stepper.cancel_task(args["cancel"], client)
                task.finished.wait(EVALUATE_WAIT_S)  # a Python loop stops within milliseconds
                return task.answer()
            if not args.get("expr"):
                raise BreakpointError("an expression, please")  # the reply names the command
            budget = args.get("budget")
            try:
                budget = stepper.eval_budget if budget is None else check_budget(budget, "budget")
            except (TypeError, ValueError) as exc:
                raise BreakpointError(str(exc)) from None
            control = Run(budget)

            def what(point: PausePoint) -> dict[str, Any]:
                return getattr(point.evaluator, name)(args, by_ui=True, control=control)

            return stepper.run_at_pause(what, client, EVALUATE_WAIT_S, control).answer()

        return handle

    return {
        "pause": answer(lambda a, c: stepper.request_pause(c)),
        "step": answer(lambda a, c: stepper.request_step(c)),
        "next": answer(lambda a, c: stepper.request_next(current_step(), c)),
        "continue": answer(lambda a, c: stepper.request_continue(c)),
        "detach": answer(lambda a, c: stepper.detach()),
        "state": answer(lambda a, c: None),
        "break_list": answer(lambda a, c: None),
        "break_add": answer(add),
        "break_enable": answer(lambda a, c: stepper.set_enabled(a["bp"], a["enabled"])),
        "break_delete": answer(lambda a, c: stepper.delete_breakpoint(a["bp"])),
        "inspect": lambda a, c: stepper.inspect(a["group"], a["index"], a["start"], a["count"]),
        "evaluate": at_pause("evaluate"),
        "edit": at_pause("edit"),
    }


def _slice_values(t: Any, group: str, index: int, start: int, count: int) -> dict[str, Any]:
    import torch  # the stepper is only ever used beside a live tracer

    with torch._C.DisableTorchFunction(), torch.no_grad():
        flat = t.detach().reshape(-1)
        n = flat.numel()
        part = flat[start : start + count]
        if part.is_complex():
            part = torch.view_as_real(part).reshape(-1)
        if part.dtype == torch.bool:
            part = part.to(torch.uint8)
        values = part.cpu().tolist()
    return {
        "group": group,
        "index": index,
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "numel": n,
        "start": start,
        "values": values,
    }
