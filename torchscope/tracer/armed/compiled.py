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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _pop_mode, _push_mode

from torchscope.protocol.events import Event
from torchscope.tracer.armed.eager_check import EagerCheck
from torchscope.tracer.armed.forward import ForwardRecorder
from torchscope.tracer.ranks import say

COMPILED_PREFIX = "torch.compile:"


def is_compiled_module(module: torch.nn.Module) -> bool:
    """A module ``torch.compile(module)`` returned (Dynamo's OptimizedModule), known by its
    class name so that tracing never imports Dynamo."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def compiled_call_name(module: torch.nn.Module) -> str:
    return COMPILED_PREFIX + type(getattr(module, "_orig_mod", module)).__name__


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
        try:
            pending = self._forward.before_op(compiled_call_name(module), args, {})
            if self.eager_check:
                check = EagerCheck(self._emit_numbered, self._untraced, self._tagged)
        except Exception as exc:
            self._report_error("compiled call (before)", exc)
        stack.append((pending, self._step_off(), check))

    def exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        if not stack:
            return
        entry = stack.pop()
        if entry is None:
            return
        pending, stepped_off, check = entry
        _push_back(*stepped_off)
        if pending is None or output is None:  # it raised: no outputs to record
            return
        try:
            done = self._forward.after_op(pending, args, {}, output, extra={"compiled": True})
        except Exception as exc:
            self._report_error("compiled call (after)", exc)
            return
        if check is not None and done is not None:
            try:
                check.run(module, args, output, done[0])
            except Exception as exc:
                self._report_error("eager check of a compiled call", exc)

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
