"""Interrupting an expression the job runs: its budget, a cancel, its asker going away.

An expression (a UI's ``p`` or ``e``, an MCP ``evaluate``, a ``--log``/``--edit`` at each
hit) runs on the job's training thread. One that does not end (``sum(1 for _ in iter(int,
1))``, a typo'd loop, a slow call) must not hold the job: :func:`guarded` runs it while a
watchdog thread (one per process, started on first use) waits for its deadline or for
:meth:`Run.cancel`, and then raises :class:`ExpressionInterrupted` in the training thread
(``PyThreadState_SetAsyncExc``). The interpreter delivers it at the thread's next bytecode
check: a pure-Python loop stops within milliseconds; a long call into C or C++ (a big
kernel, ``time.sleep``) runs on until it returns, and the answer says so.

The exception never lands outside the evaluation: the evaluation leaves with a plain
attribute store (``run.leaving``: no exception can be delivered on it), after which the
watchdog fires no more; one it fired an instant before is taken back under the watchdog's
lock (``PyThreadState_SetAsyncExc(tid, NULL)``) or, if it landed meanwhile, caught there.
A caught exception (an expression's own ``except BaseException``) is raised again every
:data:`REFIRE_S` seconds until the evaluation leaves (code that catches it at every turn of a
loop, as it would catch Ctrl-C, cannot be stopped this way).

No ``sys.settrace``/``sys.setprofile``: nothing is paid while an expression runs, and the
job's own tracer or profiler is left alone.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "EVAL_BUDGET_S",
    "ExpressionInterrupted",
    "Run",
    "check_budget",
    "guarded",
]

# How long an expression may run before it is interrupted, by default (a job's own setting:
# serve(eval_budget=...), torchscope run --eval-budget; one expression's: its budget).
EVAL_BUDGET_S = 10.0
# An expression that caught the interruption is interrupted again this often.
REFIRE_S = 0.2
# Delivered this long after the watchdog fired: the thread was in a call into C/C++.
LATE_S = 0.25

BUDGET = "budget"
CANCELLED = "cancelled"
LET_GO = "let go"


def check_budget(value: Any, name: str = "eval_budget") -> float:
    """A budget in seconds (a positive, finite number), or ValueError/TypeError in one line."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


class ExpressionInterrupted(BaseException):
    """Raised in the training thread, inside an expression, by the watchdog. A
    ``BaseException``: the code an expression calls does not swallow it with ``except
    Exception``."""


class Run:
    """One expression's evaluation: its budget and who may stop it (any thread)."""

    def __init__(self, budget: float | None = EVAL_BUDGET_S) -> None:
        self.budget = budget
        self.tid = 0
        self.started = 0.0
        self.deadline = math.inf
        self.why: str | None = None  # BUDGET, CANCELLED, LET_GO (with who): set once
        self.fired: float | None = None  # when the watchdog first raised in the thread
        self.last_fired = 0.0
        self.landed: float | None = None  # when the evaluation saw it
        self.live = False  # the evaluation runs: the watchdog may raise in it
        self.leaving = False  # the evaluation is over: the watchdog fires no more
        self.done = False

    def cancel(self, why: str = CANCELLED) -> None:
        """Stop the evaluation (now, or as soon as it starts)."""
        _WATCHDOG.cancel(self, why)

    @property
    def interrupted(self) -> bool:
        return self.landed is not None

    def text(self) -> str:
        """``interrupted after N s (why)``, and whether a call into C++ held it up."""
        took = (self.landed or time.perf_counter()) - (self.started or time.perf_counter())
        why = self.why or CANCELLED
        if why == BUDGET:
            why = f"over its budget of {self.budget:g} s"
        text = f"interrupted after {took:.1f} s ({why})"
        if self.fired is not None and self.landed is not None and self.landed - self.fired > LATE_S:
            text += "; a call into C++ ran on until it returned"
        return text


def guarded(fn: Callable[[], Any], run: Run) -> Any:
    """``fn()`` on this thread, interrupted by ``run``'s budget or cancel: raises
    :class:`ExpressionInterrupted` then (``run.text()`` says why), else returns or raises
    what ``fn`` does. Nothing is left to land after it returns."""
    failed: BaseException | None = None
    value = None
    _WATCHDOG.arm(run)  # registered; nothing is raised before ``live``
    try:
        run.live = True  # a plain store: from the next instruction on, it may be raised
        value = fn()
    except BaseException as exc:
        failed = exc
    run.leaving = True  # a plain store: nothing lands on it; the watchdog stops firing
    try:
        while True:
            try:
                _WATCHDOG.disarm(run)
                break
            except ExpressionInterrupted:  # fired as it ended, landed here: the outcome stands
                pass
    except ExpressionInterrupted:
        # The one the watchdog may have fired as the evaluation left, at the loop's edge:
        # nothing more can come.
        _WATCHDOG.disarm(run)
    if isinstance(failed, ExpressionInterrupted):
        if run.landed is None:
            run.landed = time.perf_counter()
        raise failed
    if failed is not None:
        raise failed
    return value


def _set_async(tid: int, exc: type[BaseException] | None) -> int:
    return int(
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(tid), ctypes.py_object(exc) if exc is not None else None
        )
    )


class _Watchdog:
    """The thread that raises in a training thread whose expression ran out of time or was
    cancelled. All state under ``_lock``; the thread waits on ``_wake``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._runs: list[Run] = []
        self._thread: threading.Thread | None = None

    def arm(self, run: Run) -> None:
        with self._lock:
            run.tid = threading.get_ident()
            run.started = time.perf_counter()
            if run.budget is not None:
                run.deadline = time.monotonic() + run.budget
            self._runs.append(run)
            thread = self._thread
            if thread is None or not thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(
                    target=self._loop, name="torchscope-expression-watchdog", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def cancel(self, run: Run, why: str) -> None:
        with self._lock:
            if run.why is None and not run.leaving:
                run.why = why
        self._wake.set()

    def disarm(self, run: Run) -> None:
        with self._lock:
            if run in self._runs:
                self._runs.remove(run)
            if run.fired is not None and not run.done:
                _set_async(run.tid, None)  # fired an instant ago and not yet delivered
            run.done = True

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._turn())
            self._wake.clear()

    def _turn(self) -> float | None:
        """Fire what is due; how long until something else may be (None: nothing runs)."""
        wait: float | None = None
        with self._lock:
            now = time.monotonic()
            for run in self._runs:
                if run.leaving or not run.live:
                    if run.why is None and not run.leaving:
                        wait = 0.01 if wait is None else min(wait, 0.01)  # about to start
                    continue
                if run.why is None and now >= run.deadline:
                    run.why = BUDGET
                if run.why is None:
                    if run.deadline == math.inf:
                        continue  # no budget: only a cancel stops it
                    due = run.deadline - now
                elif now - run.last_fired >= REFIRE_S or run.fired is None:
                    if run.fired is None:
                        run.fired = time.perf_counter()
                    run.last_fired = now
                    _set_async(run.tid, ExpressionInterrupted)
                    due = REFIRE_S
                else:
                    due = REFIRE_S - (now - run.last_fired)
                wait = due if wait is None else min(wait, due)
        return None if wait is None else max(wait, 0.001)


_WATCHDOG = _Watchdog()
