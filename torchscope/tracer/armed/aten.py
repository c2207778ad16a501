"""The aten level: every aten call under the forward ops and backward nodes (a
TorchDispatchMode), off until asked (``trace(aten=True)``, ``run --aten[=MODULE_REGEX]``).

Each call is an ``aten`` event linked to its parent: in forward, the op event that issued it
(``op_seq``; the op's calls are delivered just before the op, which is numbered once it has
run); in backward, the node it ran for (``node_id``, from ``torch._C._current_autograd_node()``),
or, once that node's post-hook has fired, the autograd engine summing the gradients that reach
a tensor by two paths (``accumulate``). Module path and source line are the parent's.

A call made by something other than its parent's own work says so in ``label``: ``autocast``
(a cast autocast inserted before the op), ``recompute`` (activation checkpointing re-running
the forward inside a backward node), or the torch.func transform the op ran under (``vmap``,
``grad``, ``jvp``: the calls are the batched kernels the transform chose).

The tracer's own reductions run under the pipeline's lock: a call made while this thread holds
it is torchscope's, never recorded.

A few backward formulas compute other values while any dispatch mode is on the stack
(tracer/armed/aten_formulas.py): their nodes run with the mode off and are recorded whole, one
event labelled ``whole node`` (``WholeNodes``), so that the job computes what it computes
untraced.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from torchscope.protocol.breakpoints import AFTER, BEFORE
from torchscope.protocol.events import ATEN, Event, all_finite
from torchscope.tracer.armed.alerts import made_here
from torchscope.tracer.armed.aten_formulas import BACKWARD_NODES, WHOLE_NODE
from torchscope.tracer.armed.backward import NODE_ID, NODE_MOD, NODE_SRC, node_name
from torchscope.tracer.armed.calls import has_inf_scalar, iter_tensors, result_tensors
from torchscope.tracer.armed.collectives import KERNEL_PREFIXES, WAIT_KERNEL, kernel_group_size
from torchscope.tracer.armed.modules import ModuleTracker
from torchscope.tracer.armed.recorder_base import Recorder
from torchscope.tracer.armed.recorder_shared import THIS_THREAD
from torchscope.tracer.armed.source import is_internal

_current_node = torch._C._current_autograd_node
_is_compiling = torch.compiler.is_compiling
_functorch_level = torch._C._functorch.maybe_current_level
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
# Read above the dispatcher: inside autocast's kernels (and so in a dispatch mode) it is off.
_is_autocasting = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)
AUTOCAST, RECOMPUTE = "autocast", "recompute"
# Python ops that are casts themselves: their _to_copy is theirs, not autocast's.
_CAST_OPS = frozenset(
    "Tensor.to Tensor.type Tensor.type_as Tensor.float Tensor.double Tensor.half "
    "Tensor.bfloat16 Tensor.int Tensor.long Tensor.bool torch._to_copy".split()
)
_names: dict[Any, str] = {}


def _readable(t: torch.Tensor) -> bool:
    """A plain floating tensor (subclasses, DTensor among them, are not read here)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and (
        t.is_floating_point() or t.is_complex()
    )


def aten_name(func: Any) -> str:
    """``aten.mm.default``: the overload as PyTorch prints it."""
    name = _names.get(func)
    if name is None:
        name = _names[func] = str(func)
    return name


_transform_labels: dict[tuple, str] = {}


def transform_now() -> str | None:
    """The torch.func transforms the caller runs under, outermost first (``vmap``,
    ``vmap(grad)`` for per-sample gradients), or None. Only visible above the dispatcher:
    a dispatch mode runs below the transforms."""
    if _functorch_level() is None:
        return None
    keys = tuple(i.key() for i in torch._C._functorch.get_interpreter_stack())
    label = _transform_labels.get(keys)
    if label is None:
        names = [str(k).rsplit(".", 1)[-1].lower() for k in keys]
        label = _transform_labels[keys] = "(".join(names) + ")" * (len(names) - 1)
    return label


_PythonBackward = torch.autograd.function.BackwardCFunction  # a custom Function's node
_FUNCTION_FILE = torch.autograd.function.__file__  # calls a custom Function's backward
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__  # calls the function it re-runs


def _line_inside(caller_file: str) -> str | None:
    """``path:line`` of the user's line that made the current aten call, looking no further
    out than the frames ``caller_file`` (torch's) calls: a custom Function's ``backward``, or
    the function activation checkpointing re-runs. None when none of them is the user's (the
    walk would otherwise reach the line that called ``backward()``). A frame walk: only for
    those calls."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == caller_file:
            return None
        if not is_internal(code):
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _recomputing(node_label: str) -> bool:
    """Whether activation checkpointing is re-running a forward inside this backward node."""
    if node_label == "CheckpointFunctionBackward":  # use_reentrant=True: its whole backward
        return True
    hooks = _top_saved_tensors_hooks(False)  # use_reentrant=False: its recomputation hooks
    return hooks is not None and hooks[1].__qualname__.startswith("_recomputation_hook.")


def aten_scope(aten: bool | str | None) -> re.Pattern | None:
    """What ``aten=`` asks for: None (off), or the module paths whose calls are recorded
    (every one for ``True`` or ``""``). A bad pattern is a ValueError in one line."""
    if aten is None or aten is False:
        return None
    if aten is True:
        return re.compile("")
    try:
        return re.compile(aten)
    except re.error as exc:
        raise ValueError(f"--aten: {aten!r} is not a regular expression: {exc}") from None


class AtenRecorder(Recorder):
    def __init__(self, *args: Any, scope: re.Pattern, done_nodes: set[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scope = scope
        self._everywhere = not scope.pattern
        self.done_nodes = done_nodes  # nodes whose post-hook ran, in this backward call
        self.children: list[Event] | None = None  # calls of the forward op in progress
        self.transform: str | None = None  # the torch.func transform that op runs under
        # ... and those the backward call in progress runs under (grad's own backward)
        self.backward_transform: str | None = None
        self.autocasting = False  # ... and whether autocast was on for it
        self.op_name: str | None = None

    def run_backward(self, run: Callable[..., Any], *call: Any) -> Any:
        """``run(*call)``, a backward call, its nodes' calls labelled with the torch.func
        transforms it runs under (per-sample gradients: ``vmap(grad)``)."""
        outer = self.backward_transform
        self.backward_transform = transform_now()
        try:
            return run(*call)
        finally:
            self.backward_transform = outer

    def begin_op(self, name: str) -> None:
        self.children = []
        self.op_name = name
        self.transform = transform_now()
        self.autocasting = _is_autocasting()

    def end_op(self, op: Event | None) -> None:
        """The op has run and has its number: its calls go out first, linked to it (None:
        the call made no op event, its aten calls go out unlinked)."""
        children, self.children = self.children, None
        if not children:
            return
        if op is not None:
            seq, source, function = op["seq"], op.get("source"), op.get("function")
            for ev in children:
                ev["op_seq"] = seq
                ev["source"] = source
                ev["function"] = function
            if self.autocasting and op["name"] not in _CAST_OPS:  # not the user's own cast
                for ev in children:
                    if ev["name"] == "aten._to_copy.default":
                        ev["label"] = AUTOCAST
        if self.transform is not None:
            for ev in children:
                ev["label"] = self.transform
        add = self.pipeline.add
        with self.pipeline.lock:
            for ev in children:
                add(ev)

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any, t0: int) -> Event | None:
        """The call's event, sent on (or kept for its op); None when it is not recorded."""
        t1 = time.perf_counter_ns()
        outs = result_tensors(out)
        if not outs:
            return None  # sizes, scalars read out (item): nothing a summary could show
        node = _current_node()
        # Node.metadata is a property (a dict); torch's stub declares it a method.
        md: Any
        md = nid = node_label = None
        recompute = False
        if node is None:
            module = self.modules.current()
        else:
            md = node.metadata
            nid = md.get(NODE_ID)
            module = md.get(NODE_MOD, "")
            node_label = node_name(node)
            if nid not in self.done_nodes and _recomputing(node_label):
                # Checkpointing re-runs the forward here: its module calls name the op's own
                # module (the node that needed the values is only where it happens).
                recompute = True
                module = self.modules.innermost() or module
        if not self._everywhere and not self.scope.search(module):
            return None
        name = aten_name(func)
        event = Event(
            kind=ATEN,
            seq=None,
            step=self.state.step_index,
            name=name,
            module=module,
            source=None,
            op_seq=None,
            node_id=None,
            node=None,
            inputs=None,
            outputs=None,
            duration_us=(t1 - t0) / 1000,
            thread=THIS_THREAD.name,
        )
        if md is not None:
            event["source"] = md.get(NODE_SRC)
            event["node_id"] = nid
            event["node"] = node_label
            if nid in self.done_nodes:
                event["accumulate"] = True  # the engine summing a tensor's incoming gradients
            elif recompute:
                event["label"] = RECOMPUTE
                event["source"] = _line_inside(_CHECKPOINT_FILE) or event["source"]
            else:
                if isinstance(node, _PythonBackward):
                    # A custom Function's own backward: the line in it that made this call.
                    event["source"] = _line_inside(_FUNCTION_FILE) or event["source"]
                if self.backward_transform is not None:
                    event["label"] = self.backward_transform
        ins = iter_tensors(args, kwargs)
        summaries = self.summaries
        collective = name.startswith(KERNEL_PREFIXES)
        if collective:
            event["group_size"] = kernel_group_size(args, kwargs)
        with self.recording:
            if name.startswith(("aten.empty", "aten.new_empty")):
                event["outputs"] = [summaries.uninitialized(t) for t in outs]
            elif collective and name != WAIT_KERNEL:
                # Not there yet: read at its wait_tensor (functional) or by its op (c10d).
                event["outputs"] = [summaries.written(t, True) for t in outs]
            else:
                summary_of = summaries.summary_of
                event["outputs"] = [summary_of(t, ins) for t in outs]
            # What went in, as far as this step's calls made it (the parent's own inputs
            # carry the rest: data, weights): metadata otherwise, never old bytes read again.
            memo_get = summaries.memo.get
            event["inputs"] = [memo_get(t) or summaries.overwritten(t) for t in ins]
            event["seq"] = self.next_seq()
            if md is None and self.children is not None:
                self.children.append(event)
            else:
                self.pipeline.add(event)
        return event

    def record_whole(self, t0: int, grad_outputs: tuple, grad_inputs: tuple) -> None:
        """The node running now, recorded whole (its aten calls ran with the mode off): what
        it received in, what it sends on out. From its post-hook."""
        t1 = time.perf_counter_ns()
        node = _current_node()
        if node is None:
            return
        md: Any = node.metadata  # a property (a dict); torch's stub declares it a method
        module = md.get(NODE_MOD, "")
        if not self._everywhere and not self.scope.search(module):
            return
        event = Event(
            kind=ATEN,
            seq=None,
            step=self.state.step_index,
            name=node_name(node),
            module=module,
            source=md.get(NODE_SRC),
            op_seq=None,
            node_id=md.get(NODE_ID),
            node=node_name(node),
            label=WHOLE_NODE,
            inputs=None,
            outputs=None,
            duration_us=(t1 - t0) / 1000,
            thread=THIS_THREAD.name,
        )
        summaries = self.summaries
        with self.recording:
            summary_of = summaries.summary_of
            event["inputs"] = [None if g is None else summary_of(g) for g in grad_outputs]
            event["outputs"] = [None if g is None else summary_of(g) for g in grad_inputs]
            event["seq"] = self.next_seq()
            self.pipeline.add(event)

    def stub(self, func: Any) -> Event:
        """A call's identity before it runs (where an aten: breakpoint stops before it)."""
        node = _current_node()
        # torch's stub declares Node.metadata a method; it is a property (a dict).
        module = self.modules.current() if node is None else node.metadata.get(NODE_MOD, "")  # type: ignore[attr-defined]
        stub = Event(
            kind=ATEN,
            seq=None,
            step=self.state.step_index,
            name=aten_name(func),
            module=module,
            node=None if node is None else node_name(node),
        )
        if node is None:
            stub["op"] = self.op_name
        return stub

    def made_here(self, event: dict[str, Any], ins: list, inf_arg: bool) -> str | None:
        """ "nan"/"inf" when this call made the value its outputs hold. Inputs this step's
        calls did not summarise (data, weights) are read now: paid only for a call with a bad
        output, while a nan breakpoint is set."""
        outs = event["outputs"]
        if all_finite(outs):
            return None
        known = []
        with self.recording:
            for s, t in zip(event["inputs"], ins, strict=True):
                if s and s.get("stats"):
                    known.append(s)
                elif _readable(t) and not bool(torch.isfinite(t).all()):
                    return None
        return made_here(known, outs, inf_arg=inf_arg)


class AtenMode(TorchDispatchMode):
    """Hands every aten call to the recorder after it ran; never alters args or results."""

    def __init__(self, recorder: AtenRecorder) -> None:
        # The first call through a Python dispatch mode imports torch._dynamo (a second on
        # this CPU): done here, where no op's duration counts it.
        import torch._dynamo  # noqa: F401

        super().__init__()
        self.enabled = True
        self._record = recorder.record
        # The tracer's own reductions. _is_owned: CPython's RLock has it; typeshed leaves the
        # private method out.
        self._ours = recorder.pipeline.lock._is_owned  # type: ignore[attr-defined]
        self._report_error = recorder.report_error
        self._recorder = recorder
        self._stepper = recorder.stepper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if not self.enabled or self._ours():
            return func(*args, **kwargs)
        stepper = self._stepper
        if stepper is not None and stepper.active:
            return self._stepped(func, args, kwargs)
        t0 = time.perf_counter_ns()
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out, t0)
        except Exception as exc:
            self._report_error("aten call", exc)
        return out

    def _stepped(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A call while someone may pause: ``aten:`` breakpoints stop before and after it,
        ``nan``/``inf`` ones after the call that made the value."""
        recorder = self._recorder
        pauser = recorder.pauser
        assert pauser is not None
        ins = iter_tensors(args, kwargs)
        try:
            pauser.pause_point(BEFORE, recorder.stub(func), {"inputs": ins})
        except Exception as exc:
            self._report_error("pausing before an aten call", exc)
        t0 = time.perf_counter_ns()
        out = func(*args, **kwargs)
        try:
            event = self._record(func, args, kwargs, out, t0)
            if event is not None:
                if event["node"] is None:
                    event["op"] = recorder.op_name  # its op has no event yet: named for the UI
                verdicts: list[str | None] = []

                def origin(ev: dict) -> str | None:
                    verdicts.append(recorder.made_here(ev, ins, has_inf_scalar(args, kwargs)))
                    return verdicts[-1]

                outs = result_tensors(out)
                paused = pauser.pause_point(AFTER, event, {"inputs": ins, "outputs": outs}, origin)
                if paused and any(verdicts) and not event.get("accumulate"):
                    pauser.stepper.origin_stopped_inside()
        except Exception as exc:
            self._report_error("aten call", exc)
        return out


class AtenScope:
    """The aten level scoped to some modules, at a cost in proportion to the scope: the mode
    is on the stack only inside the outermost call of a matching module (forward) and while
    the kernels of a node made there run (backward); every other aten call never reaches
    Python. (The engine's sums after such a node run with the mode off.) It listens to the
    module tracker's hooks, which name the module first."""

    def __init__(self, mode: AtenMode, scope: re.Pattern, modules: ModuleTracker) -> None:
        self._local = threading.local()
        self._mode = mode
        self._scope = scope
        self._modules = modules

    def covers(self, module: str) -> bool:
        return self._scope.search(module) is not None

    def forget(self) -> None:
        """Tracing stopped: no module call is open any more."""
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    # A module call: 0 outside the scope, 1 inside (an outer call pushed), 2 pushed here.
    def module_enter(self) -> None:
        if _is_compiling() or (
            self._modules.owner is not None and threading.get_ident() != self._modules.owner
        ):
            return
        stack = self._stack()
        if stack and stack[-1]:
            stack.append(1)
        elif self._modules.in_compiled_call():
            stack.append(0)  # compiled code runs with no mode of ours (tracer/armed/compiled)
        elif self.covers(self._modules.current()):
            self._mode.__enter__()
            stack.append(2)
        else:
            stack.append(0)

    def module_exit(self) -> None:
        if _is_compiling():
            return
        stack = self._stack()
        if stack and stack.pop() == 2:
            self._pop()

    def node_enter(self, grad_outputs: Any) -> None:
        self._mode.__enter__()
        self._local.open_nodes = getattr(self._local, "open_nodes", 0) + 1

    def node_exit(self, grad_inputs: Any, grad_outputs: Any) -> None:
        if self._pop():
            self._local.open_nodes -= 1

    def unwind(self) -> None:
        """After a backward call: a node that raised never ran its post-hook."""
        while getattr(self._local, "open_nodes", 0) > 0 and self._pop():
            self._local.open_nodes -= 1

    def _pop(self) -> bool:
        n = torch._C._len_torch_dispatch_stack()
        if n > 0 and torch._C._get_dispatch_stack_at(n - 1) is self._mode:
            self._mode.__exit__(None, None, None)
            return True
        return False


class WholeNodes:
    """The backward nodes whose formula PyTorch picks by whether a dispatch mode is on
    (aten_formulas.BACKWARD_NODES): their pre-hook takes the aten mode off this thread's stack
    when it is the only mode there, their post-hook puts it back and records the node whole.
    The hooks run on the thread that runs the node (CUDA's device threads included), and the
    engine restores the thread's modes after each node, so a node that raises leaves none
    off. A scoped aten level never pushes its mode for them (``scoped_enter``)."""

    nodes = BACKWARD_NODES

    def __init__(self, mode: AtenMode, recorder: AtenRecorder) -> None:
        self._mode = mode
        self._recorder = recorder
        self._local = threading.local()

    def _open(self) -> list:
        opened = getattr(self._local, "opened", None)
        if opened is None:
            opened = self._local.opened = []
        return opened

    def node_enter(self, grad_outputs: Any) -> None:
        off = (
            torch._C._len_torch_dispatch_stack() == 1
            and torch._C._get_dispatch_stack_at(0) is self._mode
        )
        if off:
            torch._C._pop_torch_dispatch_stack(None)
        # (node, mode taken off, recorded whole, start); another mode on: the job takes the
        # subclass branch too, and the node's calls are recorded as usual.
        self._open().append((_current_node_id(), off, off, time.perf_counter_ns()))

    def scoped_enter(self, grad_outputs: Any) -> None:
        """A node in a scoped level's modules: its mode is not pushed; recorded whole."""
        self._open().append((_current_node_id(), False, True, time.perf_counter_ns()))

    def node_exit(self, grad_inputs: Any, grad_outputs: Any) -> None:
        opened = self._open()
        nid = _current_node_id()
        while opened:  # a node that raised never reached here: its entry is dropped
            oid, popped, whole, t0 = opened.pop()
            if oid == nid:
                break
        else:
            return
        if popped:
            torch._C._push_on_torch_dispatch_stack(self._mode)
        if whole:
            try:
                self._recorder.record_whole(t0, grad_outputs, grad_inputs)
            except Exception as exc:
                self._recorder.report_error("aten call", exc)


def _current_node_id() -> int | None:
    node = _current_node()
    return None if node is None else node.metadata.get(NODE_ID)  # type: ignore[attr-defined]
