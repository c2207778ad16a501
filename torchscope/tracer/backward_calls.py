"""Top-level ``backward()`` calls, seen with no mode on the stack.

A dormant job has no TorchFunctionMode, yet it must know when a backward pass runs: jobs that
update their weights by hand (no ``torch.optim``) end a training step there, and the NaN
watch keeps the step's graph for a replay. ``Tensor.backward`` calls
``torch.autograd.backward`` through the module attribute, so one wrapper there sees both
spellings. It is installed while at least one listener wants it and removed after the last
one leaves, restoring the original function.

A listener's ``backward_begins(kwargs)`` runs before the call on the calling thread, with the
roots as ``kwargs["tensors"]``; a listener that sets ``needs_arguments = True`` gets every
argument by name there and may return replacement keyword arguments (``retain_graph``).
``backward_ends(ok)`` runs after it,
also when it raised. Nested calls (a backward inside a backward hook) are not reported: only
the outermost call of a thread is a step's backward. Listener errors never reach the job,
except one whose class sets ``stops_the_job`` (the NaN watch's "stop"), raised from
``backward_ends`` after a backward that succeeded.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Protocol

import torch


class BackwardListener(Protocol):
    def backward_begins(self, kwargs: dict[str, Any]) -> dict[str, Any] | None: ...

    def backward_ends(self, ok: bool) -> None: ...


_listeners: list[BackwardListener] = []
# Whether some listener reads or replaces the arguments (``needs_arguments = True``): only
# then are they bound to their names, which costs a dict per call.
_by_name = False
_lock = threading.Lock()
_depth = threading.local()
_original: Any = None
_wrapper: Any = None


def _report(exc: BaseException) -> None:
    with contextlib.suppress(Exception):  # a closed stderr must not reach the job
        print(f"torchscope: internal error around backward(): {exc!r}", file=sys.stderr)


# torch.autograd.backward's parameters, in order: ``Tensor.backward`` passes them
# positionally, and a listener sees (and may replace) them by name only.
PARAMETERS = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")


def _make_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        listeners = _listeners if depth == 0 else ()
        if not listeners:
            seen: dict[str, Any] = kwargs
        elif _by_name:
            if args:
                bound = dict(zip(PARAMETERS, args, strict=False))  # one dict per call, not two
                if kwargs:
                    bound.update(kwargs)
                kwargs, args = bound, ()
            seen = kwargs
        else:  # only the roots: the call keeps its arguments as they came
            seen = {"tensors": args[0] if args else kwargs.get("tensors")}
        for listener in listeners:
            try:
                changed = listener.backward_begins(seen)
            except Exception as exc:
                _report(exc)
                changed = None
            if changed is not None and _by_name:
                kwargs = seen = changed
        _depth.n = depth + 1
        ok = False
        try:
            result = original(*args, **kwargs)
            ok = True
            return result
        finally:
            _depth.n = depth
            stop = None
            for listener in listeners:
                try:
                    listener.backward_ends(ok)
                except Exception as exc:
                    if getattr(exc, "stops_the_job", False) and ok:
                        stop = exc  # the NaN watch's "stop": meant for the job
                    else:
                        _report(exc)
            if stop is not None:
                raise stop

    return backward


class Listening:
    """Handle of one listener; ``remove()`` is idempotent."""

    def __init__(self, listener: BackwardListener) -> None:
        self.listener = listener

    def remove(self) -> None:
        global _original, _wrapper, _listeners, _by_name
        with _lock:
            if self.listener not in _listeners:
                return
            # Copy on write: the wrapper may be iterating the old list on another thread.
            _listeners = [x for x in _listeners if x is not self.listener]
            _by_name = any(getattr(x, "needs_arguments", False) for x in _listeners)
            if not _listeners and _original is not None:
                if torch.autograd.backward is _wrapper:
                    torch.autograd.backward = _original
                from torchscope.tracer.armed.calls import BACKWARD_CALLS

                BACKWARD_CALLS.pop(_wrapper, None)  # each listen() makes a new one
                _original = _wrapper = None


def listen(listener: BackwardListener) -> Listening:
    """Report the top-level backward calls of every thread to ``listener``."""
    global _original, _wrapper, _listeners, _by_name
    with _lock:
        if _original is None:
            _original = torch.autograd.backward
            _wrapper = _make_wrapper(_original)
            torch.autograd.backward = _wrapper
            # The traced mode recognises backward calls by function identity; with the
            # wrapper in place, torch's own override dispatch names the wrapper.
            from torchscope.tracer.armed.calls import BACKWARD_CALLS

            BACKWARD_CALLS.setdefault(_wrapper, "torch.autograd.backward")
        _listeners = [*_listeners, listener]
        _by_name = any(getattr(x, "needs_arguments", False) for x in _listeners)
    return Listening(listener)


def installed() -> bool:
    return _original is not None
