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
     ever raises into the job -- its own errors are reported once and swallowed).

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

Not covered (said in the report when it matters): a forward origin in loop code (the loop is
not re-run; the loss check still catches its NaN, the retained-graph replay names the first
backward node it poisons), ``GradScaler`` steps it skips (they never call
``optimizer.step()``), module Python state changed by ``forward``, parameters modified in
place by ``forward``, other generators than CPU/CUDA, FSDP (the replay would run collectives:
refused). User hooks on tensors and modules run again in the replay.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr
from torch.nn.modules import module as module_mod
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchscope.tracer import backward_calls, scaler_calls
from torchscope.tracer.clock import BY_SCALER, StepClock, an_optimizer_exists
from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.ranks import say_line
from torchscope.tracer.shards import local_shard
from torchscope.tracer.watch.capture import (
    Backward,
    Call,
    LoopMarks,
    replay_target,
    tensors_in,
    versions_of,
)
from torchscope.tracer.watch.stop import WatchStop

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer

POLICIES = ("continue", "pause", "stop")
# A loss scaler that skips this many steps in a row is said once (its scale is collapsing).
SKIPS_TO_SAY = 20
NAN, INF, GRADNORM = "nan", "inf", "gradnorm"
# -- the watch -------------------------------------------------------------------------------
class NanWatch:
    """Watch every training step for NaN/Inf gradients (and loss); replay the bad one traced.

    gradnorm: also report a total gradient L2 norm above this.
    on_nan: "continue" (report and go on), "pause" (pause inside the replay at the origin when
        the replay's tracer has a stepper -- a UI or ``--break-on``; otherwise continue, and
        say so), "stop" (report, then raise :class:`WatchStop` from ``optimizer.step()``,
        before the update).
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
        if on_nan not in POLICIES:
            raise ValueError(f"on_nan must be one of {', '.join(POLICIES)}, not {on_nan!r}")
        if gradnorm is not None and not gradnorm > 0:
            raise ValueError("gradnorm must be a positive number")
        self.gradnorm = gradnorm
        self.on_nan = on_nan
        self.capture_bytes = int(capture_bytes)
        self.tracer_factory = tracer_factory
        self._step_of = step_of
        self.report = report or _print_report
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
        # per step
        self._calls: list[Call] = []
        self._backwards: list[Backward] = []
        self._pending: Call | None = None
        self._current_backward: Backward | None = None
        self._overflow = False
        self._unseen_backward = False  # a backward whose roots the watch could not see
        self._fsdp_step = False  # a top-level call of an FSDP module this step
        self._fsdp_modules: weakref.WeakKeyDictionary[nn.Module, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._grad_bytes = 0
        # state
        self._owner = threading.get_ident()
        self._lock = threading.Lock()
        self._step = 0
        self._started_at = 0  # the step the watch was installed at
        self._depth = 0  # top-level module calls in progress (owner thread)
        self._replaying = False
        # Weak: a watch that outlives a model (a sweep building one per trial) must not keep
        # it alive; a model that is gone is simply no longer watched.
        self._root_refs: list[weakref.ref[nn.Module]] = [weakref.ref(m) for m in roots or ()]
        self._explicit_roots = roots is not None
        self._discovering = False
        self._global_hooks: list[Any] = []
        self._root_hooks: list[Any] = []
        # Tells the watch when an optimizer update begins (nested and failed step() calls
        # included), as it tells the tracer: the check runs there.
        self._clock: StepClock | None = None
        # Wraps the closure of ``optimizer.step(closure)``: the check runs when it returns.
        self._closure_hook: Any = None
        self._closure_update = False  # an optimizer.step(closure) is in progress
        self._listening: backward_calls.Listening | None = None
        self._scaling: scaler_calls.Listening | None = None
        # The last ``scaler.scale(loss)`` of the step: (scaled, [loss], scaler), until the
        # backward() it feeds begins.
        self._scaled: tuple[torch.Tensor, list[torch.Tensor], Any] | None = None
        # A step checked when its scaled backward() ended: its update (or the scaler's skip)
        # ends it without another check.
        self._checked_at_backward = False
        self.scaler_overflows = 0  # non-finite scaled gradients that were the scaler's
        self._skips = 0  # scaler skips in a row
        self._last_scaled_loss: float | None = None  # the unscaled loss of the last check
        self._last_scaler: weakref.ref | None = None
        self._step_scale: float | None = None  # the scale of the step being checked
        self._error = ReportOnce("the NaN watch", "the job continues")
        self.last_replay: Any = None  # the replay object of the last detection (tests, UI)
        # watch/norms.ModuleNorms: per-module norms in the check's one read, for the history
        self.norms: Any = None
        self._bad_run: dict[str, Any] | None = None  # the detection of the current bad stretch
        self._still_bad: dict[str, Any] | None = None  # set by a check that found it still bad
        # In a job with no optimizer, check each step when its backward() ends (the agent's
        # watch: such a job calls no before_update() of its own).
        self._hand_updates: bool | None = None if backward_checks else False

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
        if self._explicit_roots:
            self._hook_roots()  # roots=() watches no module calls: the check alone
        else:
            self._discover()
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
        for h in (*self._global_hooks, *self._root_hooks):
            h.remove()
        self._global_hooks, self._root_hooks = [], []
        self._discovering = False
        if self._listening is not None:
            self._listening.remove()
            self._listening = None
        if self._scaling is not None:
            self._scaling.remove()
            self._scaling = None
        self._scaled = None
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
        return self._live_roots()

    def _live_roots(self) -> list[nn.Module]:
        live = [m for m in (r() for r in self._root_refs) if m is not None]
        if len(live) != len(self._root_refs):
            self._root_refs = [weakref.ref(m) for m in live]
        return live

    # -- finding and hooking top-level modules -------------------------------------------------
    def _discover(self) -> None:
        """Global module hooks until the next check: they find the top-level calls (and
        capture them meanwhile); every module call pays for them, on this step only."""
        for h in self._root_hooks:
            h.remove()
        self._root_hooks = []
        self._depth = 0
        self._global_hooks = [
            module_mod.register_module_forward_pre_hook(self._global_pre),
            module_mod.register_module_forward_hook(
                self._global_post, with_kwargs=True, always_call=True
            ),
        ]
        self._discovering = True

    def _end_discovery(self, found: list[nn.Module]) -> None:
        for h in self._global_hooks:
            h.remove()
        self._global_hooks = []
        self._discovering = False
        live = self._live_roots()
        known = {id(m) for m in live}
        for m in found:
            if id(m) not in known:
                known.add(id(m))
                self._root_refs.append(weakref.ref(m))
        self._hook_roots()

    def _hook_roots(self) -> None:
        for h in self._root_hooks:
            h.remove()
        self._depth = 0
        hooks = []
        for m in self._live_roots():
            pre, post = _RootHook(self, "_root_pre"), _RootHook(self, "_root_post")
            hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        self._root_hooks = hooks

    def _global_pre(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or self._replaying:
            return
        if threading.get_ident() != self._owner:
            return
        try:
            depth = self._depth
            self._depth = depth + 1
            if depth == 0:
                self._begin_call(module, args, None)  # kwargs: in the post-hook
        except Exception as exc:
            self._error("capturing a module call", exc)

    def _global_post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        # (kwargs, output) after a forward that returned. After one that raised, torch calls
        # global always_call hooks with (module, args, None) whatever with_kwargs said.
        if torch.compiler.is_compiling() or self._replaying:
            return
        if threading.get_ident() != self._owner:
            return
        try:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                if len(rest) == 2:
                    self._end_call(module, rest[0], rest[1])
                else:
                    self._pending = None  # the call raised: nothing of it reaches a gradient
        except Exception as exc:
            self._error("capturing a module call", exc)

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or self._replaying:
            return None
        if threading.get_ident() != self._owner:
            return None
        try:
            depth = self._depth
            self._depth = depth + 1
            if depth == 0:
                self._begin_call(module, args, kwargs)
        except Exception as exc:
            self._error("capturing a module call", exc)
        return None

    def _root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._global_post(module, args, kwargs, output)
        return None

    # -- capture -------------------------------------------------------------------------------
    def _begin_call(self, module: nn.Module, args: tuple, kwargs: dict | None) -> None:
        self._pending = None
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return  # evaluation: nothing of it reaches a gradient
        if len(self._calls) >= self.max_calls:
            self._overflow = True
            return
        if self._is_fsdp(module):
            # Never replayed (it would run FSDP's collectives on this rank alone): nothing to
            # capture, no graph to keep. The report says whose forward made it instead.
            self._fsdp_step = True
            return
        self._pending = Call(module, args, dict(kwargs) if kwargs is not None else None)

    def _is_fsdp(self, module: nn.Module) -> bool:
        known = self._fsdp_modules.get(module)
        if known is None:
            from torchscope.tracer.watch.replay import is_fsdp

            known = self._fsdp_modules[module] = is_fsdp(module)
        return known

    def _end_call(self, module: nn.Module, kwargs: dict, output: Any) -> None:
        call, self._pending = self._pending, None
        if call is None or call.module is not module:
            return
        if call.kwargs is None:
            call.kwargs = dict(kwargs or {})
        call.seq_hi = _get_sequence_nr()
        call.versions_after = versions_of(call.args, call.kwargs)
        outs = tensors_in(output)
        call.n_out = len(outs)
        ref = weakref.ref(self)
        for i, t in enumerate(outs):
            if t.requires_grad:
                call.handles.append(t.register_hook(_grad_catcher(ref, call, i)))
        self._calls.append(call)

    def _keep_grad(self, call: Call, i: int, grad: torch.Tensor) -> None:
        if self._replaying or call.released or grad is None:
            return
        with self._lock:
            old = call.out_grads.get(i)
            if old is not None:  # a second backward through the same output this step
                call.out_grads[i] = old + grad
                return
            n = grad.numel() * grad.element_size()
            if self._grad_bytes + n > self.capture_bytes:
                call.unit = True
                return
            self._grad_bytes += n
            call.grad_bytes += n
            call.out_grads[i] = grad

    # -- backward (backward_calls listener) ----------------------------------------------------
    def backward_begins(self, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if not self.installed or self._replaying or threading.get_ident() != self._owner:
            return None
        self._current_backward = None
        try:
            if "tensors" not in kwargs:
                # Called with positional arguments we cannot see: no loss check, no graph kept.
                self._unseen_backward = True
                return None
            roots = kwargs["tensors"]
            roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
            if not roots or not all(isinstance(r, torch.Tensor) for r in roots):
                return None  # GradientEdge roots
            retain = kwargs.get("retain_graph")
            user_retains = bool(kwargs.get("create_graph")) if retain is None else bool(retain)
            rec = Backward(roots, kwargs, user_retains, self._take_scaled(roots))
            self._backwards.append(rec)
            self._current_backward = rec
            if not self.keeping or self._fsdp_step:
                return None
            kept = [b for b in self._backwards if b.roots is not None]
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
                rec.marks = LoopMarks(roots, [(c.seq_lo, c.seq_hi) for c in self._calls])
                return None
            rec.roots = roots
            return {**kwargs, "retain_graph": True}
        except Exception as exc:
            self._error("before backward()", exc)
            return None

    def backward_ends(self, ok: bool) -> None:
        rec, self._current_backward = self._current_backward, None
        if rec is not None and not ok:
            rec.drop_graph()
            with contextlib.suppress(ValueError):
                self._backwards.remove(rec)
        elif rec is not None and rec.scaler is not None:
            # Under a loss scaler the step is checked now: the scaler may skip the update
            # (no optimizer.step() to check at), and a NaN must be named in the step that
            # made it, with that step's module state. "stop" raises from backward().
            self._checked_at_backward = True
            self._check_update(self._root_params(), ends_step=False)
        elif rec is not None and self._updates_by_hand():
            # No optimizer: the update is the job's own code, right after this. The
            # gradients are complete and the weights untouched, as at optimizer.step().
            self.before_update()

    # -- the loss scaler (scaler_calls listener) -----------------------------------------------
    def loss_scaled(self, scaler: Any, outputs: Any, scaled: Any) -> None:
        if not self.installed or self._replaying or threading.get_ident() != self._owner:
            return
        if isinstance(scaled, torch.Tensor) and isinstance(outputs, torch.Tensor):
            self._scaled = (scaled, [outputs], scaler)
        else:
            self._scaled = None  # several outputs scaled at once: read as the job passes them

    def _take_scaled(self, roots: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any] | None:
        """The unscaled loss and its scaler, when ``roots`` is what the scaler returned."""
        scaled, self._scaled = self._scaled, None
        if scaled is None or len(roots) != 1 or roots[0] is not scaled[0]:
            return None
        return scaled[1], scaled[2]

    def _scaled_backward(self) -> Backward | None:
        """The step's last backward() when a loss scaler scaled its root, with its scale."""
        rec = self._backwards[-1] if self._backwards else None
        if rec is None or rec.scaler is None:
            return None
        if rec.scale is None:
            rec.scale = scaler_calls.scale_of(rec.scaler)
        return rec

    def _note_scaled(self, rec: Backward, values: list[torch.Tensor]) -> None:
        """What the skip line says later: the last loss and the scaler (no sync: read off
        the loss already read, when it is one value)."""
        self._last_scaler = weakref.ref(rec.scaler)
        self._last_scaled_loss = None
        if len(values) == 1 and values[0].numel() == 1 and values[0].device.type == "cpu":
            with torch._C.DisableTorchFunction():
                self._last_scaled_loss = float(values[0])

    def _scaler_overflow(self, rec: Backward | None) -> bool:
        """Whether the step's non-finite gradients are the loss scaler's: its loss is finite
        and the same backward from the unscaled loss gives finite gradients (an fp16
        overflow of the scaled values, which the scaler skips). Without the step's graph it
        cannot be told; a scaled step is then taken to be the scaler's."""
        if rec is None:
            return False
        if rec.roots is None or not rec.unscaled:
            return True
        from torchscope.tracer.watch.replay import _Untraced, graph_leaves

        self._replaying = True  # the watch's own hooks stay out of it
        try:
            with _Untraced():
                leaves = [t for t in graph_leaves(rec.roots) if t.requires_grad]
            if not leaves:
                return True
            with torch._C.DisableTorchFunction():
                grads = torch.autograd.grad(
                    rec.unscaled, leaves, allow_unused=True, retain_graph=True
                )
                return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        finally:
            self._replaying = False

    def _compiled_roots(self) -> bool:
        """Whether a watched top-level module runs compiled (``torch.compile(model)`` or
        ``model.compile()``): its backward may not be retained."""
        # The step's own top-level calls too: on the first step the roots are still found.
        for m in (*self._live_roots(), *(c.module for c in self._calls)):
            if getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod"):
                return True
        return False

    def _updates_by_hand(self) -> bool:
        """Whether this job updates its weights by hand (it held no optimizer when its first
        backward ended): then each backward ends a step, and is checked there."""
        if self._hand_updates is None:
            self._hand_updates = not an_optimizer_exists()
        return self._hand_updates

    # -- the optimizer update (StepClock listener: nested step() calls are one update) ---------
    def update_begins(self, args: tuple, kwargs: dict) -> bool:
        """``optimizer.step()`` is about to apply the update: check the step (args[0] is the
        optimizer). Raises ``WatchStop`` under "stop", out of ``step()``, before the update.
        A step given a closure is checked when the closure returns instead (``_wrap_closure``):
        the closure makes the gradients, inside ``step()``."""
        if not self.installed or self._replaying:
            return False
        self._hand_updates = False  # an optimizer ends the steps after all
        if self._checked_at_backward:
            self._checked_at_backward = False
            self._end_step()  # checked when its scaled backward() ended
            return False
        if _closure_of(args, kwargs) is not None:
            self._closure_update = True
            return False
        self._check_update(_params_of(args[0]))
        return False  # nothing to restore if step() raises

    def update_ends(self) -> None:
        self._end_closure_update()  # a step(closure) that raised (or an unnumbered clock)

    def boundary(self, step: int) -> None:
        # The watch numbers steps with step_of (the agent's clock), else its own counter.
        self._end_closure_update()
        if self._checked_at_backward:  # the scaler skipped the update: the step ends here
            self._checked_at_backward = False
            self._end_step()
        if self._clock is not None and self._clock.counted_by == BY_SCALER:
            self._skips += 1
            if self._skips == SKIPS_TO_SAY:
                self._say_skips()
        else:
            self._skips = 0

    def _say_skips(self) -> None:
        """Once per stretch: the scaler has skipped many steps in a row (the classic AMP
        failure: a NaN every step, the scale falling towards zero)."""
        last = self._last_scaled_loss
        loss = "" if last is None else f"; the loss is {last:.4g}"
        scale = ""
        scaler = self._last_scaler() if self._last_scaler is not None else None
        if scaler is not None:
            with contextlib.suppress(Exception):
                scale = f" (its scale is now {scaler.get_scale():.3g})"
        with contextlib.suppress(Exception):
            self.report(
                f"torchscope: the loss scaler skipped {self._skips} steps in a row{scale}"
                f"{loss} (steps {self.step - self._skips}-{self.step - 1} made no update)"
            )

    def _check_update(self, params: list[torch.Tensor], *, ends_step: bool = True) -> None:
        """The check before an update; ``WatchStop`` under "stop". ``ends_step``: the step's
        captures go and the step counts (a closure's call ends its captures only: LBFGS calls
        it again within the same step)."""
        stop: WatchStop | None = None
        try:
            stop = self._stop(self.check(params))
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
        """
        stop = None
        try:
            detection = self.check(params)
            stop = self._stop(detection)
        finally:
            self._end_step(count=stop is None)  # a stopped update did not end its step
        if stop is not None:
            raise stop
        return detection

    def _stop(self, detection: dict[str, Any] | None) -> WatchStop | None:
        """Under "stop", what to raise before the update: every bad update is refused, the
        first of a bad stretch and each one after it (a notebook that runs the stopped cell
        again makes the same NaN: it must not reach the weights this time either)."""
        if self.on_nan != "stop":
            return None
        if detection is not None:
            return WatchStop(detection)
        run = self._still_bad
        if run is None:
            return None
        what = "a gradient norm above the limit" if run["what"] == GRADNORM else "NaN/Inf"
        line = (
            f"torchscope: still {what} at step {self.step} (first at step {run['step']}): "
            "stopped before the update"
        )
        with contextlib.suppress(Exception):
            self.report(line)
        return WatchStop({**run, "message": line, "step": self.step})

    def check(self, params: Iterable[torch.Tensor] | None = None) -> dict[str, Any] | None:
        """Check the current gradients of ``params`` (default: the watched modules') and the
        step's losses; on a detection replay the step, report it and return its dict.

        The optimizer pre-hook calls this; a job that updates its weights by hand can call it
        before its update. Does not end the step (the hook does, after it); never raises.
        """
        try:
            params = list(params) if params is not None else self._root_params()
            grads = [p.grad for p in params if p.grad is not None]
            values = [v for b in self._backwards for v in b.values]
            if not grads and not values:
                return None
            self.steps_checked += 1
            norms = self.norms
            scaled = self._scaled_backward()
            with torch.no_grad(), torch._C.DisableTorchFunction():
                if norms is None:
                    total = _total_norms(grads, values)
                else:  # the same totals, with each module's norm in the same read
                    total = norms.totals(params, grads, values)
                if scaled is not None and scaled.scale is not None:
                    # The scale in the same read: the gradients are scaled, the figures not.
                    scale = scaled.scale.to(total.device, total.dtype).reshape(1)
                    total = torch.cat([total, scale])
                row = total.tolist()  # the step's one host sync
            self._step_scale = None
            if scaled is not None and scaled.scale is not None:
                self._step_scale = row[-1]
                row = _unscaled(row[:-1], row[-1])
            grad_norm, loss_norm = row[0], row[1]
            if norms is not None:
                norms.took(self.step, row)
            if scaled is not None:
                self._note_scaled(scaled, values)
            what = None
            bad: list[int] = []
            in_loss = False
            if not (math.isfinite(grad_norm) and math.isfinite(loss_norm)):
                what, bad, in_loss = _confirm(grads, values)  # rare: a few more syncs
                if what is not None and not in_loss and self._scaler_overflow(scaled):
                    self.scaler_overflows += 1
                    what = None  # the scaler's own: it skips the update and shrinks its scale
            if what is None and self.gradnorm is not None and grad_norm > self.gradnorm:
                what = GRADNORM
            self._still_bad = None
            run = self._bad_run
            if run is not None and (what is None or _category(what) != _category(run["what"])):
                self._end_run()
                run = None
            if what is None:
                return None
            live = None
            if run is not None and run.get("unexplained") and not self.replay_wanted():
                # Traced live since a detection it could not place: named now if this step's
                # tracer found where it comes from (a loss scaler kept the weights clean).
                live = self._live_alert(run["step"])
            if run is not None and live is None:
                # Still bad (NaN weights stay NaN): counted, not replayed or reported again;
                # once per step (LBFGS calls its closure, checked each time, several times).
                if self.step != run["last_step"]:
                    run["repeats"] += 1
                    run["last_step"] = self.step
                self._still_bad = run
                return None
            det = self._detected(what, grad_norm, params, bad, in_loss, live)
            self._bad_run = det
            return det
        except Exception as exc:
            self._error("checking the step", exc)
            return None

    def _detected(
        self,
        what: str,
        grad_norm: float,
        params: list,
        bad: list[int],
        in_loss: bool,
        live: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        step = self.step
        det: dict[str, Any] = {
            "step": step,
            "what": what,
            "grad_norm": grad_norm,
            "in_loss": in_loss,
            "bad_params": self._param_names([params[i] for i in bad]),
            "origin": None,
            "where": None,
            "source": None,
            "module": None,
            "outside_modules": False,
            "reproduced": None,
            "replayed": False,
            "unit_gradient": False,
            "paused": False,
            "placed": False,  # a loop-code origin placed from marks, not replayed (compiled)
            "alerts": [],
            "events": [],
            "notes": [],
            "message": "",
            "repeats": 0,
            "last_step": step,
            "scale": self._step_scale,  # the loss scaler's, when one scaled the step
            "optimizer_step": self._optimizer_step(step),
        }
        if what in (NAN, INF) and not self.replay_wanted():
            self._take_live_origin(det, live)
        elif what in (NAN, INF):
            from torchscope.tracer.watch.replay import Replay

            replay = Replay(self, det)
            self.last_replay = replay
            replay.run()
            det["events"] = replay.events
            fsdp_arrival = det.get("fsdp") and not det.get("in_loss")
            if not det["reproduced"] and (
                fsdp_arrival
                or any(type(m).__name__ == "DistributedDataParallel" for m in self._live_roots())
            ):
                det["notes"].append(
                    "this rank's replay is finite: under DDP the NaN/Inf most likely came from "
                    "another rank through the gradient all-reduce (see that rank's report)"
                )
                from torchscope.tracer.rank_checks import note_watch_arrival

                # Linked to the origin the other rank publishes, as full tracing links it;
                # tracing the next steps here would only see it arrive again.
                det["arrived"] = note_watch_arrival(step, what)
            unplaced = det["outside_modules"] or not det["reproduced"]
            if self.keep_graph == "auto" and not self.keeping and unplaced:
                self.keeping = True
                det["notes"].append("the step's graph is kept from now on (keep_graph='auto')")
        det["message"] = describe(det, rank=_rank())
        self.detections.append(det)
        try:
            self.report(det["message"])
        except Exception as exc:
            self._error("reporting", exc)
        # Not named down to its op and line: the replay did not reproduce it, or it came from
        # the loop's own forward code, which is not re-run (most NaNs come back: catch it then).
        unexplained = (
            det["reproduced"] is False and not det["placed"] and not det.get("arrived")
        ) or bool(det.get("loop_forward"))
        det["unexplained"] = unexplained
        if unexplained and self.on_unreproduced is not None:
            try:
                self.on_unreproduced(det)
            except Exception as exc:
                self._error("on_unreproduced", exc)
        return det

    def _live_alert(self, after: int = -1) -> dict[str, Any] | None:
        """The live tracer's first origin alert of the current step (after step ``after``)."""
        try:
            alert = self.live_origin()
        except Exception as exc:
            self._error("reading the live tracer's origin", exc)
            return None
        if alert is None or alert.get("step") != self.step or self.step <= after:
            return None
        return alert

    def _take_live_origin(self, det: dict[str, Any], alert: dict[str, Any] | None) -> None:
        """The step was traced live: its tracer's first origin alert is the detection's origin
        (one origin for one NaN, in the tracer's own words)."""
        if alert is None:
            alert = self._live_alert()
        if alert is None:
            det["notes"].append("the step was traced live and its tracer named no origin in it")
            det["reproduced"] = False
            return
        det.update(
            reproduced=True,
            traced_live=True,
            origin=alert.get("name"),
            where=alert.get("where"),
            source=alert.get("source"),
            module=alert.get("module") or None,
            origin_what=alert.get("what"),
            aten=alert.get("aten"),
        )

    def _end_run(self) -> None:
        """The steps after a detection are fine again (or bad in another way): say how long
        the bad stretch lasted, if it outlived its first step."""
        run, self._bad_run = self._bad_run, None
        if run is not None and run["repeats"]:
            what = "a gradient norm above the limit" if run["what"] == GRADNORM else "NaN/Inf"
            with contextlib.suppress(Exception):
                self.report(
                    f"torchscope: {what} from step {run['step']} lasted {run['repeats'] + 1} "
                    f"checked steps (to step {run['last_step']}; reported once)"
                )

    def _optimizer_step(self, step: int) -> int | None:
        """The optimizer's own number for ``step`` when a loss scaler has skipped updates
        (steps are the loop's iterations), else None. Known when the watch started at 0."""
        clock = self._clock
        if clock is None or not clock.skipped or self._started_at != 0:
            return None
        return step - clock.skipped

    def _root_params(self) -> list[torch.Tensor]:
        """The watched modules' parameters (on the first step, while they are still being
        found, those of the step's top-level calls so far)."""
        out, seen = [], set()
        modules = self._live_roots()
        if self._discovering:
            modules += [c.module for c in self._calls]
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _param_names(self, tensors: list[torch.Tensor]) -> list[str]:
        if not tensors:
            return []
        names = {}
        for m in self._live_roots():
            for n, p in replay_target(m).named_parameters():
                names.setdefault(id(p), n)
        return [names.get(id(t), f"<tensor {tuple(t.shape)}>") for t in tensors]

    # -- step end ------------------------------------------------------------------------------
    def _end_step(self, count: bool = True) -> None:
        """Drop the step's captures (and the watch's hold on its graph); ``count``: the step
        ended (numbered; the modules looked for again if they changed)."""
        calls, had_backward = self._drop_captures()
        if not count:
            return
        self._step += 1
        self._look_again(calls, had_backward)

    def _end_captures(self) -> None:
        """A closure's call was checked: drop what it captured, the step goes on (unnumbered)."""
        self._look_again(*self._drop_captures())

    def _drop_captures(self) -> tuple[list[Call], bool]:
        calls, self._calls = self._calls, []
        for call in calls:
            call.release()
        for b in self._backwards:
            b.drop_graph()
        had_backward = bool(self._backwards) or self._unseen_backward
        self._backwards = []
        self._pending = None
        self._current_backward = None
        self._grad_bytes = 0
        self._overflow = False
        self._unseen_backward = False
        self._fsdp_step = False
        return calls, had_backward

    def _look_again(self, calls: list[Call], had_backward: bool) -> None:
        if not self.installed or self._explicit_roots:
            return
        if self._discovering:
            if calls or self._root_refs:
                self._end_discovery([c.module for c in calls])
        elif had_backward and not calls:
            self._discover()  # the model was replaced (or compiled) since: look again


# -- helpers ---------------------------------------------------------------------------------
class _RootHook:
    """The watch's hook on a watched top-level module, which copies and pickles of the module
    do not take along: ``copy.deepcopy`` (an EMA model, ``AveragedModel``) and pickling
    (``torch.save(model)``) get an inert stand-in made of the standard library, so the copy
    needs neither this watch (its locks cannot be copied) nor torchscope to load."""

    __slots__ = ("_method", "_watch")

    def __init__(self, watch: NanWatch, method: str) -> None:
        self._watch = weakref.ref(watch)
        self._method = method

    def __call__(self, *args: Any) -> None:
        watch = self._watch()
        if watch is not None:
            getattr(watch, self._method)(*args)

    def __reduce__(self) -> tuple:
        # sys.audit("...", module, args, ...) returns None and does nothing unless the
        # program installed an audit hook: a no-op hook for any signature.
        return (functools.partial, (sys.audit, "torchscope.inactive_hook"))


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


def _unscaled(row: list[float], scale: float) -> list[float]:
    """A check's row read off scaled gradients, as the job's unscaled values: the total
    gradient norm divided by the scale, the loss as it is, each module's sum of squares by
    the scale squared."""
    if not scale or not math.isfinite(scale):
        return row
    return [row[0] / scale, row[1], *(x / (scale * scale) for x in row[2:])]


def _category(what: str) -> str:
    return GRADNORM if what == GRADNORM else "nonfinite"


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Values whose L2 norm is ``t``'s: a sparse tensor's stored values, a complex tensor's
    real and imaginary parts (``foreach_norm`` takes no real dtype for complex input). A
    DTensor (FSDP2) gives its local shard: the figures are this rank's (the whole would take
    a collective, which hangs the job if the ranks' checks ever disagree)."""
    local = local_shard(t)
    if local is not None:
        t = local
    if t.is_sparse:
        t = t._values()
    if t.is_complex():
        t = torch.view_as_real(t.conj() if t.is_conj() else t)  # |conj z| = |z|
    return t


def _norm_of(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of all ``tensors`` together, as a float32 0-d tensor on ``device``; NaN if any
    is NaN, Inf if any is Inf (or the squares overflow). No host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        # Nearly every gradient is a plain dense real tensor: read as it is (the check runs
        # every step, over every gradient; _dense's questions cost more than the norm here).
        if type(t) is not torch.Tensor or t.is_sparse or t.is_complex():
            t = _dense(t)
        groups.setdefault((t.device, t.dtype), []).append(t)
    parts = []
    for (dev, dtype), ts in groups.items():
        norms = _foreach_norms(ts, dtype)
        if norms is None:
            continue
        part = torch.linalg.vector_norm(torch.stack(norms)).float()
        parts.append(part if dev == device else part.to(device))
    return _combined(parts, device)


def _foreach_norms(ts: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Each tensor's L2 norm, in one fused call (half precisions reduced in float32); None
    for a dtype that has none (integers, bool)."""
    if dtype in (torch.float32, torch.float64):
        return torch._foreach_norm(ts)
    if dtype.is_floating_point:
        return torch._foreach_norm(ts, dtype=torch.float32)
    return None


def _combined(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of several parts' norms (0 without any), on ``device``."""
    if not parts:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack(parts)) if len(parts) > 1 else parts[0]


def _total_norms(grads: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    device = (grads or values)[0].device
    return torch.stack([_norm_of(grads, device), _norm_of(values, device)])


def _confirm(
    grads: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[str | None, list[int], bool]:
    """Exact verdict after a non-finite norm: ("nan"/"inf"/None, indices of bad grads, whether
    a loss is bad)."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        kinds = []
        for t in (*grads, *values):
            t = _dense(t)
            if not (t.dtype.is_floating_point or t.dtype.is_complex):
                kinds.append((False, False))
                continue
            kinds.append((bool(torch.isnan(t).any()), bool(torch.isinf(t).any())))
    bad = [i for i, (n, f) in enumerate(kinds[: len(grads)]) if n or f]
    in_loss = any(n or f for n, f in kinds[len(grads) :])
    if any(n for n, _ in kinds):
        return NAN, bad, in_loss
    if any(f for _, f in kinds):
        return INF, bad, in_loss
    return None, [], False


def _rank() -> int | None:
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return int(os.environ["RANK"])
    except (KeyError, ValueError):
        pass
    return None


def _print_report(text: str) -> None:
    say_line(text)  # already says who (and which rank)


def _short(source: str | None) -> str | None:
    if not source:
        return source
    path, sep, line = source.rpartition(":")
    if not sep:
        return source
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    return f"{rel if not rel.startswith('..') else path}:{line}"


def describe(det: dict[str, Any], rank: int | None = None) -> str:
    """The one line a detection prints."""
    who = f"torchscope[rank {rank}]" if rank is not None else "torchscope"
    step = _step_words(det)
    if det["what"] == GRADNORM:
        return f"{who}: gradient norm {det['grad_norm']:.4g} above the limit at step {step}"
    noun = "NaN" if det["what"] == NAN else "Inf"
    if det["reproduced"]:
        noun = "NaN" if det.get("origin_what", det["what"]) == NAN else "Inf"
        source = _short(det.get("source"))
        at = f" at {source}" if source else ""
        at = (f" in {det['module']}" if det.get("module") else "") + at
        if det.get("loop_forward"):
            site = _short(det.get("backward_source"))
            return (
                f"{who}: {noun} first appears at step {step} in the forward, outside the module "
                "calls (training-loop code: the loss is non-finite, the replayed modules' "
                f"outputs are not{f'; backward() at {site}' if site else ''}); in the backward "
                f"it first shows at {det['backward_node']} — replayed"
            )
        if det["where"] == "input":
            text = f"{who}: {noun} enters at step {step} as {det['origin']}{at}"
        else:
            origin, where = det["origin"], det["where"]
            if det.get("aten"):  # the replay ran at the aten level: the kernel, then its op
                origin = f"{det['aten']} inside {origin}"
            text = f"{who}: {noun} first appears at step {step} in {origin} ({where}){at}"
        if det.get("outside_modules"):
            site = _short(det.get("backward_source"))
            text += " outside the module calls (training-loop code"
            text += f"; backward() at {site})" if site else ")"
        text += " — traced live" if det.get("traced_live") else " — replayed"
        if det.get("unit_gradient"):
            text += " (backward from a unit gradient: output gradients were above the capture cap)"
        return text
    if det.get("placed"):
        noun = "NaN" if det.get("origin_what", det["what"]) == NAN else "Inf"
        return _placed_line(det, who, noun)
    if det.get("outside_modules"):
        return (
            f"{who}: {noun} first appears at step {step} in the backward, outside the module "
            "calls (training-loop code between the loss and the modules' outputs: the "
            "gradients arriving at those outputs are already non-finite); not replayed there: "
            + ("; ".join(det.get("notes") or []) or "the step's graph was not kept")
        )
    where = "the loss" if det.get("in_loss") and not det.get("bad_params") else "the gradients"
    if det.get("fsdp") and det.get("in_loss"):
        return (
            f"{who}: {noun} in the loss at step {step}: this rank's own forward made it (under "
            "FSDP the step is not replayed: its collectives would run on this rank alone)"
        )
    if det.get("fsdp") and det.get("arrived"):
        return (
            f"{who}: {noun} in the gradients at step {step} came from another rank through "
            "FSDP's gradient reduce-scatter (this rank's loss is finite); linked to that rank's "
            "origin when it names it"
        )
    if det.get("arrived"):
        return (
            f"{who}: {noun} in {where} at step {step}, but the replay did not reproduce it: "
            "this rank's replay is finite, so it came from another rank through the gradient "
            "all-reduce; linked to that rank's origin when it names it"
        )
    reasons = "; ".join(det.get("notes") or []) or "no replayed op or node made it"
    return (
        f"{who}: {noun} in {where} at step {step}, but the replay did not reproduce it "
        f"({reasons}) — origin unknown"
    )


def _step_words(det: dict[str, Any]) -> str:
    """``12``, or ``12 (optimizer step 5)`` when a loss scaler skipped updates before it."""
    opt = det.get("optimizer_step")
    return f"{det['step']}" if opt is None else f"{det['step']} (optimizer step {opt})"


def _placed_line(det: dict[str, Any], who: str, noun: str) -> str:
    """A loop-code origin placed from the marks of the step's own backward (a compiled model
    keeps no graph to replay it over)."""
    site = _short(det.get("backward_source"))
    at = f"; backward() at {site}" if site else ""
    how = "placed, not replayed (a compiled model keeps no graph to replay)"
    if det.get("loop_forward"):
        return (
            f"{who}: {noun} first appears at step {_step_words(det)} in the forward, outside the "
            "module calls (training-loop code: the loss is non-finite, the replayed modules' "
            f"outputs are not{at}); in the backward it first shows at {det['backward_node']} "
            f"— {how}"
        )
    return (
        f"{who}: {noun} first appears at step {_step_words(det)} in {det['origin']} (backward) "
        f"outside the module calls (training-loop code{at}) — {how}"
    )
