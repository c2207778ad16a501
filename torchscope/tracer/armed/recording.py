"""What every recorder (forward ops, backward nodes, and the levels to come) shares.

A recorder is built by the armed session (:mod:`torchscope.tracer.armed.session`) with the
pieces it writes through: the pipeline, the tensor summaries, the module tracker, the
numbering, the pauser. What it reads at every event and the session changes between events
(the step, whether the ranks meet before collectives) it reads through :class:`ArmedState`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

ErrorReport = Callable[[str, BaseException], None]


class ArmedState(Protocol):
    """The session as a recorder sees it."""

    step_index: int  # the step events are numbered with
    gated: bool  # meet the other ranks before collectives (tracer/ranks.py)

    def meet_ranks(self, what: str) -> None: ...


_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class GradOffLocked:
    """``with`` it: the pipeline's lock held and grad mode off, as every summary needs (the
    reductions must record no graph, nor take sequence numbers from an op's window).

    One per recorder, reused: the grad state it restores is kept on a stack that only the
    lock's holder touches, so it nests (a sink adding an event) and serves the autograd
    threads too. Cheaper than ``torch.no_grad()`` plus the lock, on a path that runs for
    every op and node.
    """

    __slots__ = ("_lock", "_was")

    def __init__(self, lock: Any) -> None:  # the pipeline's RLock
        self._lock = lock
        self._was: list[bool] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        was = _is_grad_enabled()
        if was:
            _set_grad_enabled(False)
        self._was.append(was)

    def __exit__(self, *exc: object) -> None:
        if self._was.pop():
            _set_grad_enabled(True)
        self._lock.release()


_thread_local = threading.local()


def thread_name() -> str:
    # Per-thread cache (not by ident: a new thread may reuse a dead one's ident).
    try:
        return _thread_local.name
    except AttributeError:
        _thread_local.name = threading.current_thread().name
        return _thread_local.name
