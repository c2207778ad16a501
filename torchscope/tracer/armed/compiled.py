"""Calls into compiled code: a ``torch.compile``'d module runs with torchscope's modes off the
stacks, and is recorded as one op.

Dynamo guards every compiled frame on the torch-function mode stack
(``___check_torch_function_mode_stack``): a mode pushed there when a job is armed fails the
guard, and the model recompiles (seconds to minutes, spending Dynamo's recompile limit, after
which it silently runs eager), and again when the mode goes. So the modes step off their
stacks for the length of the call and back on after it, and the compiled frames see the
stacks they were compiled with.

The call is one ``op`` event, ``torch.compile:<class of the compiled module>`` marked
``compiled``: its inputs and outputs summarised, the module's path, and the autograd nodes it
made (``CompiledFunctionBackward`` under AOTAutograd backends) tagged as its nodes, so the
backward shows both sides of the compiled graph's node. What runs inside is not traced.

A module compiled in place (``model.compile()``) is called straight into its compiled code, with
no hook of ours before it: the module tracker wraps its compiled call for the length of the
session (``tracer/in_place.py``), so that it steps the modes off and is one op like the other.
Those in the user's reach are found at arming, those compiled later as they are compiled, and
those inside a module that runs eagerly when it is indexed.

A ``torch.compile``'d *function* has no module hooks to step the modes off around it. Dynamo
calls the enter hooks of the function's compile context at every call, before the guards run:
when a job is armed, the compiled functions in the user's modules get one that steps the
modes off for the call (``arm_compiled_functions``). It stays on the context after the session
ends (a check of one module global per call) and holds no reference to the session. Such a
call is not an op event (the hook sees neither the arguments nor the result): its outputs enter
the trace as values made outside the traced ops.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import torch
from torch.utils._python_dispatch import _pop_mode, _push_mode

from torchscope.protocol.events import Event
from torchscope.tracer.armed.calls import nested_tensors
from torchscope.tracer.armed.eager_check import EagerCheck
from torchscope.tracer.armed.forward import ForwardRecorder
from torchscope.tracer.armed.source import user_modules
from torchscope.tracer.eager import eager_module
from torchscope.tracer.ranks import say

COMPILED_PREFIX = "torch.compile:"


def compiled_call_name(module: torch.nn.Module) -> str:
    return COMPILED_PREFIX + type(eager_module(module)).__name__


class CompiledCalls:
    """What the module tracker does around a call of a compiled module (see module doc)."""

    def __init__(
        self,
        forward: ForwardRecorder,
        ours: Callable[[Any], bool],
        report_error: Callable[[str, BaseException], None],
        emit: Callable[[Event], None],
    ) -> None:
        self._forward = forward
        self._ours = ours  # whether a mode on a stack is torchscope's
        self._report_error = report_error
        self._emit = emit  # numbers an event and sends it after those in flight
        self._local = threading.local()
        # Set per step: each compiled call also runs eagerly and is compared (eager_check.py).
        self.eager_check = False
        # The module tracker's global hooks out of sight while a compiled function runs
        # (Dynamo guards on them too); returns what puts them back.
        self.hide_module_hooks: Callable[[], Callable[[], None]] = lambda: _nothing

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def active(self) -> bool:
        """Whether this thread is inside a compiled call (its eager parts run untraced)."""
        return bool(getattr(self._local, "stack", None))

    def enter(self, module: torch.nn.Module, args: tuple) -> None:
        stack = self._stack()
        if stack:  # a compiled module inside a compiled call: already off the stacks
            stack.append(None)
            return
        pending = check = None
        # A model takes and returns any nest of tensors (a Hugging Face model returns a
        # ModelOutput, a dict): the op's inputs and outputs are every tensor in them.
        inputs: tuple[torch.Tensor, ...] = ()
        try:
            inputs = tuple(nested_tensors(args))
            pending = self._forward.before_op(compiled_call_name(module), inputs, {})
            if self.eager_check:
                check = EagerCheck(self._emit_numbered, self._untraced, self._tagged)
        except Exception as exc:
            self._report_error("compiled call (before)", exc)
        stack.append((pending, inputs, self._step_off(), check))

    def exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        if not stack:
            return
        entry = stack.pop()
        if entry is None:
            return
        pending, inputs, stepped_off, check = entry
        _push_back(*stepped_off)
        if pending is None or output is None:  # it raised: no outputs to record
            return
        try:
            outputs = nested_tensors(output)
            done = self._forward.after_op(pending, inputs, {}, outputs, extra={"compiled": True})
        except Exception as exc:
            self._report_error("compiled call (after)", exc)
            return
        if check is not None and done is not None:
            try:
                check.run(module, args, output, done[0])
            except Exception as exc:
                self._report_error("eager check of a compiled call", exc)

    def enter_function(self) -> Callable[[], None]:
        """A compiled function's call begins: the modes step off (and the module hooks hide)
        until the returned cleanup runs at its end."""
        stack = self._stack()
        if stack:
            return _nothing  # inside a compiled call: already off the stacks
        function_modes, dispatch_modes = self._step_off()
        if not function_modes and not dispatch_modes:
            return _nothing  # not the traced thread, or an untraced step
        show_hooks = self.hide_module_hooks()
        stack.append(None)  # what runs eagerly in between (graph breaks) is not traced

        def leave() -> None:
            stack.pop()
            show_hooks()
            _push_back(function_modes, dispatch_modes)

        return leave

    @contextlib.contextmanager
    def _untraced(self) -> Iterator[None]:
        """torchscope's own tensor work between the job's calls: off the stacks, no grad."""
        function_modes, dispatch_modes = self._step_off()
        try:
            with torch.no_grad():
                yield
        finally:
            _push_back(function_modes, dispatch_modes)

    @contextlib.contextmanager
    def _tagged(self, op_seq: int) -> Iterator[None]:
        """The eager run's op events say so: ``eager_check`` holds the compiled call's seq."""
        self._forward.tag = {"eager_check": op_seq}
        try:
            yield
        finally:
            self._forward.tag = None

    def _emit_numbered(self, event: Event) -> None:
        """An eager check's report: to the trace, and its one line to stderr."""
        event["seq"] = self._forward.next_seq()
        self._emit(event)
        say(f"step {event['step']}: {event['message']}")

    def _step_off(self) -> tuple[list, list]:
        """Pop torchscope's modes from the top of both stacks (a mode the job pushed above
        them stays, and so do ours under it: the guard then fails as it would anyway)."""
        ours = self._ours
        function_modes = []
        while (n := torch._C._len_torch_function_stack()) and ours(
            torch._C._get_function_stack_at(n - 1)
        ):
            function_modes.append(torch._C._pop_torch_function_stack())
        dispatch_modes = []
        while (n := torch._C._len_torch_dispatch_stack()) and ours(
            torch._C._get_dispatch_stack_at(n - 1)
        ):
            dispatch_modes.append(_pop_mode())
        return function_modes, dispatch_modes


def _push_back(function_modes: list, dispatch_modes: list) -> None:
    """Undo ``_step_off``: the modes back on their stacks, bottom first."""
    for mode in reversed(dispatch_modes):
        _push_mode(mode)
    for mode in reversed(function_modes):
        torch._C._push_on_torch_function_stack(mode)


def _nothing() -> None:
    return None


_armed: weakref.ref[CompiledCalls] | None = None  # the armed session's, for the hook below


def _around_compiled_function() -> Callable[[], None]:
    """The enter hook on compiled functions' contexts: a cleanup Dynamo calls at the end."""
    calls = _armed() if _armed is not None else None
    if calls is None:
        return _nothing
    try:
        return calls.enter_function()
    except Exception:  # never the job's problem; the call then runs with the modes on
        return _nothing


def arm_compiled_functions(calls: CompiledCalls | None) -> int:
    """Route compiled functions' calls to ``calls`` (None: to nothing, when a session ends),
    hooking those defined in the user's modules that are not hooked yet. Returns how many
    compiled functions were found."""
    global _armed
    _armed = weakref.ref(calls) if calls is not None else None
    if calls is None:
        return 0
    found = 0
    for context in _compiled_function_contexts():
        found += 1
        hooks = context.enter_exit_hooks
        if not any(h is _around_compiled_function for h in hooks):
            hooks.append(_around_compiled_function)
    return found


def _compiled_function_contexts() -> Iterator[Any]:
    """The Dynamo compile contexts of the ``torch.compile``'d functions (and methods of classes)
    defined at the top level of the user's modules."""
    for module in user_modules():
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                candidates = list(vars(value).values())
            else:
                candidates = [value]
            for fn in candidates:
                context = _compile_context(fn)
                if context is not None:
                    yield context


def _compile_context(fn: object) -> Any:
    if not isinstance(fn, FunctionType) or "_torchdynamo_orig_callable" not in fn.__dict__:
        return None
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(getattr(value, "enter_exit_hooks", None), list):
            return value
    return None
