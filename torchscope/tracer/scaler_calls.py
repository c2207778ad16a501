"""Loss scaler calls (``torch.amp.GradScaler``), seen with no mode on the stack.

Mixed precision with a scaler changes what a training step is: ``scaler.scale(loss)`` hands
``backward()`` the loss times a large scale, and ``scaler.step(optimizer)`` calls
``optimizer.step()`` only when the scaled gradients are finite -- an fp16 overflow skips the
update, which is normal, and the scaler shrinks its scale. Whoever counts steps or checks
gradients must know both: the clock counts a skipped ``scaler.step()`` as a step (the loop's
iteration ended without an update), the NaN watch checks the *unscaled* loss, the history
records it.

The scaler's ``scale`` and ``step`` are wrapped on the class (and on subclasses that define
their own) while at least one listener wants them, and restored after the last one leaves,
as ``backward_calls`` does for ``torch.autograd.backward``. A job without a scaler pays
nothing; one with a scaler pays a Python call per ``scale()`` and ``step()``.

A listener may define any of:

- ``loss_scaled(scaler, outputs, scaled)``: ``scaled`` is what ``scaler.scale(outputs)``
  returned (the tensor the job passes to ``backward()``);
- ``scaler_step_begins(scaler, optimizer)`` / ``scaler_step_ends(scaler, optimizer, ok)``:
  around ``scaler.step(optimizer)`` (``ok``: it returned).

They run on the calling thread; their errors never reach the job. Nested calls (a subclass
calling ``super().step()``) are reported once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from typing import Any

_listeners: list[Any] = []
_lock = threading.Lock()
_depth = threading.local()
_last = threading.local()  # .scaled: a weak reference to this thread's last scaled loss
_originals: dict[tuple[type, str], Any] = {}  # (class, method name) -> the class's own function


def _report(exc: BaseException) -> None:
    with contextlib.suppress(Exception):  # a closed stderr must not reach the job
        print(f"torchscope: internal error around the loss scaler: {exc!r}", file=sys.stderr)


def _notify(method: str, *args: Any) -> None:
    for listener in _listeners:
        fn = getattr(listener, method, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception as exc:
            _report(exc)


def _outermost() -> bool:
    return getattr(_depth, "n", 0) == 0


@contextlib.contextmanager
def _nested() -> Any:
    depth = getattr(_depth, "n", 0)
    _depth.n = depth + 1
    try:
        yield
    finally:
        _depth.n = depth


def _wrap_scale(original: Any) -> Any:
    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        if not _outermost() or not _listeners:
            return original(self, outputs)
        with _nested():
            scaled = original(self, outputs)
        with contextlib.suppress(TypeError):  # a list of tensors: not one root to know
            _last.scaled = weakref.ref(scaled)
        _notify("loss_scaled", self, outputs, scaled)
        return scaled

    return scale


def _wrap_step(original: Any) -> Any:
    @functools.wraps(original)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not _outermost() or not _listeners:
            return original(self, optimizer, *args, **kwargs)
        _notify("scaler_step_begins", self, optimizer)
        ok = False
        try:
            with _nested():
                result = original(self, optimizer, *args, **kwargs)
            ok = True
            return result
        finally:
            _notify("scaler_step_ends", self, optimizer, ok)

    return step


_WRAPPERS = {"scale": _wrap_scale, "step": _wrap_step}


def _scaler_classes() -> list[type]:
    """GradScaler and its subclasses loaded so far (``torch.amp`` is imported by torch)."""
    from torch.amp.grad_scaler import GradScaler

    out: list[type] = []
    todo: list[type] = [GradScaler]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _install() -> None:
    for cls in _scaler_classes():
        for name, wrap in _WRAPPERS.items():
            own = cls.__dict__.get(name)
            if own is None or (cls, name) in _originals:
                continue
            _originals[(cls, name)] = own
            setattr(cls, name, wrap(own))


def _uninstall() -> None:
    for (cls, name), own in _originals.items():
        setattr(cls, name, own)
    _originals.clear()


class Listening:
    """Handle of one listener; ``remove()`` is idempotent."""

    def __init__(self, listener: Any) -> None:
        self.listener = listener

    def remove(self) -> None:
        global _listeners
        with _lock:
            if self.listener not in _listeners:
                return
            # Copy on write: a wrapper may be iterating the old list on another thread.
            _listeners = [x for x in _listeners if x is not self.listener]
            if not _listeners:
                _uninstall()


def listen(listener: Any) -> Listening:
    """Report every loss scaler's ``scale`` and ``step`` calls to ``listener``."""
    global _listeners
    with _lock:
        _install()  # again each time: a subclass defined since gets its wrappers too
        _listeners = [*_listeners, listener]
    return Listening(listener)


def installed() -> bool:
    return bool(_originals)


def is_scaled(roots: list[Any]) -> bool:
    """Whether ``roots`` is the tensor this thread's last ``scaler.scale()`` returned (the
    backward of a scaled loss: an overflow of its gradients is the scaler's to handle)."""
    ref = getattr(_last, "scaled", None)
    return ref is not None and len(roots) == 1 and ref() is roots[0]


def scale_of(scaler: Any) -> Any:
    """The scaler's current scale as a tensor (no host sync), or None when it has none yet
    or is disabled."""
    if not getattr(scaler, "_enabled", True):
        return None
    return getattr(scaler, "_scale", None)
