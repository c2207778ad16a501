"""Who holds a dormant job traced, and for how long.

Tracing is *held*: by the command line (the steps ``--record``, ``--steps``, ``--break-on``,
``--wait`` select), by a UI (while its lease lasts: any request renews it), by ``record --next
N`` (N steps), or by the watch (the steps after a NaN it could not reproduce). The agent asks
at every step boundary whether anyone holds the new step. A holder that goes (``disarm``,
``q`` in the UI, its lease running out, its steps done) takes its breakpoints with it, and
the last UI to go takes the pauses held for a UI.

A client's hold may wait before it takes a step: until a step number (``at_step``: a point
picked in the UI's plot) or until a condition holds on the run's history (``when``:
``loss>X``, ``gradnorm>1e3``, ``nonfinite``), tested on each new history point at the step
boundaries, never per op. A waiting hold is the client's like any other: it goes when its
owner goes (``disarm``, the lease).

The table is shared by the control thread (requests, leases) and the training thread (step
boundaries): every method takes its lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.history import Condition, StepPoint
from torchscope.tracer.stepper import Stepper
from torchscope.tracer.steps import StepSelection

COMMAND_LINE = "command line"
UI = "ui"


@dataclass
class Holder:
    """Someone who wants the job traced."""

    id: int
    label: str  # "command line", "ui", "record", "watch"
    client: bytes | None = None  # the UI's connection; None: the command line
    steps: StepSelection | None = None  # absolute steps (command line)
    remaining: int | None = None  # the next N steps (record --next N)
    aten: str | None = None  # the aten level it asks for: "" everywhere, else a module regex
    eager_check: bool = False  # compiled modules' calls also run eagerly, compared
    last_contact: float = field(default_factory=time.monotonic)
    from_step: int | None = None  # takes no step before this one (arm at_step)
    condition: Condition | None = None  # takes no step before this holds (arm when)
    fired_at: int | None = None  # the step whose history point met the condition

    @property
    def is_ui(self) -> bool:
        """A UI: what pauses and says continue (a recorder does neither)."""
        return self.client is not None and self.label == UI

    @property
    def waiting(self) -> bool:
        """Not yet holding anything: its step or its condition has not come."""
        return self.condition is not None and self.fired_at is None

    def takes(self, step: int) -> bool | None:
        """Whether it holds ``step`` traced; None when it is done and goes."""
        if self.waiting or (self.from_step is not None and step < self.from_step):
            return False  # nothing counted yet: ``next N`` starts when it does
        if self.steps is not None:
            if step in self.steps:
                return True
            last = self.steps.last()
            return None if last is not None and step > last else False
        if self.remaining is not None:
            if self.remaining <= 0:
                return None
            self.remaining -= 1
        return True

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "by": self.label}
        if self.steps is not None:
            out["steps"] = self.steps.text
        if self.remaining is not None:
            out["remaining"] = self.remaining
        if self.from_step is not None:
            out["at_step"] = self.from_step
        if self.condition is not None:
            out["when"] = self.condition.text
            out["fired_at"] = self.fired_at
        return out


@dataclass
class StepHold:
    """What the holders want of one step, asked at its boundary."""

    traced: bool  # someone holds it
    gated: bool  # the command line holds it: every rank is traced alike and can meet
    by_ui: bool  # a UI holds it (a recorder never pauses: it needs no meeting of the ranks)
    released: list[int] = field(default_factory=list)  # holders gone since the last boundary
    client_left: bool = False  # one of them was a UI or a recorder (said on stderr)
    aten: list[str] = field(default_factory=list)  # the aten scopes its holders ask for
    eager_check: bool = False  # a holder asks for compiled calls checked against eager


class Holders:
    def __init__(self, stepper: Callable[[], Stepper | None], say: Callable[[str], None]) -> None:
        self._stepper = stepper  # the job's stepper, if any: a client's breakpoints go with it
        self._say = say
        self._lock = threading.Lock()
        # Read at every step boundary (``held``: whether anyone holds the job, ``released``:
        # whether someone let go since the last one), so plain attributes: not to be changed
        # from outside.
        self.held: dict[int, Holder] = {}
        self._ids = itertools.count(1)
        self.released: list[Holder] = []  # gone since the last boundary (to announce)

    def __bool__(self) -> bool:
        return bool(self.held)

    def add(
        self,
        label: str,
        *,
        client: bytes | None = None,
        steps: StepSelection | None = None,
        remaining: int | None = None,
        aten: str | None = None,
        eager_check: bool = False,
        also: bool = False,
        from_step: int | None = None,
        condition: Condition | None = None,
    ) -> Holder:
        """A new holder; a client's new request replaces its old one (``also``: one more
        beside it, for a few steps: a UI asking one step at the aten level)."""
        with self._lock:
            if client is not None and not also:
                old = self._client_holder(client)
                if old is not None:
                    del self.held[old.id]
            holder = Holder(
                next(self._ids),
                label,
                client=client,
                steps=steps,
                remaining=remaining,
                aten=aten,
                eager_check=eager_check,
                from_step=from_step,
                condition=condition,
            )
            self.held[holder.id] = holder
        return holder

    def conditional(self) -> bool:
        """Whether a hold waits for a condition (the agent then reads the history's values
        without waiting for a batch)."""
        with self._lock:
            return any(h.waiting for h in self.held.values())

    def note(self, points: list[StepPoint]) -> list[Holder]:
        """New points of the run's history, at a step boundary: the holds whose condition
        holds for one of them take steps from now on. Returns those."""
        fired = []
        with self._lock:
            for holder in self.held.values():
                if not holder.waiting:
                    continue
                condition = holder.condition
                if condition is None:
                    continue
                for p in points:
                    if condition.holds(p):
                        holder.fired_at = p.step
                        fired.append(holder)
                        break
        return fired

    def ready(self) -> bool:
        """Someone holds (or is about to hold) the job traced: not only holds that wait."""
        with self._lock:
            return any(not h.waiting for h in self.held.values())

    def at_boundary(self, step: int) -> StepHold:
        """Each holder says whether it takes ``step``; those done with their steps go."""
        with self._lock:
            traced = gated = by_ui = eager_check = False
            aten = []
            for holder in list(self.held.values()):
                takes = holder.takes(step)
                if takes is None:
                    self._drop(holder)
                else:
                    traced = traced or takes
                    gated = gated or bool(takes and holder.client is None and holder.steps)
                    by_ui = by_ui or (takes and holder.is_ui)
                    if takes and holder.aten is not None:
                        aten.append(holder.aten)
                    eager_check = eager_check or bool(takes and holder.eager_check)
            gone, self.released = self.released, []
        client_left = any(h.client is not None for h in gone)
        return StepHold(traced, gated, by_ui, [h.id for h in gone], client_left, aten, eager_check)

    def holds(self, holder: Holder) -> bool:
        """Whether ``holder`` still holds the job (it may have taken all its steps)."""
        with self._lock:
            return holder.id in self.held

    def end(self, holder: Holder) -> None:
        """``holder`` has what it held the job for: it lets go (said at the next boundary)."""
        with self._lock:
            self._drop(holder)

    def release(self, client: bytes) -> int:
        """This client lets go: its hold, its breakpoints, and (the last UI) its pauses.
        Returns the id of the hold it had, or 0."""
        with self._lock:
            holders = self._client_holders(client)
            for holder in holders:
                self._drop(holder)
            if holders:
                return holders[0].id
            stepper = self._stepper()
            if stepper is not None:
                stepper.release(client)
                if not self._a_ui_holds():
                    stepper.detach_uis()
        return 0

    def contact(self, client: bytes) -> Holder | None:
        """Any request renews its client's hold; returns the holder, if it holds."""
        with self._lock:
            holders = self._client_holders(client)
            for holder in holders:
                holder.last_contact = time.monotonic()
        return holders[0] if holders else None

    def expire(self, lease: float) -> None:
        """Clients silent for longer than ``lease`` let go."""
        now = time.monotonic()
        with self._lock:
            for holder in list(self.held.values()):
                if holder.client is not None and now - holder.last_contact > lease:
                    self._say(f"a {holder.label} stopped responding; its hold on tracing ended")
                    self._drop(holder)

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            return [h.describe() for h in self.held.values()]

    def client_labels(self) -> list[str]:
        with self._lock:
            return [h.label for h in self.held.values() if h.client is not None]

    def _drop(self, holder: Holder) -> None:
        """Called with the lock held."""
        if self.held.pop(holder.id, None) is None:
            return
        self.released.append(holder)
        if holder.client is None:
            return
        stepper = self._stepper()
        if stepper is not None:
            stepper.release(holder.client)
            if holder.is_ui and not self._a_ui_holds():
                # No UI left: nobody will say continue. A pause held for a UI ends now.
                # (A recorder never says continue, nor is it what --wait waits for.)
                stepper.detach_uis()

    def _a_ui_holds(self) -> bool:
        return any(h.is_ui for h in self.held.values())

    def _client_holder(self, client: bytes) -> Holder | None:
        return next((h for h in self.held.values() if h.client == client), None)

    def _client_holders(self, client: bytes) -> list[Holder]:
        return [h for h in self.held.values() if h.client == client]
