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

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _pop_mode, _push_mode

from torchscope.tracer.armed.forward import ForwardRecorder

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
    ) -> None:
        self._forward = forward
        self._ours = ours  # whether a mode on a stack is torchscope's
        self._report_error = report_error
        self._local = threading.local()

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
        pending = None
        try:
            pending = self._forward.before_op(compiled_call_name(module), args, {})
        except Exception as exc:
            self._report_error("compiled call (before)", exc)
        stack.append((pending, self._step_off()))

    def exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        if not stack:
            return
        entry = stack.pop()
        if entry is None:
            return
        pending, function_modes, dispatch_modes = entry[0], *entry[1]
        for mode in reversed(dispatch_modes):
            _push_mode(mode)
        for mode in reversed(function_modes):
            torch._C._push_on_torch_function_stack(mode)
        if pending is None or output is None:  # it raised: no outputs to record
            return
        try:
            self._forward.after_op(pending, args, {}, output, extra={"compiled": True})
        except Exception as exc:
            self._report_error("compiled call (after)", exc)

    def forget(self) -> None:
        self._local = threading.local()

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
