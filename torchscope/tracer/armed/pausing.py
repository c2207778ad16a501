"""Pausing the training thread at an event the stepper stops at (a UI's step, a breakpoint).

The recorders decide *where* a pause could happen (before or after an op, before or after a
node) and hand over the event and its live tensors; :class:`Pauser` asks the stepper, makes
sure everything up to the pause reached the UI and the file, blocks, and says when it goes on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from torchscope.protocol.breakpoints import AFTER, BEFORE, Breakpoint, BreakpointError
from torchscope.protocol.events import ATEN, PAUSE, RESUME, Event
from torchscope.tracer.armed.evaluate import Evaluator, edit_event, log_line_event
from torchscope.tracer.armed.pipeline import EventPipeline
from torchscope.tracer.armed.recorder_shared import ArmedState, ErrorReport
from torchscope.tracer.armed.source import thread_stack
from torchscope.tracer.ranks import say
from torchscope.tracer.stepper import WATCH_OWNER, PausePoint, Stepper


class Pauser:
    def __init__(
        self,
        stepper: Stepper,
        state: ArmedState,
        pipeline: EventPipeline,
        emit: Callable[[Event], None],
        next_seq: Callable[[], int],
        report_error: ErrorReport,
        owner: int,
    ) -> None:
        self.stepper = stepper
        self._state = state
        self._pipeline = pipeline
        self._emit = emit
        self._next_seq = next_seq
        self._report_error = report_error
        self._owner = owner  # the traced thread's ident, whose stack a pause shows
        self._said: set[int] = set()  # breakpoints whose action said its line already
        self.edits = 0  # tensors changed by hand in this armed period
        # Inside a backward of ranks that meet before it: another rank may already wait in
        # this backward's all-reduce for this one, so a UI's pause stops after it instead.
        self.between_ranks = False

    def _origin_of(self, event: dict) -> str | None:
        seq = event.get("seq")
        return self._pipeline.alerts.origins.get(seq) if seq is not None else None

    def pause_point(
        self,
        phase: str,
        event: Event,
        tensors: dict[str, list[Any]],
        origin: Callable[[dict], str | None] | None = None,
        call: dict[str, Any] | None = None,
    ) -> bool:
        """Ask the stepper whether to stop here; if so, block this thread until told to go.
        Returns whether it paused. ``origin(event)``: whether NaN/Inf first appears here
        ("nan"/"inf"); by default, the alert detector's verdict. ``call``: an op's
        ``args``, ``kwargs`` and ``result``, for expressions at the pause.

        Breakpoints with an action (log, edit) act here, after the op or node ran, without
        pausing. An edit at the pause or by an action replaces a gradient in ``tensors``
        (the caller hands it back to autograd) or writes an op's output in place.

        Never raises into the job: a failure here is reported and the job runs on.
        """
        stepper = self.stepper
        pipeline = self._pipeline
        try:
            # Value conditions (NaN, gradient norm) need this event's numbers now: a sync, paid
            # only while such a breakpoint could match here.
            if phase == AFTER and stepper.needs_stats(event):
                pipeline.flush(wait=True)
            if phase == AFTER and stepper.actions and event.get("kind") != ATEN:
                self._act(event, tensors, call, origin or self._origin_of)
            reason = stepper.should_pause(
                phase, event, origin or self._origin_of, pause_here=not self.between_ranks
            )
            if reason is None:
                return False
            if event.get("seq") in pipeline.alerts.overflows:
                if stepper.owner_of(reason) == WATCH_OWNER:
                    return False  # the watch knows the scaler skips it: no NaN to stop at
                reason += " at a loss scaler's overflow (the scaler skips this step's update)"
            pipeline.flush(wait=True)  # everything up to here reaches the UI and the file
            point = PausePoint(phase, event, tensors, thread_stack(self._owner), reason)
            point.breakpoint = stepper.breakpoint_of(reason)
            if event.get("kind") != ATEN:
                point.evaluator = Evaluator(self, point, call)
            step = self._state.step_index
            self._emit(Event(kind=PAUSE, seq=self._next_seq(), step=step, **point.describe()))
            pipeline.flush(wait=True)
        except Exception as exc:
            self._report_error("deciding whether to pause", exc)
            return False
        resumed_by = stepper.at_point(point)  # blocks the training thread
        try:
            self._emit(
                Event(
                    kind=RESUME,
                    seq=self._next_seq(),
                    step=self._state.step_index,
                    by=resumed_by,
                    t=time.time(),
                )
            )
            pipeline.flush(wait=True)
        except Exception as exc:
            self._report_error("resuming", exc)
        return True

    # -- actions and edits (tracer/armed/evaluate.py) ----------------------------------------
    def _act(
        self,
        event: Event,
        tensors: dict[str, list[Any]],
        call: dict[str, Any] | None,
        origin: Callable[[dict], str | None],
    ) -> None:
        for bp in self.stepper.action_hits(event, origin):
            try:
                point = PausePoint(AFTER, event, tensors, [], f"breakpoint {bp.id}")
                Evaluator(self, point, call).act(bp)
            except Exception as exc:
                self._report_error(f"breakpoint {bp.id}'s {bp.action}", exc)

    @property
    def eval_budget(self) -> float:
        """Seconds an expression may run here before it is interrupted (the job's setting)."""
        return self.stepper.eval_budget

    def disable(self, bp: Breakpoint, line: str) -> None:
        """A logpoint or edit whose expression failed or ran over budget: said, disabled."""
        say(line)
        with contextlib.suppress(BreakpointError):  # deleted meanwhile
            self.stepper.set_enabled(bp.id, False)

    def module_named(self, path: Any) -> Any:
        """The module object at ``path`` (an event's ``module``), or None."""
        modules = getattr(self._state, "modules", None)
        if not path or modules is None:
            return None
        return modules.module_named(path)

    def edited(self, point: PausePoint, tensor: Any, summary: dict, in_place: bool) -> None:
        """A tensor of ``point`` was changed by hand: the ops that read it next see the new
        summary (an op's output keeps its version counter, so the memo must be told)."""
        self.edits += 1
        summaries = getattr(self._state, "summaries", None)
        if in_place and summaries is not None:
            summaries.memo.put(tensor, dict(summary))

    def edit_event(
        self,
        point: PausePoint,
        target: str,
        expr: str,
        before: dict,
        after: dict,
        by_ui: bool,
        bp: Breakpoint | None,
    ) -> Event:
        """The ``edit`` event, emitted now (the UI marks the row while the job is paused)."""
        ev = edit_event(
            self._next_seq(), self._state.step_index, point, target, expr, before, after, by_ui, bp
        )
        self._emit(ev)
        if by_ui:
            self._pipeline.flush(wait=True)
            say(f"edited by hand at {point.where()}: {target} <- {expr}")
        return ev

    def log_event(self, event: dict[str, Any], bp: Breakpoint, text: str) -> None:
        self._emit(log_line_event(self._next_seq(), self._state.step_index, event, bp, text))

    def say_log(self, bp: Breakpoint, line: str, took: float) -> None:
        say(line)
        if took > 0.5 and bp.id not in self._said:
            self._said.add(bp.id)
            say(f"breakpoint {bp.id}'s log took {took:.1f} s at this hit (it runs at every hit)")

    def say_once(self, bp: Breakpoint, line: str) -> None:
        if bp.id not in self._said:
            self._said.add(bp.id)
            say(line)


class WaitingPause:
    """A UI's pause while this rank waits for the others (ranks.PauseInWait). A rank that
    another rank's pause holds up there reaches no op until that one goes on: a pause asked
    of every rank would otherwise stop only one. ``stub()``: what it stops before."""

    def __init__(self, pauser: Pauser, stub: Callable[[], Event]) -> None:
        self._pauser = pauser
        self._stub = stub

    def asked(self) -> bool:
        pauser = self._pauser
        return not pauser.between_ranks and pauser.stepper.pause_asked()

    def hold(self) -> None:
        self._pauser.pause_point(BEFORE, self._stub(), {"inputs": []})
