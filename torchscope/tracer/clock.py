"""The job's step counter: where training steps begin and end, on the training thread.

A step ends at ``optimizer.step()`` (global optimizer hooks), at a loss scaler's ``step()``
that skipped the update (``torch.amp.GradScaler`` after an overflow: the loop's iteration
ended all the same), at ``torchscope.step()``, or, in a job that updates its weights by hand
and has shown neither, after a top-level ``backward()`` (optional: ``backward_steps``).
Steps are therefore the loop's iterations; ``skipped`` counts those without an update, so
the optimizer's own count is ``step - skipped`` from a start at 0.

Whoever listens (a tracer, the dormant agent) is told:

- ``update_begins(args, kwargs)`` / ``update_ends()``: an optimizer update starts / ends without
  ending the step (the tracer leaves its mode during the update);
- ``boundary(step)``: step ``step`` begins. The listener may start or stop tracing here: it is
  the training thread, between two steps.

Only the thread that owns the clock counts (optimizer hooks are global: another thread's
optimizer is not this job's step). A subclass whose ``step()`` calls ``super().step()`` runs the
hooks nested: one update, one step.

A boundary after ``backward()`` is not taken at once (the hand-written update that follows is
not the next step's work) but at the next module call or backward, whichever comes first.
A job that holds an optimizer when its first ``backward()`` ends never counts that way: its
``step()`` ends the steps, and the micro-batches of gradient accumulation before it belong to
one step (a trace that numbered them as steps would number two steps alike once the optimizer
renumbered), unless its weights change between two ``backward()`` ends with no ``step()``
between them (a loop that updates by hand beside an optimizer it never steps). Otherwise the
first ``optimizer.step()`` turns these provisional boundaries off and renumbers the step as
the optimizer counts it.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from typing import Any, Protocol

from torch.nn.modules import module as module_mod
from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchscope.tracer import backward_calls, scaler_calls


class StepListener(Protocol):
    def update_begins(self, args: tuple, kwargs: dict) -> bool:
        """Returns whether something must be restored if ``step()`` raises."""
        ...

    def update_ends(self) -> None: ...

    def boundary(self, step: int) -> None: ...


# What ended the last step; the session event and ``ls`` say which rule is counting.
BY_OPTIMIZER = "optimizer"
BY_BACKWARD = "backward"
BY_CALL = "torchscope.step"
BY_SCALER = "scaler"  # a GradScaler's step() that skipped the update


class StepClock:
    def __init__(
        self,
        listener: StepListener,
        *,
        start: int = 0,
        optimizer_steps: bool = True,
        backward_steps: bool = False,
        optimizer_hooks: bool = True,
    ) -> None:
        self.listener = listener
        self.step = start
        self.optimizer_steps = optimizer_steps
        self.backward_steps = backward_steps
        self._optimizer_hooks = optimizer_hooks
        self.counted_by: str | None = None  # the rule that ended a step last
        self.owner = threading.get_ident()  # the training thread (install() takes its own)
        self._depth = 0  # optimizer.step() calls in progress
        self._outer: Any = None  # the frame of the outermost one (nesting, or a raise)
        self._optimizer_seen = False
        self._manual_seen = False
        self._provisional = 0  # steps counted from backward() before any optimizer step
        self._optimizer_held: bool | None = None  # asked once, at the first backward() end
        self._hand_writes: HandWrites | None = None  # while held: whether the loop writes
        self.ended_unseen = False  # set by remove(): the last step had ended (see there)
        self._hooks: list[Any] = []
        self._resume_hook: Any = None  # settles an update whose step() raised
        self._pending_hook: Any = None  # takes a boundary deferred after backward()
        self._backward: backward_calls.Listening | None = None
        self._scaler: scaler_calls.Listening | None = None
        self.skipped = 0  # steps whose scaler.step() skipped the update
        self._updates = 0  # optimizer updates ended (to tell a skipped scaler step)
        self._updates_at_scaler: int | None = None  # at the scaler.step() in progress

    # -- lifecycle -----------------------------------------------------------------------------
    def install(self) -> StepClock:
        self.owner = threading.get_ident()
        if self._optimizer_hooks and not self._hooks:
            self._hooks = [
                register_optimizer_step_pre_hook(self._before_update),
                register_optimizer_step_post_hook(self._after_update),
            ]
            self._scaler = scaler_calls.listen(self)
        if self.backward_steps and self._backward is None and not self._optimizer_seen:
            self._backward = backward_calls.listen(self)
        return self

    def remove(self) -> None:
        # A backward() ended the last step; its boundary (the next module call) never came.
        self.ended_unseen = self._pending_hook is not None
        for hook in (*self._hooks, self._resume_hook, self._pending_hook):
            if hook is not None:
                hook.remove()
        self._hooks = []
        self._resume_hook = self._pending_hook = None
        # A step() that raised leaves its frame here: gone with the clock, or the frame would
        # hold the loop's locals (model, optimizer, batch) for as long as the clock lives.
        self._depth = 0
        self._outer = None
        if self._scaler is not None:
            self._scaler.remove()
            self._scaler = None
        if self._backward is not None:
            self._backward.remove()
            self._backward = None

    # -- the rules -----------------------------------------------------------------------------
    def advance(self, by: str = BY_CALL) -> None:
        """End the current step (``torchscope.step()``, or a rule below)."""
        if by == BY_CALL:
            self._manual_seen = True
            self._drop_pending()
        self.counted_by = by
        self.step += 1
        self.listener.boundary(self.step)

    def set_step(self, step: int) -> None:
        """Number the current step ``step`` (a job resumed from a checkpoint); the rules keep
        counting from there. Its own number already: nothing happens (no second boundary,
        which would use up a step of a ``record --next N``)."""
        self._provisional = 0
        if int(step) == self.step:
            return
        self.step = int(step)
        self.listener.boundary(self.step)

    def _before_update(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self.owner:
            return
        caller = sys._getframe(1)  # torch's wrapper around this step() call
        if self._depth and not _on_stack(self._outer, caller):
            self._update_failed(None, None)  # the last step() raised: its post-hook never ran
        self._depth += 1
        if self._depth > 1:
            return  # a subclass's step() calling super().step(): one update
        self._outer = caller
        if self._pending_hook is not None:
            self._drop_pending()
        if self.listener.update_begins(args, kwargs):
            # Post-hooks do not run when step() raises: the next module call settles it.
            self._resume_hook = module_mod.register_module_forward_pre_hook(self._update_failed)

    def _after_update(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self.owner:
            return
        if self._depth > 1:
            self._depth -= 1
            return
        self._depth = 0  # _settle(), inline: this runs at every step
        self._outer = None
        if self._resume_hook is not None:
            self._settle()
        self._updates += 1
        if self.optimizer_steps:
            if not self._optimizer_seen:
                self._optimizer_seen = True
                # Steps counted from backward() before the first update were micro-batches of
                # one optimizer step (gradient accumulation): count as the optimizer does.
                self.step -= self._provisional
                self._provisional = 0
                self._hand_writes = None
                # backward() never ends a step again: stop listening (a call less per step).
                if self._backward is not None:
                    self._backward.remove()
                    self._backward = None
            self.advance(BY_OPTIMIZER)
        else:
            self.listener.update_ends()

    def _update_failed(self, module: Any, args: Any) -> None:
        self._settle()
        self.listener.update_ends()

    def _settle(self) -> None:
        self._depth = 0
        self._outer = None
        if self._resume_hook is not None:
            self._resume_hook.remove()
            self._resume_hook = None

    # -- a loss scaler's step() that skipped the update ------------------------------------------
    def scaler_step_begins(self, scaler: Any, optimizer: Any) -> None:
        if threading.get_ident() == self.owner:
            self._updates_at_scaler = self._updates

    def scaler_step_ends(self, scaler: Any, optimizer: Any, ok: bool) -> None:
        if threading.get_ident() != self.owner:
            return
        before, self._updates_at_scaler = self._updates_at_scaler, None
        if ok and before == self._updates and self.optimizer_steps:
            # The scaler found inf/NaN in the scaled gradients and did not call step(): the
            # iteration is over all the same. Counted, so steps stay the loop's iterations.
            self._drop_pending()
            self.skipped += 1
            self.advance(BY_SCALER)

    # -- backward() as a step's end, for jobs without an optimizer ------------------------------
    def _counts_backward(self) -> bool:
        return (
            self.backward_steps
            and self.optimizer_steps
            and not self._optimizer_seen
            and not self._manual_seen
            and threading.get_ident() == self.owner
        )

    def backward_begins(self, kwargs: dict[str, Any]) -> None:
        if self._pending_hook is not None and threading.get_ident() == self.owner:
            self._take_pending()  # two backward calls with no module call between them
        return None

    def backward_ends(self, ok: bool) -> None:
        if ok and self._pending_hook is None and self._counts_backward():
            if self._optimizer_held is None:
                optimizers = held_optimizers()
                self._optimizer_held = bool(optimizers)
                self._hand_writes = HandWrites(optimizers) if optimizers else None
            if self._optimizer_held:
                writes = self._hand_writes
                if writes is None or not writes.written():
                    return
                # Its optimizer never steps: the loop updates by hand after each backward().
                # The first step ended unseen at its update: it ends now, and this one at
                # the next module call or backward(), as every later one.
                self._optimizer_held, self._hand_writes = False, None
                self._provisional += 1
                self.advance(BY_BACKWARD)
            self._pending_hook = module_mod.register_module_forward_pre_hook(
                lambda module, args: self._take_pending()
            )

    def _take_pending(self) -> None:
        if threading.get_ident() != self.owner or self._pending_hook is None:
            return
        self._drop_pending()
        if self._counts_backward():
            self._provisional += 1
            self.advance(BY_BACKWARD)

    def _drop_pending(self) -> None:
        if self._pending_hook is not None:
            self._pending_hook.remove()
            self._pending_hook = None


def _on_stack(frame: Any, start: Any, limit: int = 64) -> bool:
    """Whether ``frame`` is ``start`` or one of its callers (a nested ``step()`` call runs
    inside its outer one; a stale one from a ``step()`` that raised does not)."""
    f = start.f_back if start is not None else None
    for _ in range(limit):
        if f is None:
            return False
        if f is frame:
            return True
        f = f.f_back
    return False


def held_optimizers() -> list[Optimizer]:
    """The torch optimizers this process holds (whose ``step()`` will end the steps).

    ``Optimizer.__init__`` marks its class's ``step`` as hooked, so a process that never
    built one pays nothing here; one that did pays one pass over the collector's objects."""
    classes: list[type] = [Optimizer]
    while classes:
        cls = classes.pop()
        if getattr(cls.__dict__.get("step"), "hooked", False):
            # type(o), not isinstance: that asks proxies for __class__ (some warn when asked)
            return [o for o in gc.get_objects() if issubclass(type(o), Optimizer)]
        classes.extend(cls.__subclasses__())
    return []


class HandWrites:
    """Whether a loop that holds an optimizer updates its weights by hand all the same: the
    weights the optimizers hold were written between two ``backward()`` ends with no
    ``optimizer.step()`` between them (gradient accumulation leaves them alone). Asked only
    until an optimizer steps; each question reads every such weight's version counter."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        groups = [group for opt in optimizers for group in opt.param_groups]
        self._weights = [weakref.ref(p) for group in groups for p in group["params"]]
        self._last: int | None = None

    def written(self) -> bool:
        """Whether the weights changed since the last time this was asked."""
        version = sum(p._version for ref in self._weights if (p := ref()) is not None)
        last, self._last = self._last, version
        return last is not None and version != last
