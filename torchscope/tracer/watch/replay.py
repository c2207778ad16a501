"""Replay of one bad step under full tracing, before its update; leaves no trace in the job.

Phases, each traced by the replay's tracer (its alerts say where NaN/Inf first appears,
exactly as in a fully traced run):

1. **forward**: every captured top-level module call again, in order, with its arguments,
   grad mode, autocast state and the RNG state it started with (weights are unchanged: the
   optimizer has not stepped). DDP/DataParallel/compiled wrappers are unwrapped.
2. **module backward**: ``torch.autograd.grad`` from those calls' outputs with the gradients
   captured there (a unit gradient above the capture cap when no retained graph covers it),
   over the replayed, traced graph: its nodes carry their op, module and source line.
3. **retained backward** (only while no origin is found): ``torch.autograd.grad`` again over
   the step's own graph, kept by ``retain_graph=True``, from the loss with its own
   gradient: covers nodes outside module calls (loop code). Those nodes were made untraced,
   so a node's source is found by its autograd sequence number: one inside a module call's
   window maps to the replayed node at the same offset (same name required); one outside
   every window is loop code.
The loop's own forward code is not re-run: what it did was recorded as the step ran
(``loop_code.LoopOps``). When the loss is non-finite and the replayed module calls are finite,
the op of the loop's code that made it is the origin, and phases 2-4 do not run.

4. **placement** (no origin yet, no graph kept: a compiled model): the first loop-code node
   that the step's own backward, marked as it ran (``capture.LoopMarks``), fed finite
   gradients and saw send non-finite ones. Named, not replayed: no trace of it.

``torch.autograd.grad`` (never ``backward``) leaves every ``.grad`` alone and does not run
AccumulateGrad's hooks (DDP's reducer, optimizer-in-backward). Module buffers changed by the
replay are copied back, and the RNG states restored: the job goes on as if nothing happened.
Global optimizer hooks registered while replaying (a tracer's step clock) go to a scratch
table: the replay runs inside an optimizer pre-hook, whose table Python is iterating.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.autograd.graph import get_gradient_edge
from torch.optim import optimizer as optimizer_mod
from torch.utils._python_dispatch import _disable_current_modes

from torchscope.protocol.events import ALERT, ATEN
from torchscope.tracer.armed.backward import NODE_ID, NODE_MOD, NODE_OP, NODE_SRC, node_name
from torchscope.tracer.eager import rng_state, set_rng_state
from torchscope.tracer.in_place import running_eagerly
from torchscope.tracer.ranks import say
from torchscope.tracer.watch import fsdp_replay
from torchscope.tracer.watch.capture import (
    REPLAY_ATEN,
    Call,
    StepCaptures,
    tensors_in,
    versions_of,
)

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer
    from torchscope.tracer.watch.loop_code import LoopOps, LoopOrigin


class ReplayedWatch(Protocol):
    """The watch, as a replay of its bad step reads it (tracer/watch/nan_watch.py)."""

    captured: StepCaptures  # what the step ran: its top-level module and backward() calls
    _replaying: bool  # set while the replay runs (the watch ignores its own calls)
    max_calls: int
    on_nan: str
    on_spike: str
    tracer_factory: Callable[[int], Tracer] | None
    loop: LoopOps  # the loop's own code between module calls, as the step ran it


def default_tracer(step: int) -> Tracer:
    """An in-memory tracer numbered ``step`` that neither counts steps nor hooks optimizers."""
    from torchscope.tracer.armed.session import Tracer

    tracer = Tracer(
        keep=True,
        optimizer_steps=False,
        optimizer_ops=True,
        aten=REPLAY_ATEN,
        metadata={"replay_of_step": step},
    )
    tracer.step_index = step
    return tracer.start()


@contextlib.contextmanager
def isolated_optimizer_hooks():
    """Global optimizer hooks registered (and removed) inside go to scratch tables."""
    pre, post = (
        optimizer_mod._global_optimizer_pre_hooks,
        optimizer_mod._global_optimizer_post_hooks,
    )
    optimizer_mod._global_optimizer_pre_hooks = OrderedDict()
    optimizer_mod._global_optimizer_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer_mod._global_optimizer_pre_hooks = pre
        optimizer_mod._global_optimizer_post_hooks = post


class _Untraced:
    """The replay's own bookkeeping ops stay out of the trace, at both levels. (Under the
    aten mode, a saved Python scalar -- ``loss * float("nan")`` saves one as a wrapped number
    -- would reach the mode as a float, and reading it would fail.)"""

    def __enter__(self) -> None:
        self._ctx = torch._C.DisableTorchFunction()
        self._ctx.__enter__()
        self._modes = _disable_current_modes()
        self._modes.__enter__()
        self._grad = torch.no_grad()
        self._grad.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._grad.__exit__(*exc)
        self._modes.__exit__(*exc)
        self._ctx.__exit__(*exc)


def graph_nodes(roots: list[torch.Tensor]) -> list[Any]:
    """Every node reachable from ``roots`` (wrappers held, so ``id`` is stable meanwhile)."""
    nodes: list[Any] = []
    seen: set[int] = set()
    todo = [get_gradient_edge(r).node for r in roots if r.requires_grad]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return nodes


def graph_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = []
    for node in graph_nodes(roots):
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves.append(var)
    return leaves


def graph_saved_bytes(roots: list[torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages a retained graph's nodes hold through their saved
    tensors, not counting leaves (parameters) and ``exclude`` (inputs): what a non-retaining
    backward would have freed. For measurement, not for the hot path."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    nodes = graph_nodes(roots)
    for node in nodes:
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            skip.add(var.untyped_storage().data_ptr())
    sizes: dict[int, int] = {}
    for node in nodes:
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except Exception:  # freed, or not a tensor-valued field
                continue
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    if ptr and ptr not in skip:
                        sizes[ptr] = st.nbytes()
    return sum(sizes.values())


class Replay:
    def __init__(self, watch: ReplayedWatch, detection: dict[str, Any]) -> None:
        self.watch = watch
        self.det = detection
        self.calls: list[Call] = list(watch.captured.calls)
        self.kept = [b for b in watch.captured.backwards if b.roots is not None]
        self.marked = [b for b in watch.captured.backwards if b.marks is not None]
        self.step = detection["step"]
        self.events: list[dict] = []
        self.tracer: Tracer | None = None
        self.replayed: list[tuple[Call, Any, int, int]] = []  # (call, output, seq lo, seq hi)
        self._retained_roots: list[torch.Tensor] | None = None
        self.seconds = 0.0
        self.loop: LoopOrigin | None = None  # where the loop's own code made the loss's value
        self.faithful = True  # the calls' inputs are as the step saw them
        self.fsdp = False  # every rank replays the step together: a forward under no_grad

    # -- the whole replay ------------------------------------------------------------------
    def run(self) -> None:
        det, notes, watch = self.det, self.det["notes"], self.watch
        if watch.captured.overflow:
            notes.append(
                f"more than {watch.max_calls} module calls this step: later ones not replayed"
            )
        if watch.captured.unseen_backward and not self.kept:
            notes.append("backward() was called in a way the watch cannot see: no graph kept")
        self._read_loop()
        if watch.captured.fsdp or any(is_fsdp(c.target) for c in self.calls):
            det["fsdp"] = True  # said by the watch's line: whose forward made it
            loop = self.loop if self.loop is not None and not self.loop.entered else None
            why_not = fsdp_replay.agree(self.step, loop is None, say)
            if loop is not None:
                self._found_in_loop(loop)  # this rank's loop code: no replay needed
                return
            if why_not is not None:
                notes.append(f"{_fsdp_note(det)} ({why_not})")
                det["reproduced"] = False
                return
            self.fsdp = True
        if not self.calls and self.loop is not None:
            self._found_in_loop(self.loop)  # no module call to replay before it
            return
        if not self.calls and not self.kept and not self.marked:
            notes.append("nothing of the step was captured (no top-level module call with grad)")
            det["reproduced"] = False
            return
        faithful = self.faithful = not self._note_changed_inputs()
        t0 = time.perf_counter()
        watch._replaying = True
        with _Untraced():
            saved_rng = rng_state()
            buffers = self._save_buffers()
        forward_finite = False
        try:
            with isolated_optimizer_hooks():
                self._traced_phases()
            forward_finite = faithful and self._forward_finite()
        except Exception as exc:
            notes.append(f"the replay failed: {type(exc).__name__}: {_first_line(exc)}")
        finally:
            if self.fsdp:
                with _Untraced():
                    fsdp_replay.reshard([c.target for c in self.calls])
            # Nothing of the step outlives the replay: its graphs, inputs and the tracer go
            # now; the events (plain data) stay for whoever looks at the detection.
            self.replayed, self.calls, self.kept, self._retained_roots = [], [], [], None
            self.marked = []
            self.tracer = None
            try:
                with _Untraced():
                    self._restore_buffers(buffers)
                    set_rng_state(saved_rng)
            finally:
                watch._replaying = False
            self.seconds = time.perf_counter() - t0
        det["replayed"] = True
        det["replay_seconds"] = self.seconds
        det["alerts"] = [e for e in self.events if e.get("kind") == ALERT]
        if det["reproduced"] is None:
            det["reproduced"] = False
            if det.get("in_loss") and not det.get("placed") and forward_finite:
                # The loss is non-finite and every module call replayed finite: the loop's
                # own forward code made it (not re-run; with no graph kept, no node to show).
                det.update(loop_forward=True, where="forward", outside_modules=True)
                if watch.captured.backwards:
                    det["backward_source"] = watch.captured.backwards[0].source

    @contextlib.contextmanager
    def _traced(self) -> Iterator[Tracer]:
        """The replay's tracer, started, its events in :attr:`events`, its pause breakpoints
        set (:meth:`_pause_breakpoint`); stopped and removed after."""
        factory = self.watch.tracer_factory or default_tracer
        tracer = self.tracer = factory(self.step)
        pipeline = _pipeline_of(tracer)
        bps: list[int] = []
        try:
            if pipeline is not None:
                with pipeline.lock:
                    pipeline.flush(wait=True)  # what came before is not the replay
                    pipeline.sinks.insert(0, self._sink)
            bps = self._pause_breakpoint(tracer)
            yield tracer
        finally:
            stepper = tracer.stepper
            for bp in bps:
                if stepper is not None:
                    with contextlib.suppress(Exception):  # gone already: nothing to undo
                        stepper.delete_breakpoint(bp)
            try:
                tracer.stop()
            finally:
                if pipeline is not None:
                    with pipeline.lock, contextlib.suppress(ValueError):
                        pipeline.sinks.remove(self._sink)

    def _traced_phases(self) -> None:
        with self._traced():
            self._phases()

    def _phases(self) -> None:
        self._forward()
        self._flush()
        origin = self._first_alert(("forward", "input"))
        loop = self.loop
        if loop is not None and (
            (origin is None and self._forward_finite() and (self.faithful or not loop.entered))
            or (origin is not None and origin.get("where") == "input" and not loop.entered)
        ):
            # The modules made nothing non-finite (one took it in) and the loop's code
            # made it: its op and line, as the step ran it.
            self._found_in_loop(loop)
            return
        self._guarded("module backward", self._module_backward)
        self._flush()
        if origin is None:
            origin = self._first_alert(("backward",))
        if origin is None and not self.det.get("in_loss") and self._bad_output_grads():
            # Finite loss, non-finite gradient at a module's output: loop code made it.
            self.det["outside_modules"] = True
        if origin is None and self.kept:
            mark = len(self.events)
            self._guarded("backward over the step's graph", self._retained_backward)
            self._flush()
            origin = self._first_alert(("backward",), start=mark)
            tainted = origin is not None and self._locate(origin)
            # A loop-code node of a step whose loss is non-finite (``x / 0``, ``log(0)``:
            # their nodes save finite values) shows what the forward made, as a tainted
            # one does: the replayed module calls are finite, so loop code made it.
            loop_loss = bool(self.det.get("in_loss")) and self.det["outside_modules"]
            if origin is not None and (tainted or loop_loss):
                # The node computed from NaN/Inf the step's forward saved in it: a forward
                # NaN arriving, not a backward origin (a traced run would not blame it).
                name = origin.get("name")
                if not self.det["outside_modules"]:
                    self.det["notes"].append(
                        f"the step's own graph holds NaN/Inf saved by {name} in a module "
                        "call, but the replayed forward is finite"
                    )
                    self.det["source"] = self.det["module"] = None
                    origin = None
                else:
                    # Made by forward loop code (not re-run): the node is only where the
                    # backward first shows it.
                    self._found(origin)
                    self.det.update(
                        loop_forward=True, backward_node=name, where="forward", origin=None
                    )
                    return
        if origin is not None:
            self._found(origin)
        elif self.marked:
            self._place_from_marks()

    def _read_loop(self) -> None:
        """Where the loop's own code made the loss non-finite (or took it in), read before
        the replay runs anything."""
        if not self.det.get("in_loss"):
            return
        try:
            inputs = [t for c in self.calls for t in tensors_in((c.args, c.kwargs or {}))]
            self.loop = self.watch.loop.origin(inputs)
        except Exception as exc:
            self.det["notes"].append(
                f"reading the loop's code failed: {type(exc).__name__}: {_first_line(exc)}"
            )

    def _found_in_loop(self, found: LoopOrigin) -> None:
        det = self.det
        det.update(
            reproduced=True,
            loop_code=True,
            outside_modules=True,
            where="forward",
            origin=found.op,
            source=found.source,
            library=found.library,
            origin_what=found.what,
            entered=found.entered,
            unsure=found.unsure,
            module=None,
        )
        if self.watch.on_nan == "pause":
            det["notes"].append(
                "on_nan=pause: the origin is in the loop's code, which a replay does not run "
                "again: nothing to pause at"
            )

    def _guarded(self, what: str, phase: Any) -> None:
        """A phase that fails (a graph changed in place since) leaves the others' findings."""
        try:
            phase()
        except Exception as exc:
            self.det["notes"].append(
                f"the replay's {what} failed: {type(exc).__name__}: {_first_line(exc)}"
            )

    def _sink(self, events: list[dict]) -> None:
        for e in events:
            e["replay"] = True
        self.events.extend(events)

    def _flush(self) -> None:
        pipeline = _pipeline_of(self.tracer)
        if pipeline is not None:
            with pipeline.lock:
                pipeline.flush(wait=True)

    def _pause_breakpoint(self, tracer: Tracer) -> list[int]:
        """Breakpoints at the replay's NaN and Inf origins (the check may see NaN where the
        origin made an Inf); removed after the replay."""
        if self.watch.on_nan != "pause":
            return []
        stepper = getattr(tracer, "stepper", None)
        if stepper is None:
            self.det["notes"].append("on_nan=pause: no UI or stepper to pause for, continuing")
            return []
        self.det["paused"] = True
        return [
            stepper.add_breakpoint({"nan": what, "step": self.step})["id"]
            for what in ("nan", "inf")
        ]

    # -- phase 1: forward ------------------------------------------------------------------
    def _forward(self) -> None:
        for call in self.calls:
            assert call.rng is not None  # a replayed call is not released yet
            with _Untraced():
                set_rng_state(call.rng)
            with contextlib.ExitStack() as stack:
                # Under FSDP no backward follows: without grad, FSDP's forward registers none.
                stack.enter_context(torch.no_grad() if self.fsdp else torch.enable_grad())
                stack.enter_context(running_eagerly(call.target))  # model.compile()'s own code
                for dev, dtype in call.autocast:
                    stack.enter_context(torch.autocast(dev, dtype=dtype))
                with _Untraced():
                    args, kwargs = _cut(call.args), _cut(call.kwargs or {})
                lo = torch._C._autograd._get_sequence_nr()
                try:
                    out = called_at(call.site, call.target, args, kwargs)
                except Exception as exc:
                    self.det["notes"].append(
                        f"replaying {type(call.target).__name__} raised "
                        f"{type(exc).__name__}: {_first_line(exc)}"
                    )
                    return
                hi = torch._C._autograd._get_sequence_nr()
            self.replayed.append((call, out, lo, hi))

    # -- phase 2: backward over the replayed module graphs -----------------------------------
    def _module_backward(self) -> None:
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        unit = False
        covered = bool(self.kept)
        # Under a loss scaler the captured gradients are scaled: replayed as the unscaled
        # loss would make them (an overflow of the scaled values is the scaler's, not a bug).
        scale = self.det.get("scale")
        with _Untraced():
            for call, out, _lo, _hi in self.replayed:
                for i, t in enumerate(tensors_in(out)):
                    if not t.requires_grad:
                        continue
                    g = call.out_grads.get(i)
                    if g is None:
                        if not call.unit or covered:
                            continue
                        g = torch.ones_like(t)
                        unit = True
                    if g.shape != t.shape:
                        continue
                    if scale and call.out_grads.get(i) is g:
                        g = g / scale
                    outs.append(t)
                    grads.append(g)
            leaves = graph_leaves(outs) if outs else []
        if not leaves:
            return
        self.det["unit_gradient"] = unit
        torch.autograd.grad(outs, leaves, grad_outputs=grads, allow_unused=True)

    # -- phase 3: backward over the step's retained graph ------------------------------------
    def _retained_backward(self) -> None:
        for rec in self.kept:
            roots = rec.roots
            if roots is None:
                continue
            with _Untraced():
                inputs = rec.inputs
                if inputs is None:
                    leaves = graph_leaves(roots)
                else:
                    leaves = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
                gt = rec.grad_tensors
                if isinstance(gt, torch.Tensor):
                    gt = [gt]
                if rec.unscaled:  # from the loss before the scaler scaled it
                    roots, gt = rec.unscaled, None
            if not leaves:
                continue
            self.det["backward_source"] = rec.source
            self._retained_roots = roots
            torch.autograd.grad(
                roots,
                leaves,
                grad_outputs=gt,
                allow_unused=True,
                # Kept: the origin's saved tensors are read afterwards (were they finite?). The
                # graph goes with the step's references to it, right after the check.
                retain_graph=True,
            )

    # -- no graph kept (a compiled model): place a loop-code origin from the step's marks ---
    def _place_from_marks(self) -> None:
        """The replayed modules made no NaN/Inf: the loop code did. Its nodes were marked as
        the step's own backward ran them: the first that got finite gradients and sent
        non-finite ones is where it shows (a forward origin when the loss is non-finite)."""
        det = self.det
        for rec in self.marked:
            found = rec.marks.first_poisoned() if rec.marks is not None else None
            if found is None:
                continue
            node, what = found
            det.update(outside_modules=True, placed=True, backward_node=node, origin_what=what)
            det["backward_source"] = rec.source
            if det.get("in_loss"):
                det.update(loop_forward=True, where="forward")
            else:
                det.update(origin=node, where="backward")
            return
        if any(rec.marks is not None and rec.marks.truncated for rec in self.marked):
            det["notes"].append("the loop code's graph was too large to mark all its nodes")

    def _forward_finite(self) -> bool:
        """Every captured module call replayed, and none made or took a NaN/Inf."""
        return (
            bool(self.calls)
            and not self.watch.captured.overflow
            and len(self.replayed) == len(self.calls)
            and self._first_alert(("forward", "input")) is None
        )

    def _bad_output_grads(self) -> bool:
        """A gradient that arrived non-finite at a module call's output (all of them exact)."""
        if any(call.unit for call in self.calls):
            return False
        with _Untraced():
            return any(
                not bool(torch.isfinite(g).all())
                for call in self.calls
                for g in call.out_grads.values()
                if g.is_floating_point()
            )

    # -- verdicts ----------------------------------------------------------------------------
    def _first_alert(self, wheres: tuple[str, ...], start: int = 0) -> dict | None:
        for e in self.events[start:]:
            if (
                e.get("kind") == ALERT
                and e.get("where") in wheres
                and e.get("what") in ("nan", "inf")
            ):
                return e
        return None

    def _found(self, alert: dict) -> None:
        det = self.det
        det["reproduced"] = True
        det["where"] = alert.get("where")
        det["origin"] = alert.get("name")
        det["aten"] = alert.get("aten")  # the kernel, when the replay saw the aten level
        # The kernel's own line where the replay saw one (inside a custom Function's
        # backward: the line there that made the value), else the op's or node's.
        det["source"] = det.get("source") or self._aten_source(alert) or alert.get("source")
        det["module"] = det.get("module") or alert.get("module") or None
        det["origin_what"] = alert.get("what")
        det["alert"] = alert

    def _aten_source(self, alert: dict) -> str | None:
        seq = alert.get("aten_seq")
        if seq is None:
            return None
        call = next((e for e in self.events if e.get("seq") == seq and e.get("kind") == ATEN), None)
        return call.get("source") if call is not None else None

    def _locate(self, alert: dict) -> bool:
        """Source and module of a node of the step's own (untraced) graph, through the
        replayed node at the same sequence-number offset of the same module call. Returns
        whether the node holds non-finite saved tensors (its forward made them)."""
        node_id = alert.get("node_id")
        roots = self._retained_roots
        if node_id is None or roots is None:
            return False
        with _Untraced():
            node = next((n for n in graph_nodes(roots) if n.metadata.get(NODE_ID) == node_id), None)
            if node is None:
                return False
            tainted = _holds_nonfinite(node)
            self._place(node)
        return tainted

    def _place(self, node: Any) -> None:
        seq, name = node._sequence_nr(), node_name(node)
        for call, out, lo, hi in self.replayed:
            if not call.seq_lo <= seq < call.seq_hi:
                continue
            if call.seq_hi - call.seq_lo != hi - lo:
                return  # the replay made a different number of nodes: no claim
            want = lo + (seq - call.seq_lo)
            for n in graph_nodes(tensors_in(out)):
                md = n.metadata
                if n._sequence_nr() == want and node_name(n) == name and NODE_OP in md:
                    self.det["source"] = md.get(NODE_SRC)
                    self.det["module"] = md.get(NODE_MOD) or None
                    return
            return
        if not any(c.seq_lo <= seq < c.seq_hi for c in self.calls):
            self.det["outside_modules"] = True

    def _note_changed_inputs(self) -> bool:
        """Notes the calls whose inputs changed (the replay sees other numbers than the step
        did); returns whether any did."""
        changed = False
        for call in self.calls:
            after = call.versions_after
            if len(after) == len(call.versions) and after != call.versions:
                changed = True
                self.det["notes"].append(
                    f"{type(call.target).__name__} wrote into its own inputs during the step"
                )
            if versions_of(call.args, call.kwargs) != after:
                changed = True
                self.det["notes"].append(
                    f"inputs of {type(call.target).__name__} were changed in place after its call"
                )
        return changed

    # -- state -------------------------------------------------------------------------------
    def _save_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        saved = []
        seen: set[int] = set()
        for call in self.calls:
            for b in call.target.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    saved.append((b, b.clone()))
        return saved

    @staticmethod
    def _restore_buffers(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for b, old in saved:
            if b.shape != old.shape or not torch.equal(b, old):
                b.copy_(old)


def called_at(site: tuple[str, int, str] | None, f: Any, args: tuple, kwargs: dict) -> Any:
    """``f(*args, **kwargs)`` as called from ``site``, the user's line (path, line, function)
    that made the captured call: the replayed ops inside torch's own modules (``F.linear`` of
    an ``nn.Linear``) find it as their source, as a traced run would, not the line of the
    ``optimizer.step()`` the replay runs under. The call goes through a function compiled
    under the user's file name and line."""
    if site is None or not isinstance(site[1], int) or site[1] < 1:
        return f(*args, **kwargs)
    path, line, name = site
    code = compile("\n" * (line - 1) + "def _at(f, a, k): return f(*a, **k)\n", path, "exec")
    scope: dict[str, Any] = {}
    exec(code, scope)
    at = scope["_at"]
    renamed = {"co_name": name}
    if hasattr(at.__code__, "co_qualname"):  # Python 3.11+
        renamed["co_qualname"] = name
    at.__code__ = at.__code__.replace(**renamed)
    return at(f, args, kwargs)


def _holds_nonfinite(node: Any) -> bool:
    """Whether a node's saved tensors (``_saved_*``) hold NaN/Inf."""
    for attr in dir(node):
        if not attr.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attr)
        except Exception:  # a node's odd attribute: skipped
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if (
                isinstance(t, torch.Tensor)
                and (t.is_floating_point() or t.is_complex())
                and t.layout == torch.strided
                and not bool(torch.isfinite(t).all())
            ):
                return True
    return False


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], depth: int = 0) -> Any:
    """``obj`` with ``fn`` applied to each tensor in it (in tuples, lists and plain dicts, three
    levels deep; named tuples and other objects are kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth >= 3:
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(map_tensors(v, fn, depth + 1) for v in obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn, depth + 1) for v in obj]
    if type(obj) is dict:
        return {k: map_tensors(v, fn, depth + 1) for k, v in obj.items()}
    return obj


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t if t.grad_fn is None else t.detach().requires_grad_(t.requires_grad)


def _cut(obj: Any) -> Any:
    """``obj`` with every tensor that has a ``grad_fn`` (the output of an earlier call, or of
    loop code) replaced by a leaf with the same numbers: each replayed call's graph ends at its
    own inputs, never reaching into the step's own graph (maybe freed, never ours to run)."""
    return map_tensors(obj, _leaf)


def _pipeline_of(tracer: Any) -> Any:
    if tracer is None:
        return None
    pipeline = getattr(tracer, "pipeline", None)
    if pipeline is None:  # a nested tracer: its events flow through the outer one's pipeline
        outer = getattr(tracer, "_outer", None)
        pipeline = getattr(outer, "pipeline", None)
    return pipeline


def _fsdp_note(det: dict[str, Any]) -> str:
    """What a rank can say of a NaN/Inf under FSDP without replaying (a replay would run the
    all-gathers alone and hang the job): whether its own loss shows it came from here."""
    note = "FSDP: the replay would run collectives, so it is not done"
    if det.get("in_loss"):
        return (
            f"{note}; this rank's loss is non-finite, so its own forward made it: "
            "torchscope run --record names the op and line"
        )
    return (
        f"{note}; this rank's loss is finite: it most likely came from another rank through "
        "FSDP's gradient reduce-scatter, see that rank's report"
    )


def is_fsdp(module: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("torch.distributed.fsdp") for m in module.modules())


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc)
    text = text.splitlines()[0] if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
