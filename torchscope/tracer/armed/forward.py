"""The forward level: a TorchFunctionMode that sees one event per torch API call, and the
recorder that turns each call into an op event (inputs, outputs, the nodes it created).

The mode only routes: noise and untraced calls go straight through, backward calls go to the
backward recorder, every other call is recorded before and after it runs. The recorder holds
what an op event needs and nothing of the session but :class:`ArmedState`.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, NamedTuple, Protocol

import torch
from torch._C._autograd import _get_sequence_nr
from torch.overrides import TorchFunctionMode

from torchscope.protocol.breakpoints import AFTER, BEFORE
from torchscope.protocol.events import OP, Event, all_finite
from torchscope.tracer.armed.alerts import VIEW_OPS
from torchscope.tracer.armed.backward import (
    NODE_ID,
    NODE_MOD,
    NODE_OP,
    NODE_RUN,
    NODE_SRC,
    node_name,
)
from torchscope.tracer.armed.calls import (
    BACKWARD_CALLS,
    apply_name,
    has_inf_scalar,
    iter_tensors,
    op_name,
    op_names,
    overwrites_first_input,
    result_tensors,
    writes_inputs,
)
from torchscope.tracer.armed.collectives import COLLECTIVES, group_size, is_async, written_tensors
from torchscope.tracer.armed.recorder_base import Recorder
from torchscope.tracer.armed.recorder_shared import THIS_THREAD
from torchscope.tracer.armed.source import FSDP_DIR, called_from, user_frame, user_site

# Looked up once: __torch_function__ runs for every torch call of the job (dynamo recognises
# the function object itself, however it is reached).
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing
_functorch_level = torch._C._functorch.maybe_current_level


class PendingOp(NamedTuple):
    """An op between ``before_op`` and ``after_op``: what it was called with."""

    name: str
    tensors: list[torch.Tensor]  # its tensor arguments
    inputs: list[dict]  # their summaries
    seq_lo: int  # the autograd sequence number before it ran (its nodes' window starts here)
    t0: int  # perf_counter_ns when it started (restarted after a pause)


_pending = tuple.__new__  # PendingOp without a Python-level __new__ frame: once per op


class AtenCalls(Protocol):
    """The aten level as an op sees it (tracer/armed/aten.py): the calls made while the op
    runs are its own, delivered just before it."""

    def begin_op(self, name: str) -> None: ...

    def end_op(self, op: Event | None) -> None: ...

    def run_backward(self, run: Any, *call: Any) -> Any: ...


class BackwardCalls(Protocol):
    """Where the mode sends ``backward()``/``autograd.grad()`` (the backward recorder)."""

    def run_backward(self, call: str, func: Any, args: tuple, kwargs: dict) -> Any: ...


UNINITIALIZED_OPS = frozenset(
    {
        "torch.empty",
        "torch.empty_like",
        "torch.empty_strided",
        "torch.empty_permuted",
        "Tensor.new_empty",
        "Tensor.new_empty_strided",
        # FSDP2's all-gather buffer: this rank's shard copied into a torch.empty buffer
        # whose other shards only the collective after it fills.
        "fsdp.all_gather_copy_in",
    }
)


# In-place writes that make masks: an Inf they write is meant (attention's -inf).
_MASK_WRITES = frozenset({"Tensor.masked_fill_", "Tensor.fill_diagonal_"})


def writes_a_value(name: str) -> bool:
    """The user's code writes into a tensor it holds (``x[0] = inf``, ``x.fill_(inf)``,
    ``x += inf``): an Inf written so is a value like any other, and where it first appears
    is an origin (a batch or a weight corrupted by the loop's own code), unlike an Inf an
    op makes from an infinite argument on purpose (``masked_fill(mask, -inf)``)."""
    return (
        writes_inputs(name, {})
        and name not in _MASK_WRITES
        and not name.startswith("torch.nn.init.")
    )


class ForwardRecorder(Recorder):
    """One op event per traced call, with the autograd nodes the call created tagged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aten: AtenCalls | None = None  # the aten level, when it is on
        self.tag: dict | None = None  # fields every op event gets for now (an eager check's)

    def before_op(self, name: str, args: tuple, kwargs: dict) -> PendingOp:
        state = self.state
        if state.gated and name in COLLECTIVES:
            state.meet_ranks(name)
        tensors = iter_tensors(args, kwargs)
        inputs = list(map(self.summaries.memo.get, tensors))  # map: no comprehension frame
        if kwargs and kwargs.get("out") is not None:
            self._destinations(kwargs["out"], tensors, inputs)
        if None in inputs:  # inputs no traced op made: data, weights
            # An op that writes into its input destroys the value the deferral would read.
            deferrable = not writes_inputs(name, kwargs)
            # uniform_(w), copy_(w, src): w's old values (maybe uninitialised) do not matter.
            overwritten = None
            if overwrites_first_input(name):  # nn.init passes its tensor as tensor=...
                overwritten = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            summaries = self.summaries
            # FSDP viewing its own all-gather buffers before the copy-out fills them:
            # uninitialised memory (and its views too), never stats or an alert.
            unfilled = name in VIEW_OPS and called_from(FSDP_DIR)
            with self.recording:
                for i, t in enumerate(tensors):
                    if inputs[i] is None:
                        if unfilled:
                            inputs[i] = summaries.uninitialized(t)
                            continue
                        inputs[i] = (
                            summaries.overwritten(t)
                            if t is overwritten
                            else summaries.external(t, deferrable)
                        )
        if self.aten is not None:
            self.aten.begin_op(name)
        return _pending(
            PendingOp, (name, tensors, inputs, _get_sequence_nr(), time.perf_counter_ns())
        )

    def _destinations(self, out: Any, tensors: list[torch.Tensor], inputs: list) -> None:
        """``out=dst`` or ``out=[...]`` (FSDP's ``split_with_sizes_copy``): written, not read.
        Their old bytes (often garbage, or a view of it the memo holds) get no stats and
        raise no alert, whatever summary they had."""
        dests = out if isinstance(out, (list, tuple)) else (out,)
        for i, t in enumerate(tensors):
            if any(t is d for d in dests):
                inputs[i] = self.summaries.overwritten(t)

    def after_op(
        self,
        pending: PendingOp,
        args: tuple,
        kwargs: dict,
        result: Any,
        extra: dict | None = None,
    ) -> tuple[Event, list[torch.Tensor]] | None:
        """Record the op; returns its event and output tensors (for the pauser). ``extra``:
        fields the caller adds (a compiled call's ``compiled``)."""
        name, in_tensors, inputs, seq_lo, t0 = pending
        t1 = time.perf_counter_ns()
        if name in COLLECTIVES:
            return self._after_collective(pending, t1, args, kwargs, result)
        outs = result_tensors(result)
        if not outs:
            # In-place calls like __setitem__ return None; their output is the first argument.
            if result is None and args and isinstance(args[0], torch.Tensor):
                outs = [args[0]]
            else:
                if self.aten is not None:
                    self.aten.end_op(None)
                return None
        seq_hi = _get_sequence_nr()
        seq = self.next_seq()
        site = user_site(1)
        source, function = site if site is not None else (None, None)
        nodes: list[dict] = []
        module = self.modules.current()
        gf0 = _grad_fn(outs[0])
        if seq_hi != seq_lo:
            for i, out in enumerate(outs):
                gf = _grad_fn(out) if i else gf0
                if gf is not None:
                    self._tag_nodes(gf, seq_lo, seq_hi, seq, source, module, nodes)
        event = Event(
            kind=OP,
            seq=seq,
            step=self.state.step_index,
            name=name,
            module=module,
            source=source,
            function=function,
            inputs=inputs,
            outputs=None,
            grad_fn=node_name(gf0) if gf0 is not None else None,
            nodes=nodes,
            duration_us=(t1 - t0) / 1000,
            thread=THIS_THREAD.name,
        )
        if has_inf_scalar(args, kwargs) and not writes_a_value(name):
            event["inf_arg"] = True  # an Inf it makes is on purpose (masked_fill(m, -inf))
        extra = extra or self.tag
        if extra:
            event.update(extra)
        with self.recording:
            # A view's output shares its input's stats when the input is unchanged (the
            # memo checks its version); an in-place op's output is summarised afresh.
            summaries = self.summaries
            if name in UNINITIALIZED_OPS:
                # Whatever bytes the allocator hands out: stats of them mean nothing, and
                # a NaN among them is not an alert.
                event["outputs"] = [summaries.uninitialized(t) for t in outs]
            else:
                summary_of = summaries.summary_of
                outputs = event["outputs"] = []
                for t in outs:  # a loop: a comprehension costs a frame per op
                    outputs.append(summary_of(t, in_tensors))
                if not all_finite(outputs):
                    summaries.judge_external(in_tensors, inputs)
            if self.aten is not None:
                self.aten.end_op(event)  # the op's aten calls go just before it
            self.pipeline.add(event)
        return event, outs

    def _after_collective(
        self, pending: PendingOp, t1: int, args: tuple, kwargs: dict, result: Any
    ) -> tuple[Event, list[torch.Tensor]]:
        """A ``torch.distributed`` call: what it wrote, summarised after it (see collectives)."""
        name = pending.name
        outs = written_tensors(name, args, kwargs)
        pending_data = is_async(name, args, kwargs, result)
        event = self.op_stub(name, pending.inputs, user_frame(1))
        event.update(
            seq=self.next_seq(),
            grad_fn=None,
            nodes=[],
            duration_us=(t1 - pending.t0) / 1000,
            thread=THIS_THREAD.name,
            group_size=group_size(name, args, kwargs),
        )
        if pending_data:
            event["async_op"] = True
        with self.recording:
            event["outputs"] = [self.summaries.written(t, pending_data) for t in outs]
            if self.aten is not None:
                self.aten.end_op(event)
            self.pipeline.add(event)
        return event, outs

    def _tag_nodes(
        self, root: Any, lo: int, hi: int, seq: int, source: str | None, module: str, out: list
    ) -> None:
        """Tag the nodes this call created: their sequence numbers fall in [lo, hi)."""
        todo = [root]
        run_id = self.run_id
        # The window holds hi - lo sequence numbers, one per node the call made: once that
        # many are tagged, none is left below (most calls make one node, the root, and its
        # next_functions, which build a wrapper per edge, are never read).
        left = hi - lo
        while todo:
            node = todo.pop()
            if not lo <= node._sequence_nr() < hi:
                continue
            md = node.metadata
            if NODE_OP in md:
                continue
            md[NODE_OP] = seq
            md[NODE_RUN] = run_id
            md[NODE_SRC] = source
            md[NODE_MOD] = module
            nid = md.get(NODE_ID)
            if nid is None:
                nid = md[NODE_ID] = self.new_node_id()
            out.append({"id": nid, "name": node_name(node)})
            left -= 1
            if left <= 0:
                break
            todo += [n for n, _ in node.next_functions if n is not None]

    # -- pauses (only while a stepper is active) ---------------------------------------------
    def pause_before_op(
        self, pending: PendingOp, args: tuple = (), kwargs: dict | None = None
    ) -> PendingOp:
        """Maybe pause before the op runs; returns ``pending`` with its clock restarted
        after a pause (an op's duration never counts the time it sat paused)."""
        try:
            stub = self.op_stub(pending.name, pending.inputs, user_frame(1))
        except Exception as exc:
            self.report_error("pausing before an op", exc)
            return pending
        tensors = {"inputs": list(pending.tensors)}
        call = {"args": args, "kwargs": kwargs or {}}  # for expressions at the pause
        pauser = self.pauser
        assert pauser is not None  # asked only while a stepper is active
        if pauser.pause_point(BEFORE, stub, tensors, call=call):
            return pending._replace(t0=time.perf_counter_ns())
        return pending

    def pause_after_op(
        self,
        pending: PendingOp,
        event: Event,
        outs: list[torch.Tensor],
        call: dict | None = None,
    ) -> None:
        """Maybe pause after the op ran (or act: log, edit its output in place); ``call``:
        its args, kwargs and result, for expressions."""
        tensors = {"inputs": list(pending.tensors), "outputs": outs}
        pauser = self.pauser
        assert pauser is not None  # asked only while a stepper is active
        pauser.pause_point(AFTER, event, tensors, call=call)


class ForwardMode(TorchFunctionMode):
    """Hands every non-noise torch call to the recorder; never alters args or results.
    While one is on a stack, custom autograd Functions' ``apply`` calls come here too."""

    def __init__(self, recorder: ForwardRecorder, backward: BackwardCalls) -> None:
        super().__init__()
        self.enabled = True
        # Bound once: __torch_function__ runs for every torch call of the job.
        self._before_op = recorder.before_op
        self._after_op = recorder.after_op
        self._report_error = recorder.report_error
        self._run_backward = backward.run_backward
        self._recorder = recorder
        pauser = recorder.pauser
        self._stepper = pauser.stepper if pauser is not None else None
        _custom_applies.add_mode(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the job comes through here, most of them noise (``p.grad``):
        # that path is one dict lookup.
        if _is_compiling():
            # Dynamo is tracing this call into a torch.compile graph: be transparent, so the
            # graph holds the ops alone (compiled regions are not traced op by op).
            return func(*args, **kwargs) if kwargs else func(*args)
        try:
            name = op_names[func]
        except (KeyError, TypeError):
            name = op_name(func, args)
        if name is None or not self.enabled or _is_tracing():
            # Under torch.jit.trace our reductions would be recorded (and warned about) too.
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        if func in BACKWARD_CALLS:
            aten = self._recorder.aten
            if aten is not None and _functorch_level() is not None:
                # grad's own backward (torch.func): its kernels are batched by the same
                # transforms as the forward's.
                return aten.run_backward(
                    self._run_backward, BACKWARD_CALLS[func], func, args, kwargs
                )
            return self._run_backward(BACKWARD_CALLS[func], func, args, kwargs)
        try:
            pending = self._before_op(name, args, kwargs)
        except Exception as exc:
            self._report_error("forward op (before)", exc)
            pending = None
        stepper = self._stepper
        if pending is not None and stepper is not None and stepper.active:
            pending = self._recorder.pause_before_op(pending, args, kwargs)
        result = func(*args, **kwargs)
        if pending is not None:
            try:
                done = self._after_op(pending, args, kwargs, result)
            except Exception as exc:
                self._report_error("forward op (after)", exc)
                done = None
            if done is not None and stepper is not None and stepper.active:
                call = {"args": args, "kwargs": kwargs, "result": result}
                self._recorder.pause_after_op(pending, *done, call)
        return result


def _grad_fn(t: torch.Tensor) -> Any:
    """``t.grad_fn``, or None where torch refuses to say: a view made under no_grad whose
    memory was then written in place (``weight[pad].fill_(0)`` in ``nn.Embedding``)."""
    if not t.requires_grad:
        return None
    try:
        return t.grad_fn
    except RuntimeError:
        return None


class _CustomApplies:
    """Routes ``apply`` of the job's custom autograd Functions to the forward mode.

    A TorchFunctionMode never sees ``ScaledTanh.apply(x)`` in eager (only the ops inside its
    forward), so the Function's backward node would belong to no op. While a forward mode
    exists, ``torch.autograd.Function.apply`` is a wrapper that hands the call to this
    thread's mode (if it is on the stack and tracing) as the call ``ScaledTanh.apply``: an op
    with its module and line, whose node (``ScaledTanhBackward``) is tagged as any op's. The
    ops inside the forward are traced as before, under it. Torch's own Functions, and calls
    under torch.func (which reach the mode as a named operator, see ``op_name``), go straight
    through. The original is back once the last mode is gone (a job that was never traced
    pays nothing); not at each pop of the mode (every optimizer step), since assigning a class
    attribute invalidates the attribute caches of every Function class. Dynamo traces
    ``apply`` itself and never sees the wrapper.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes = 0  # forward modes alive
        self._original: Any = None  # Function.__dict__["apply"] while ours is installed

    def add_mode(self, mode: ForwardMode) -> None:
        with self._lock:
            self._modes += 1
            if self._modes == 1:
                self._original = _Function.__dict__["apply"]
                # setattr: a classmethod where the stub types a method (a patch, not a bug).
                setattr(_Function, "apply", classmethod(_traced_apply))  # noqa: B010
        weakref.finalize(mode, self._mode_gone)

    def _mode_gone(self) -> None:
        with self._lock:
            self._modes -= 1
            if self._modes == 0:
                # Only ours goes: something the job installed over it meanwhile stays.
                if getattr(_Function.__dict__["apply"], "__func__", None) is _traced_apply:
                    setattr(_Function, "apply", self._original)  # noqa: B010
                self._original = None


_custom_applies = _CustomApplies()
_Function = torch.autograd.Function
_plain_apply = _Function.__dict__["apply"].__func__
_functorch_active = torch._C._are_functorch_transforms_active
_INTERNAL_MODULES = ("torch.", "torchscope.")


def _traced_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.Function.apply`` while a forward mode is entered (see above)."""
    mode = None
    if not cls.__module__.startswith(_INTERNAL_MODULES) and not _functorch_active():
        mode = _tracing_mode()
    if mode is None:
        return _plain_apply(cls, *args, **kwargs)
    apply = _plain_apply.__get__(cls)  # equal for every call of one class: a dict key
    if apply not in op_names:
        op_names[apply] = apply_name(cls)
    return mode.__torch_function__(apply, (), args, kwargs)


def _tracing_mode() -> ForwardMode | None:
    """This thread's forward mode, when it is on the stack and tracing: not while it handles
    a call (it is off the stack then), nor in a compiled call (stepped off)."""
    if _is_compiling():
        return None
    n = torch._C._len_torch_function_stack()
    while n:
        n -= 1
        mode = torch._C._get_function_stack_at(n)
        if type(mode) is ForwardMode:
            return mode if mode.enabled else None
    return None
