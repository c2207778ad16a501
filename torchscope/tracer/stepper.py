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

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.breakpoints import (
    AFTER,
    Breakpoint,
    BreakpointError,
    first_hit,
)

# What the training thread does next when it is not paused.
RUN = "run"  # until a breakpoint or a pause request
PAUSE = "pause"  # at the next point
STEP = "step"  # at the next "after" point: one op or node, complete
NEXT = "next"  # at the first point of a later training step

MAX_INSPECT = 100_000


@dataclass
class PausePoint:
    """Where the training thread is blocked: the event and the live tensors behind it."""

    phase: str
    event: dict[str, Any]
    tensors: dict[str, list[Any]]  # "inputs"/"outputs" or "grad_outputs"/"grad_inputs"
    stack: list[tuple[str, int, str]]
    reason: str
    since: float = field(default_factory=time.time)

    def describe(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "event": self.event,
            "reason": self.reason,
            "stack": [list(f) for f in self.stack],
            "since": self.since,
        }


class Stepper:
    def __init__(
        self,
        *,
        lease_seconds: float = 10.0,
        wait_for_ui: bool = False,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.lease_seconds = lease_seconds
        self._note = note or (lambda text: print(f"torchscope: {text}", file=sys.stderr))
        self._cv = threading.Condition()
        self._mode = PAUSE if wait_for_ui else RUN
        self._next_after_step: int | None = None
        self._waiting_for_ui = wait_for_ui
        self._attached = False
        self._last_contact = 0.0
        self._resume_reason: str | None = None
        self._next_id = 1
        self.breakpoints: dict[int, Breakpoint] = {}
        # Who set each breakpoint (a UI's client id; None: the command line): it goes with them.
        self.owners: dict[int, Any] = {}
        self.paused: PausePoint | None = None
        self.auto_resumed = 0
        # Read on every op by the training thread: a plain attribute, kept current under _cv.
        self.active = self._mode != RUN

    def _refresh(self) -> None:
        self.active = self._mode != RUN or any(bp.enabled for bp in self.breakpoints.values())

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
    ) -> str | None:
        """The reason to pause at this point, or None. ``origin(event)`` gives the alert
        verdict ("nan"/"inf"/None) once the event's numbers are resolved."""
        mode = self._mode
        if mode == PAUSE:
            return "waiting for a UI" if self._waiting_for_ui else "paused"
        if mode == STEP and phase == AFTER:
            return "step"
        if mode == NEXT and event.get("step", 0) > (self._next_after_step or 0):
            return "next step"
        return first_hit(list(self.breakpoints.values()), phase, event, origin)

    def at_point(self, point: PausePoint) -> str:
        """Block the calling (training) thread until the UI lets it go or the lease ends.

        Returns what resumed it: "continue", "step", "next", "detach" or "lease".
        """
        with self._cv:
            self.paused = point
            self._mode = RUN  # the step/next/pause request that brought us here is used up
            self._next_after_step = None
            self._resume_reason = None
            # --wait: no lease until the first UI arrives; that is what was asked for.
            while self._waiting_for_ui and not self._attached and self._resume_reason is None:
                self._cv.wait(0.5)
            self._waiting_for_ui = False
            start = time.monotonic()
            while self._resume_reason is None:
                since = max(self._last_contact, start) if self._attached else start
                left = self.lease_seconds - (time.monotonic() - since)
                if left <= 0:
                    self.auto_resumed += 1
                    who = "its UI stopped responding" if self._attached else "no UI is attached"
                    self._note(
                        f"paused job resumed by itself after {self.lease_seconds:g} s: {who}"
                    )
                    self._attached = False
                    self._resume_reason = "lease"
                    break
                self._cv.wait(min(left, 0.5))
            reason, self._resume_reason = self._resume_reason, None
            self.paused = None
            self._refresh()
            return reason

    # -- what the UI asks (control thread) -------------------------------------------------
    def contact(self) -> None:
        """Any message from the UI: it is alive (renews the lease)."""
        with self._cv:
            self._attached = True
            self._last_contact = time.monotonic()
            self._cv.notify_all()

    def request_pause(self) -> None:
        with self._cv:
            if self.paused is None:
                self._mode = PAUSE
                self._refresh()

    def request_continue(self) -> None:
        self._resume(RUN, "continue")

    def request_step(self) -> None:
        self._resume(STEP, "step")

    def request_next(self, current_step: int) -> None:
        with self._cv:
            self._next_after_step = current_step
        self._resume(NEXT, "next")

    def _resume(self, mode: str, why: str) -> None:
        with self._cv:
            self._mode = mode
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
        """Delete the breakpoints ``owner`` set (a UI that left); returns how many."""
        with self._cv:
            gone = [i for i, o in self.owners.items() if o == owner and i in self.breakpoints]
            for i in gone:
                del self.breakpoints[i]
                del self.owners[i]
            self._refresh()
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
            return {
                "paused": self.paused.describe() if self.paused is not None else None,
                "mode": self._mode,
                "breakpoints": [bp.to_dict() for bp in self.breakpoints.values()],
                "auto_resumed": self.auto_resumed,
            }

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


Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


def stepping_commands(stepper: Stepper, current_step: Callable[[], int]) -> dict[str, Handler]:
    """Control commands of step-through debugging, for a publisher's ``commands`` table.

    Handlers run on the publisher's thread and take (args, client): the client id of the UI
    that asked. Every reply carries the stepper's state.
    """

    def answer(action: Callable[[dict[str, Any], Any], Any]) -> Handler:
        def handle(args: dict[str, Any], client: Any) -> dict[str, Any]:
            action(args, client)
            return {"state": stepper.state()}

        return handle

    def add(args: dict[str, Any], client: Any) -> None:
        stepper.add_breakpoint({k: v for k, v in args.items() if v is not None}, owner=client)

    return {
        "pause": answer(lambda a, c: stepper.request_pause()),
        "step": answer(lambda a, c: stepper.request_step()),
        "next": answer(lambda a, c: stepper.request_next(current_step())),
        "continue": answer(lambda a, c: stepper.request_continue()),
        "detach": answer(lambda a, c: stepper.detach()),
        "state": answer(lambda a, c: None),
        "break_list": answer(lambda a, c: None),
        "break_add": answer(add),
        "break_enable": answer(lambda a, c: stepper.set_enabled(a["bp"], a["enabled"])),
        "break_delete": answer(lambda a, c: stepper.delete_breakpoint(a["bp"])),
        "inspect": lambda a, c: stepper.inspect(a["group"], a["index"], a["start"], a["count"]),
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
