"""Pausing the training thread at an event the stepper stops at (a UI's step, a breakpoint).

The recorders decide *where* a pause could happen (before or after an op, before or after a
node) and hand over the event and its live tensors; :class:`Pauser` asks the stepper, makes
sure everything up to the pause reached the UI and the file, blocks, and says when it goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torchscope.protocol.breakpoints import AFTER
from torchscope.protocol.events import PAUSE, RESUME, Event
from torchscope.tracer.armed.pipeline import EventPipeline
from torchscope.tracer.armed.recording import ArmedState, ErrorReport
from torchscope.tracer.armed.source import thread_stack
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

    def _origin_of(self, event: dict) -> str | None:
        seq = event.get("seq")
        return self._pipeline.alerts.origins.get(seq) if seq is not None else None

    def pause_point(
        self,
        phase: str,
        event: Event,
        tensors: dict[str, list[Any]],
        origin: Callable[[dict], str | None] | None = None,
    ) -> bool:
        """Ask the stepper whether to stop here; if so, block this thread until told to go.
        Returns whether it paused. ``origin(event)``: whether NaN/Inf first appears here
        ("nan"/"inf"); by default, the alert detector's verdict.

        Never raises into the job: a failure here is reported and the job runs on.
        """
        stepper = self.stepper
        pipeline = self._pipeline
        try:
            # Value conditions (NaN, gradient norm) need this event's numbers now: a sync, paid
            # only while such a breakpoint could match here.
            if phase == AFTER and stepper.needs_stats(event):
                pipeline.flush(wait=True)
            reason = stepper.should_pause(phase, event, origin or self._origin_of)
            if reason is None:
                return False
            if event.get("seq") in pipeline.alerts.overflows:
                if stepper.owner_of(reason) == WATCH_OWNER:
                    return False  # the watch knows the scaler skips it: no NaN to stop at
                reason += " at a loss scaler's overflow (the scaler skips this step's update)"
            pipeline.flush(wait=True)  # everything up to here reaches the UI and the file
            point = PausePoint(phase, event, tensors, thread_stack(self._owner), reason)
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
