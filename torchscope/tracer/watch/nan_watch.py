"""Always-on NaN watch: check every step for almost nothing, replay only the step that went bad.

Every training step, the watch
  1. **checks**, in a global optimizer pre-hook (before the update), that every gradient the
     optimizer is about to use -- and the loss, when its ``backward()`` was seen -- is finite:
     one ``torch._foreach_norm`` per device, stacked and reduced on the device, read with
     **one** ``.tolist()``: the step's only host sync (what ``GradScaler`` costs). A
     non-finite total is confirmed exactly (``isnan``/``isinf`` per tensor) before it counts:
     a finite gradient whose squares overflow is not a NaN. ``gradnorm=X`` also reports a
     total L2 norm above X (it is the same number). No per-op work. An
     ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) makes the
     gradients inside ``step()``: its closure is wrapped (another global pre-hook) and the
     check runs each time it returns -- after Lightning's clipping, before the update; LBFGS
     calls it several times a step.
  2. **captures** what re-running the step's model part needs: for each call of a top-level
     module (the model, a loss module) made with grad enabled, references to its arguments,
     the CPU and CUDA RNG states before it, the autocast state, the autograd sequence-number
     window of the nodes it created, and -- up to ``capture_bytes`` in all (64 MiB default) --
     references to the gradients that arrive at its outputs. Top-level modules are found on
     the first step with global module hooks (every module call pays for them on that step
     only), then watched with hooks on those modules alone. Nothing else is copied.
  3. **keeps the step's graph** (``keep_graph``): the top-level ``backward()`` runs with
     ``retain_graph=True`` and the watch holds its roots until the check; afterwards only the
     job's own references keep it (see "Memory" below).
  4. on a detection, **replays** the step before the update, under a full tracer (see
     ``watch_replay``): module calls again with their inputs and RNG, the module backward
     from the captured output gradients, and -- when neither finds the origin -- the backward
     again over the retained graph, which covers loop code between module calls (a ``sqrt``
     of the loss). A compiled model's graph is not retained (AOT autograd refuses it): the
     loop code's nodes are marked instead as the step's backward runs them (see
     ``capture.LoopMarks``), and a loop-code origin is placed, not replayed. Buffers
     (BatchNorm statistics) and RNG states are restored, ``.grad`` is never touched (the
     replay uses ``torch.autograd.grad``): the job continues bit-identically.
  5. prints one line and applies the policy: ``continue``, ``pause`` (the replay stops at the
     origin when the tracer has a stepper) or ``stop`` (raises :class:`WatchStop` from
     ``optimizer.step()``, before the update, after the report; the only exception the watch
     ever raises into the job -- its own errors are reported once and swallowed) or ``skip``
     (the update is refused, as a loss scaler skips an overflowed step: the optimizer's
     parameters have no ``.grad`` while its ``step()`` runs, and get it back after; past
     ``max_skips`` bad steps in a row, as ``stop``).

Memory held per step (the benchmark measures it):
  - RNG state: 5 KiB (CPU generator) + 16 B per CUDA device, per top-level call.
  - References to the top-level calls' arguments (alive anyway while the step runs) and to
    the gradients at their outputs: at most ``capture_bytes``; a call whose output gradients
    do not fit is replayed from a unit gradient (said so in the report) unless the retained
    graph covers it.
  - The retained graph: the tensors autograd saved for the backward (activations), which a
    plain ``backward()`` frees as it goes. The watch drops its references at the check (before
    the update); the job's own references (``loss``, ``logits`` in the loop) keep them until
    they are rebound -- in a loop that keeps ``loss`` alive into the next step, until that
    step's forward has finished, i.e. up to one extra step's activations at the peak. With
    gradient accumulation only the latest micro-batch's graph is kept (``max_graphs``).
    ``keep_graph=False`` turns this off (backward origins outside module calls are then not
    replayed).
  - A compiled model's step keeps no graph; instead a hook on each loop-code node (the loss
    code: at most ``MAX_LOOP_NODES``) adds a 3-flag bool tensor as the backward runs it.

The loop's own code between module calls (a loss function, ``torch.distributions``) is not
re-run: its ops are recorded as they run (:mod:`.loop_code`), and a forward origin there is
named from them at the detection.

Not covered (said in the report when it matters): ``GradScaler`` steps it skips (they never call
``optimizer.step()``), module Python state changed by ``forward``, parameters modified in
place by ``forward``, other generators than CPU/CUDA, a backward-only origin inside an FSDP
module (every rank replays an FSDP step's forward together, see :mod:`.fsdp_replay`, never its
backward). User hooks on tensors and modules run again in the replay.

This module holds the watch's hooks and captures (what the check decides on); the check and
its verdict are :mod:`.check`, the norms it reads :mod:`.norms`, the line it prints
:mod:`.report`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchscope.tracer import backward_calls, scaler_calls
from torchscope.tracer.clock import BY_SCALER, HandWrites, StepClock, held_optimizers
from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.watch.capture import (
    Backward,
    Call,
    LoopMarks,
    StepCaptures,
    tensors_in,
    versions_of,
)
from torchscope.tracer.watch.check import StepCheck
from torchscope.tracer.watch.loop_code import LoopOps
from torchscope.tracer.watch.norms import ModuleNorms
from torchscope.tracer.watch.refusal import UpdateRefusal
from torchscope.tracer.watch.report import print_report
from torchscope.tracer.watch.roots import TopLevelCalls
from torchscope.tracer.watch.scaling import LossScaling
from torchscope.tracer.watch.spikes import Spikes
from torchscope.tracer.watch.stop import MAX_SKIPS, POLICIES, WatchStop

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer


# -- the watch -------------------------------------------------------------------------------
class NanWatch(StepCheck):
    """Watch every training step for NaN/Inf gradients (and loss); replay the bad one traced.

    gradnorm: also report a total gradient L2 norm above this.
    on_nan: "continue" (report and go on), "pause" (pause inside the replay at the origin when
        the replay's tracer has a stepper -- a UI or ``--break-on``; otherwise continue, and
        say so), "stop" (report, then raise :class:`WatchStop` from ``optimizer.step()``,
        before the update), "skip" (report, then refuse the update and go on, as a loss
        scaler skips an overflowed step: for the duration of ``optimizer.step()`` the
        optimizer's parameters have no ``.grad``, so weights and optimizer state stay as
        they were, and ``.grad`` is given back when the update ends; the step still counts.
        A job that updates its weights in its own code (no optimizer: ``before_update()``)
        cannot have its update refused: there "skip" acts as "continue", said once).
    max_skips: under "skip", how many bad steps in a row have their update refused; the next
        one raises :class:`WatchStop` as "stop" does. A good step starts the count again.
    spikes: also catch loss spikes (:mod:`.spikes`): True (its defaults) or a ``Spikes``; the
        figures are those the check reads (no extra read).
    on_spike: what a spike does, as ``on_nan`` (one of the same policies; "pause" has no
        place to pause at and goes on as "continue", said once).
    capture_bytes: cap on the output gradients held per step (references, not copies).
    tracer_factory: ``f(step) -> started Tracer`` that records the replay of ``step``. It must
        not advance steps on its own (``optimizer_steps=False``). Default: an in-memory
        ``Tracer(keep=True)`` numbered ``step``, stopped after the replay.
    step_of: the job's current step number; default: optimizer steps counted by the watch.
    report: where the one-line reports go; default: stderr.
    keep_graph: keep the step's autograd graph until the check, so that backward origins in
        loop code are replayed: True (every step), False (never), or "auto" (from the step
        after a detection that showed the origin outside the module calls, or could not place
        it: the watch stays at its cheapest until then).
    roots: the top-level modules to watch; default: found on the first step.
    max_calls: top-level module calls captured per step (more are not replayed).
    max_graphs: retained graphs held per step (gradient accumulation: the latest ones).
    on_unreproduced: ``f(detection)`` when the replay did not reproduce the bad values (for
        example: arm full tracing for the next steps).
    replay_wanted: ``f() -> bool``, asked at a detection; False skips the replay (the step
        was traced live already: its alert says where the value came from).
    live_origin: ``f() -> alert or None``, asked when the step was traced live: the first
        origin alert the live tracer found in it, which the report names ("traced live").
    backward_checks: in a job that held no optimizer when its first backward() ended, check
        each step when its backward() ends (gradients complete, weights not yet updated by
        the job's own code). Otherwise such a job calls ``before_update()`` itself.
    """

    needs_arguments = True  # backward_calls: the roots and retain_graph, by name

    def __init__(
        self,
        *,
        gradnorm: float | None = None,
        on_nan: str = "continue",
        max_skips: int = MAX_SKIPS,
        spikes: Spikes | bool | None = None,
        on_spike: str = "continue",
        capture_bytes: int = 64 << 20,
        tracer_factory: Callable[[int], Tracer] | None = None,
        step_of: Callable[[], int] | None = None,
        report: Callable[[str], None] | None = None,
        keep_graph: bool | str = True,
        roots: Iterable[nn.Module] | None = None,
        max_calls: int = 64,
        max_graphs: int = 1,
        on_unreproduced: Callable[[dict[str, Any]], None] | None = None,
        replay_wanted: Callable[[], bool] | None = None,
        live_origin: Callable[[], dict[str, Any] | None] | None = None,
        backward_checks: bool = False,
    ) -> None:
        if keep_graph not in (True, False, "auto"):
            raise ValueError(f"keep_graph must be True, False or 'auto', not {keep_graph!r}")
        for name, policy in (("on_nan", on_nan), ("on_spike", on_spike)):
            if policy not in POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}, not {policy!r}")
        if gradnorm is not None and not gradnorm > 0:
            raise ValueError("gradnorm must be a positive number")
        self.gradnorm = gradnorm
        self.on_nan = on_nan
        # (an empty Spikes is falsy: it has a length)
        self.spikes = spikes if isinstance(spikes, Spikes) else Spikes() if spikes else None
        self.on_spike = on_spike
        self.spiked_step: int | None = None  # the last step a spike was caught at
        self._said_spike_pause = False
        self.refusal = UpdateRefusal(max_skips)  # under "skip": the updates refused
        self.capture_bytes = int(capture_bytes)
        self.tracer_factory = tracer_factory
        self._step_of = step_of
        self.report = report or print_report
        self.keep_graph = keep_graph
        self.keeping = keep_graph is True  # "auto" turns this on after a detection needs it
        self.max_calls = max_calls
        self.max_graphs = max_graphs
        self.on_unreproduced = on_unreproduced
        self.replay_wanted = replay_wanted or (lambda: True)
        self.live_origin = live_origin or (lambda: None)
        self.detections: list[dict[str, Any]] = []
        self.steps_checked = 0
        self.installed = False
        self.captured = StepCaptures()  # what the step has run so far, to replay it
        self._fsdp_modules: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        # state
        self._owner = threading.get_ident()
        self._lock = threading.Lock()
        self._step = 0
        self._started_at = 0  # the step the watch was installed at
        self._replaying = False
        self._top = TopLevelCalls(self, roots)
        # Tells the watch when an optimizer update begins (nested and failed step() calls
        # included), as it tells the tracer: the check runs there.
        self._clock: StepClock | None = None
        # Wraps the closure of ``optimizer.step(closure)``: the check runs when it returns.
        self._closure_hook: Any = None
        self._closure_update = False  # an optimizer.step(closure) is in progress
        self._listening: backward_calls.Listening | None = None
        self._scaling: scaler_calls.Listening | None = None
        # A step checked when its scaled backward() ended: its update (or the scaler's skip)
        # ends it without another check.
        self._checked_at_backward = False
        self.loss_scaling = LossScaling()  # the job's loss scaler, as the watch sees it
        self._error = ReportOnce("the NaN watch", "the job continues")
        # The loop's own code between module calls (a loss function, torch.distributions),
        # recorded as it runs: a replay cannot run it again (see loop_code).
        self.loop = LoopOps(self._error)
        self.last_replay: Any = None  # the replay object of the last detection (tests, UI)
        # The check's one read (watch/norms.py); the agent's adds a sink: each module's norm
        # for the history, from the same read.
        self.norms = ModuleNorms(None, _watched_roots(weakref.ref(self)))
        self._bad_run: dict[str, Any] | None = None  # the detection of the current bad stretch
        self._still_bad: dict[str, Any] | None = None  # set by a check that found it still bad
        # In a job with no optimizer, check each step when its backward() ends (the agent's
        # watch: such a job calls no before_update() of its own).
        self._hand_updates: bool | None = None if backward_checks else False
        self._hand_writes: HandWrites | None = None  # until an optimizer steps (see there)

    # -- lifecycle -----------------------------------------------------------------------------
    def install(self) -> NanWatch:
        """Start watching from the calling thread (the training thread)."""
        if self.installed:
            return self
        self._owner = threading.get_ident()
        self._started_at = self.step
        self._clock = StepClock(self).install()
        # After the clock's hook: it sees the job's own closure, the update this one wraps.
        self._closure_hook = register_optimizer_step_pre_hook(self._wrap_closure)
        self._top.install()
        self._listening = backward_calls.listen(self)
        self._scaling = scaler_calls.listen(self)
        self.installed = True
        return self

    def remove(self) -> None:
        """Remove every hook and wrapper and drop every captured reference."""
        self.installed = False
        if self._clock is not None:
            self._clock.remove()
            self._clock = None
        if self._closure_hook is not None:
            self._closure_hook.remove()
            self._closure_hook = None
        self._closure_update = False
        self._top.remove()
        if self._listening is not None:
            self._listening.remove()
            self._listening = None
        if self._scaling is not None:
            self._scaling.remove()
            self._scaling = None
        self.loss_scaling.forget_pending()
        self._checked_at_backward = False
        self._end_step(count=False)
        self._end_run()

    def __enter__(self) -> NanWatch:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def step(self) -> int:
        if self._step_of is not None:
            return int(self._step_of())
        return self._step

    @property
    def roots(self) -> list[nn.Module]:
        return self._top.live_roots()

    # -- capture (the calls come from TopLevelCalls) ------------------------------------------
    @property
    def replaying(self) -> bool:
        return self._replaying

    @property
    def owner(self) -> int:
        return self._owner

    def call_raised(self) -> None:
        self.captured.pending = None  # nothing of that call reaches a gradient

    def report_error(self, what: str, exc: BaseException) -> None:
        self._error(what, exc)

    # -- capture -------------------------------------------------------------------------------
    def begin_call(self, module: nn.Module, args: tuple, kwargs: dict | None) -> None:
        self.captured.pending = None
        if self.captured.calls or self.captured.backwards:
            self.loop.pause()  # the module's own ops are the replay's
        else:
            self.loop.clear()  # the step's first call (or an evaluation's): nothing before it
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return  # evaluation: nothing of it reaches a gradient
        if len(self.captured.calls) >= self.max_calls:
            self.captured.overflow = True
            return
        if self._is_fsdp(module):
            # Replayed only by every rank together (see fsdp_replay); no graph kept (its
            # backward would run FSDP's reduce-scatter again).
            self.captured.fsdp = True
        self.captured.pending = Call(module, args, dict(kwargs) if kwargs is not None else None)

    @staticmethod
    def _is_training_call() -> bool:
        return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    def _is_fsdp(self, module: nn.Module) -> bool:
        known = self._fsdp_modules.get(module)
        if known is None:
            from torchscope.tracer.watch.replay import is_fsdp

            known = self._fsdp_modules[module] = is_fsdp(module)
        return known

    def end_call(self, module: nn.Module, kwargs: dict, output: Any) -> None:
        call, self.captured.pending = self.captured.pending, None
        try:
            self._end_call(module, call, kwargs, output)
        finally:
            # The loop's code runs from here until the next call (after the watch's own
            # calls above: they are not the job's).
            if self.captured.calls or call is not None or self._is_training_call():
                self.loop.resume()

    def _end_call(self, module: nn.Module, call: Call | None, kwargs: dict, output: Any) -> None:
        if call is None or call.module is not module:
            return
        if call.kwargs is None:
            call.kwargs = dict(kwargs or {})
        call.seq_hi = _get_sequence_nr()
        call.versions_after = versions_of(call.args, call.kwargs)
        outs = tensors_in(output)
        call.n_out = len(outs)
        ref = weakref.ref(self)
        # An FSDP call's replay is a forward alone (see fsdp_replay): no output gradients.
        for i, t in enumerate(outs if not self._is_fsdp(module) else ()):
            if t.requires_grad:
                call.handles.append(t.register_hook(_grad_catcher(ref, call, i)))
        self.captured.calls.append(call)

    def _keep_grad(self, call: Call, i: int, grad: torch.Tensor) -> None:
        if self._replaying or call.released or grad is None:
            return
        with self._lock:
            old = call.out_grads.get(i)
            if old is not None:  # a second backward through the same output this step
                call.out_grads[i] = old + grad
                return
            n = grad.numel() * grad.element_size()
            if self.captured.grad_bytes + n > self.capture_bytes:
                call.unit = True
                return
            self.captured.grad_bytes += n
            call.grad_bytes += n
            call.out_grads[i] = grad

    # -- backward (backward_calls listener) ----------------------------------------------------
    def backward_begins(self, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if not self.installed or self._replaying or threading.get_ident() != self._owner:
            return None
        self.captured.current_backward = None
        self.loop.pause()  # the loop's forward ends here
        try:
            if "tensors" not in kwargs:
                # Called with positional arguments we cannot see: no loss check, no graph kept.
                self.captured.unseen_backward = True
                return None
            roots = kwargs["tensors"]
            roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
            if not roots or not all(isinstance(r, torch.Tensor) for r in roots):
                return None  # GradientEdge roots
            retain = kwargs.get("retain_graph")
            user_retains = bool(kwargs.get("create_graph")) if retain is None else bool(retain)
            rec = Backward(roots, kwargs, user_retains, self.loss_scaling.take(roots))
            self.captured.backwards.append(rec)
            self.loop.note_roots(rec.unscaled or roots)
            self.captured.current_backward = rec
            if not self.keeping or self.captured.fsdp:
                return None
            kept = [b for b in self.captured.backwards if b.roots is not None]
            while len(kept) >= self.max_graphs and kept:
                kept.pop(0).drop_graph()  # keep the latest micro-batch's graph
            if self.max_graphs <= 0:
                return None
            if user_retains:
                rec.roots = roots
                return None
            if self._compiled_roots():
                # A graph compiled by inductor donates its buffers and refuses retain_graph:
                # mark the loop code's nodes instead, to place an origin there.
                rec.marks = LoopMarks(roots, [(c.seq_lo, c.seq_hi) for c in self.captured.calls])
                return None
            rec.roots = roots
            return {**kwargs, "retain_graph": True}
        except Exception as exc:
            self._error("before backward()", exc)
            return None

    def backward_ends(self, ok: bool) -> None:
        rec, self.captured.current_backward = self.captured.current_backward, None
        if rec is not None and not ok:
            rec.drop_graph()
            with contextlib.suppress(ValueError):
                self.captured.backwards.remove(rec)
        elif rec is not None and rec.scaler is not None:
            # Under a loss scaler the step is checked now: the scaler may skip the update
            # (no optimizer.step() to check at), and a NaN must be named in the step that
            # made it, with that step's module state. "stop" raises from backward().
            self._checked_at_backward = True
            self._check_update(self._root_params(), ends_step=False, refuse=False)
        elif rec is not None and self._updates_by_hand():
            # No optimizer: the update is the job's own code, right after this. The
            # gradients are complete and the weights untouched, as at optimizer.step().
            self.before_update()

    def _compiled_roots(self) -> bool:
        """Whether a watched top-level module runs compiled (``torch.compile(model)`` or
        ``model.compile()``): its backward may not be retained."""
        # The step's own top-level calls too: on the first step the roots are still found.
        for m in (*self._top.live_roots(), *(c.module for c in self.captured.calls)):
            if getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod"):
                return True
        return False

    def _updates_by_hand(self) -> bool:
        """Whether this job updates its weights by hand (it held no optimizer when its first
        backward ended, or it writes the weights of one it never steps): then each backward
        ends a step, and is checked there."""
        if self._hand_updates is None:
            optimizers = held_optimizers()
            self._hand_updates = not optimizers
            self._hand_writes = HandWrites(optimizers) if optimizers else None
        writes = self._hand_writes
        if writes is not None and writes.written():  # (None once the question is settled)
            self._hand_updates, self._hand_writes = True, None
            self._step += 1  # the first step ended unseen, at its update (as the clock counts)
        return self._hand_updates

    # -- the optimizer update (StepClock listener: nested step() calls are one update) ---------
    def update_begins(self, args: tuple, kwargs: dict) -> bool:
        """``optimizer.step()`` is about to apply the update: check the step (args[0] is the
        optimizer). Raises ``WatchStop`` under "stop", out of ``step()``, before the update.
        A step given a closure is checked when the closure returns instead (``_wrap_closure``):
        the closure makes the gradients, inside ``step()``."""
        if not self.installed or self._replaying:
            return False
        self.loop.pause()  # the update is not the loop's code
        self._hand_updates, self._hand_writes = False, None  # an optimizer ends the steps
        if self._checked_at_backward:
            self._checked_at_backward = False
            # Refused at its scaled backward() ("skip"), and the scaler did not skip it (its
            # gradients are finite: a NaN in the loss alone): refused here.
            if self.refusal.step == self.step:
                self.refusal.take(_params_of(args[0]))
            self._end_step()  # checked when its scaled backward() ended
            return self.refusal.holding
        if _closure_of(args, kwargs) is not None:
            self._closure_update = True
            return False
        self._check_update(_params_of(args[0]))
        # Gradients taken away ("skip") are given back when step() ends: if it raises, at
        # the clock's next module call (update_ends).
        return self.refusal.holding

    def update_ends(self) -> None:
        self.refusal.give_back()
        self._end_closure_update()  # a step(closure) that raised (or an unnumbered clock)

    def boundary(self, step: int) -> None:
        # The watch numbers steps with step_of (the agent's clock), else its own counter.
        if self.refusal.holding:
            self.refusal.give_back()  # the refused update ended ("skip")
        self._end_closure_update()
        if self._checked_at_backward:  # the scaler skipped the update: the step ends here
            self._checked_at_backward = False
            self._end_step()
        by_scaler = self._clock is not None and self._clock.counted_by == BY_SCALER
        self.loss_scaling.step_ended(by_scaler, self.step, self.report)

    def _check_update(
        self, params: list[torch.Tensor], *, ends_step: bool = True, refuse: bool = True
    ) -> None:
        """The check before an update; ``WatchStop`` under "stop". ``ends_step``: the step's
        captures go and the step counts (a closure's call ends its captures only: LBFGS calls
        it again within the same step). Under "skip", a refused update's ``params`` lose their
        gradients until it ends (``refuse``; a scaled backward's check leaves them to the
        loss scaler, which skips a step with non-finite gradients itself)."""
        stop: WatchStop | None = None
        self.loop.pause()  # what runs from here is the watch's and the optimizer's, not the loop's
        try:
            stop = self._stop(self.check(params))
            if stop is None and refuse and self.refusal.step == self.step:
                self.refusal.take(params)
        except Exception as exc:
            self._error("checking the step", exc)
        finally:
            if ends_step:
                self._end_step(count=stop is None)  # a stopped update did not end its step
            else:
                self._end_captures()
        if stop is not None:
            raise stop

    # -- optimizer.step(closure): Lightning's automatic optimization, LBFGS ---------------------
    def _wrap_closure(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """Global optimizer pre-hook: hand ``step()`` a closure that checks when it returns."""
        if not self.installed or self._replaying or threading.get_ident() != self._owner:
            return None
        closure = _closure_of(args, kwargs)
        if closure is None or isinstance(closure, _CheckedClosure):
            return None  # none, or a subclass's step() calling super().step(): wrapped once
        checked = _CheckedClosure(self, optimizer, closure)
        if len(args) > 1:
            return (args[0], checked, *args[2:]), kwargs
        return args, {**kwargs, "closure": checked}

    def closure_returned(self, optimizer: torch.optim.Optimizer) -> None:
        """The closure made the gradients (and Lightning clipped them); the update has not
        run: check them as ``step()``'s pre-hook checks a plain step. After every call."""
        if self.installed and not self._replaying:
            self._check_update(_params_of(optimizer), ends_step=False)

    def _end_closure_update(self) -> None:
        if self._closure_update:
            self._closure_update = False
            self._end_step()  # what came after the closure's last call (nothing, usually)

    def before_update(self, params: Iterable[torch.Tensor] | None = None) -> dict[str, Any] | None:
        """What the optimizer pre-hook does, for a job that updates its weights by hand: check
        ``params``' gradients (default: the watched modules'), end the step, and apply the
        policy (``WatchStop`` under "stop"). Call it on the training thread, before the update.
        Under "skip" the update is the job's own code, which the watch cannot refuse: it goes
        on as under "continue" (said once).
        """
        stop = None
        self.loop.pause()
        try:
            detection = self.check(params)
            run = detection or self._still_bad
            if self.policy_for(run) != "skip":
                stop = self._stop(detection)
            elif run:
                self.refusal.say_by_hand(run, self.report)
        finally:
            self._end_step(count=stop is None)  # a stopped update did not end its step
        if stop is not None:
            raise stop
        return detection

    def _root_params(self) -> list[torch.Tensor]:
        """The watched modules' parameters (on the first step, while they are still being
        found, those of the step's top-level calls so far)."""
        return parameters_of(self._watched_modules())

    def _watched_modules(self) -> list[nn.Module]:
        """The watched top-level modules (on the first step, while they are still being
        found, the step's top-level calls so far)."""
        modules = self._top.live_roots()
        if self._top.discovering:
            modules += [c.module for c in self.captured.calls]
        return modules

    # -- step end ------------------------------------------------------------------------------
    def _end_step(self, count: bool = True) -> None:
        """Drop the step's captures (and the watch's hold on its graph); ``count``: the step
        ended (numbered; the modules looked for again if they changed)."""
        calls, had_backward = self._drop_captures()
        if not count:
            return
        self._step += 1
        self._top.look_again(calls, had_backward)

    def _end_captures(self) -> None:
        """A closure's call was checked: drop what it captured, the step goes on (unnumbered)."""
        self._top.look_again(*self._drop_captures())

    def _drop_captures(self) -> tuple[list[Call], bool]:
        step, self.captured = self.captured, StepCaptures()
        for call in step.calls:
            call.release()
        self.loop.clear()
        for b in step.backwards:
            b.drop_graph()
        return step.calls, bool(step.backwards) or step.unseen_backward


# -- helpers ---------------------------------------------------------------------------------
class _CheckedClosure:
    """The closure ``optimizer.step()`` gets under the watch: the job's own, then the check
    (before the update, which runs after the closure returns). ``WatchStop`` under "stop"
    leaves through the optimizer's ``step()``, as from a plain step's pre-hook."""

    __slots__ = ("_closure", "_optimizer", "_watch")

    def __init__(self, watch: NanWatch, optimizer: torch.optim.Optimizer, closure: Any) -> None:
        self._watch = watch
        self._optimizer = optimizer
        self._closure = closure

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._closure(*args, **kwargs)
        self._watch.closure_returned(self._optimizer)
        return result


def _closure_of(args: tuple, kwargs: dict) -> Any:
    """The closure of an ``optimizer.step()`` call (``args[0]`` is the optimizer)."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _grad_catcher(ref: weakref.ref, call: Call, i: int) -> Callable[[torch.Tensor], None]:
    # Captures the call record and a weak watch reference, never the output tensor itself.
    def hook(grad: torch.Tensor) -> None:
        watch = ref()
        if watch is not None:
            try:
                watch._keep_grad(call, i, grad)
            except Exception as exc:
                watch._error("capturing an output gradient", exc)

    return hook


def _watched_roots(ref: weakref.ref) -> Callable[[], list[nn.Module]]:
    """The watch's top-level modules, for its norms (which must not keep the watch alive);
    on the first step, found as the step runs."""

    def roots() -> list[nn.Module]:
        watch = ref()
        if watch is None:
            return []
        return [*watch.roots, *(c.module for c in watch.captured.calls)]

    return roots


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def parameters_of(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters of ``modules`` and their submodules, each once, in ``parameters()``'s
    order. Read every step: ``Module.parameters()`` builds a name for every submodule and
    parameter through three generators, which on a model of many small layers costs more
    than the check's norms; this walks the same dicts without them."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = list(reversed(modules))
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        stack.extend(m for m in reversed(module._modules.values()) if m is not None)
    return out
