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


is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_DisableTorchDispatch = torch._C._DisableTorchDispatch


class GradOffLocked:
    """``with`` it: the pipeline's lock held and grad mode off, as every summary needs (the
    reductions must record no graph, nor take sequence numbers from an op's window).

    One per recorder, reused: the grad state it restores is kept on a stack that only the
    lock's holder touches, so it nests (a sink adding an event) and serves the autograd
    threads too. Cheaper than ``torch.no_grad()`` plus the lock, on a path that runs for
    every op and node. ``no_dispatch`` (the aten level is on): the reductions also bypass
    Python dispatch modes, ours and the job's, which would otherwise see every one of them.
    """

    __slots__ = ("_guards", "_lock", "_no_dispatch", "_was")

    def __init__(self, lock: Any, no_dispatch: bool = False) -> None:  # the pipeline's RLock
        self._lock = lock
        self._was: list[bool] = []
        self._no_dispatch = no_dispatch
        self._guards: list[Any] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        was = is_grad_enabled()
        if was:
            _set_grad_enabled(False)
        self._was.append(was)
        if self._no_dispatch:
            guard = _DisableTorchDispatch()
            guard.__enter__()
            self._guards.append(guard)

    def __exit__(self, *exc: object) -> None:
        if self._no_dispatch:
            self._guards.pop().__exit__(None, None, None)
        if self._was.pop():
            _set_grad_enabled(True)
        self._lock.release()


class _ThisThread(threading.local):
    """``THIS_THREAD.name``: the calling thread's name, read as a plain attribute (no call per
    event). Set once per thread, at its first read (a new thread may reuse a dead one's ident:
    the name is the thread's own, not its ident's)."""

    def __init__(self) -> None:
        self.name = threading.current_thread().name


THIS_THREAD = _ThisThread()
