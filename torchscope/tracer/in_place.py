"""Modules compiled in place (``module.compile()``).

Such a module's call goes straight into its compiled code (``Module._wrapped_call_impl`` calls
its ``_compiled_call_impl``): no module hook runs before it eagerly, and a hook that runs
inside is compiled into the graph and guarded on. torchscope sees these calls through a
wrapper of the compiled call that tells its listeners (the module tracker of a traced step, the
NaN watch) when a call begins and ends, outside the compiled code; the last listener to leave
puts torch's own back. The wrapper holds its listeners and its module weakly.

``running_eagerly`` runs such modules' own Python code for a while (the watch's replay, the
eager check of a compiled call), as ``OptimizedModule._orig_mod`` does for
``torch.compile(module)``.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType
from typing import Any, Protocol

import torch
from torch import nn

from torchscope.tracer.armed.source import is_internal, user_modules
from torchscope.tracer.ranks import say

_is_compiling = torch.compiler.is_compiling


class CallListener(Protocol):
    def call_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> None: ...

    def call_ends(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """``output`` is None after a call that raised."""


def is_compiled_in_place(module: nn.Module) -> bool:
    return module.__dict__.get("_compiled_call_impl") is not None


class _ListenedCall:
    """What ``_compiled_call_impl`` holds while listened to: torch's compiled call, wrapped."""

    __slots__ = ("compiled", "listeners", "module")

    def __init__(self, compiled: Callable, module: nn.Module) -> None:
        self.compiled = compiled
        self.module = weakref.ref(module)
        self.listeners: list[weakref.ref[CallListener]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        if module is None or not self.listeners or _is_compiling():
            return self.compiled(*args, **kwargs)
        told = [lis for ref in self.listeners if (lis := ref()) is not None]
        for listener in told:
            listener.call_begins(module, args, kwargs)
        try:
            output = self.compiled(*args, **kwargs)
        except BaseException:
            for listener in reversed(told):
                listener.call_ends(module, args, kwargs, None)
            raise
        for listener in reversed(told):
            listener.call_ends(module, args, kwargs, output)
        return output


def listen(module: nn.Module, listener: CallListener) -> Callable[[], None]:
    """Tell ``listener`` of each call of ``module`` (compiled in place); returns what stops
    it. Listening twice is listening once."""
    found = module.__dict__["_compiled_call_impl"]
    call = found if isinstance(found, _ListenedCall) else _ListenedCall(found, module)
    module._compiled_call_impl = call
    if not any(ref() is listener for ref in call.listeners):
        call.listeners.append(weakref.ref(listener))
    module_ref = weakref.ref(module)

    def stop() -> None:
        call.listeners = [r for r in call.listeners if r() is not None and r() is not listener]
        held = module_ref()
        if (
            not call.listeners
            and held is not None
            and held.__dict__.get("_compiled_call_impl") is call
        ):
            held._compiled_call_impl = call.compiled

    return stop


@contextlib.contextmanager
def running_eagerly(module: nn.Module) -> Iterator[None]:
    """Calls of ``module`` and of the modules in it run their own code, not compiled code."""
    saved = [
        (m, m.__dict__["_compiled_call_impl"]) for m in module.modules() if is_compiled_in_place(m)
    ]
    for m, _ in saved:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, call in saved:
            m._compiled_call_impl = call


def modules_compiled_in_place() -> list[nn.Module]:
    """The modules in the user's reach that are or hold a module compiled in place: in the
    globals of the user's modules, and in the locals of the calling thread's frames outside
    torch and torchscope (a loop's ``model``, a training step's ``self``), and as attributes
    of the other objects there (a trainer's ``self.model``)."""
    values: list[Any] = []
    for module in user_modules():
        values.extend(vars(module).values())
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_internal(frame.f_code):
            values.extend(frame.f_locals.values())
        frame = frame.f_back
    # One level into the other objects there: a trainer's ``self.model``, a workload's model.
    for value in list(values):
        values.extend(_modules_held_by(value))
    found: list[nn.Module] = []
    seen: set[int] = set()
    for value in values:
        # type(), not isinstance(): some objects compute __class__ (and warn) when asked.
        if issubclass(type(value), nn.Module) and id(value) not in seen:
            seen.add(id(value))
            if any(is_compiled_in_place(m) for m in value.modules()):
                found.append(value)
    return found


def _modules_held_by(value: Any) -> list[nn.Module]:
    """The modules among the attributes of an instance of some other class."""
    if issubclass(type(value), (nn.Module, type, ModuleType)):
        return []
    try:
        held = object.__getattribute__(value, "__dict__")
    except AttributeError:  # a builtin, a class with __slots__
        return []
    if not isinstance(held, dict):
        return []
    return [v for v in list(held.values()) if issubclass(type(v), nn.Module)]


class CompileCalls:
    """``nn.Module.compile`` wrapped while installed: ``on_compiled(module)`` runs right after
    a module is compiled in place (its first call must already be seen)."""

    def __init__(self, on_compiled: Callable[[nn.Module], None]) -> None:
        self._on_compiled = weakref.WeakMethod(on_compiled)
        self._patch: tuple[Callable, Callable] | None = None

    def install(self) -> None:
        original = nn.Module.compile
        told = self._on_compiled

        def compile(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            on_compiled = told()
            if on_compiled is not None:
                try:
                    on_compiled(module)
                except Exception as exc:  # never the job's: its calls then go unseen
                    say(f"internal error seeing {type(module).__name__}.compile(): {exc!r}")

        compile.__doc__, compile.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
        nn.Module.compile = compile  # type: ignore[method-assign,assignment]
        self._patch = (original, compile)

    def remove(self) -> None:
        if self._patch is not None:
            original, ours = self._patch
            if nn.Module.__dict__.get("compile") is ours:
                nn.Module.compile = original  # type: ignore[method-assign]
            self._patch = None
