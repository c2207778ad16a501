"""The training loop's own code, for the NaN watch: the ops run between the step's top-level
module calls and its ``backward()`` (a loss function, ``torch.distributions``, normalisation
written in the loop), kept as the step runs and read only at a detection.

A replay re-runs module calls, never the loop's code: the loss line is user code that cannot
be called again. So the watch keeps what a replay would need to see there, as it happens:
:class:`LoopOps` is a ``TorchFunctionMode`` that sits at the bottom of the mode stack only
while the loop's code runs (from the end of a top-level module call to the next call or the
step's ``backward()``), and records for each op its name, the user's line (and the library
line that ran it, inside ``log_prob``), and references to its tensors. Nothing is read on the
device: at a detection :meth:`LoopOps.origin` walks back from the non-finite loss through the
ops that made it, reading their values (a few host reads, once), to the first op whose inputs
were finite and whose output was not. That op and line is the origin, with no rerun.

Costs (``benchmarks/watch.py``): one Python call per op of the loop's code (a handful a step);
module calls run with the stack as the job left it (a compiled model sees no mode and never
recompiles). Memory: references to the ops' outputs up to ``LOOP_BYTES`` (weak beyond it:
such a value is read only if the job still holds it), weak ones to their inputs, dropped at
the step's check.

The mode is put under any mode the job has on the stack (``with torch.device(...)`` in the
loop), so a job's own ``__exit__`` never pops it, and taken out from under them.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torchscope.tracer.armed.calls import (
    BACKWARD_CALLS,
    iter_tensors,
    op_name,
    result_tensors,
    writes_inputs,
)
from torchscope.tracer.armed.source import is_internal, site_text

# The loop's code is a handful of ops a step; a loop that runs more (a metric over a batch,
# op by op) is recorded up to here.
MAX_LOOP_OPS = 512
# Outputs held by strong reference, in all (weak references beyond it).
LOOP_BYTES = 64 << 20

_is_compiling = torch.compiler.is_compiling
_OVERRIDES = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "overrides.py")
# The directory that holds ``torch/``: a library line is said from there (torch/...py:87).
_SITE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep


class LoopOp:
    """One op of the loop's code: its name, lines, and its tensors (by reference)."""

    __slots__ = (
        "factory",
        "in_place",
        "infinite_scalar",
        "inputs",
        "library",
        "name",
        "outputs",
        "user",
    )

    def __init__(
        self,
        name: str,
        user: tuple[CodeType, int] | None,
        library: tuple[CodeType, int] | None,
        inputs: list[Any],
        outputs: list[Any],
        in_place: bool,
        infinite_scalar: bool,
    ) -> None:
        self.name = name
        self.user = user
        self.library = library
        self.inputs = inputs  # each a tensor, or a weak reference to one (over the byte cap)
        self.outputs = outputs
        self.in_place = in_place  # it wrote into its first input (add_, x[i] = v, out=)
        self.infinite_scalar = infinite_scalar  # given an infinite number: an Inf on purpose
        self.factory = not inputs  # made its output from no tensor (zeros, full, tensor)

    def live_inputs(self) -> list[torch.Tensor]:
        return [t for t in map(_held, self.inputs) if t is not None]

    def live_outputs(self) -> list[torch.Tensor]:
        return [t for t in map(_held, self.outputs) if t is not None]


def _held(h: Any) -> torch.Tensor | None:
    return h if isinstance(h, torch.Tensor) else h()


@dataclass
class LoopOrigin:
    """Where the loop's code first made (or first took) the non-finite value."""

    op: str
    what: str  # "nan" or "inf"
    source: str | None  # the user's line
    library: str | None  # the library's line that ran the op, when not the user's own
    entered: bool  # the op took it from outside the loop's code (a module, the batch)
    unsure: bool = False  # an input of the op is no longer held: it may have come in already


class LoopOps(TorchFunctionMode):
    """Records the loop's ops while ``recording``; see the module's doc. Every method runs on
    the training thread (the mode stack is per thread)."""

    def __init__(self, on_error: Callable[[str, BaseException], object]) -> None:
        super().__init__()
        self.recording = False
        self.ops: list[LoopOp] = []
        self.truncated = False
        self._roots: list[weakref.ref] = []  # the losses of the step's backward() calls
        self._held = 0  # bytes held by strong reference
        self._held_ids: set[int] = set()
        self._stacked = 0  # the thread whose stack holds the mode (0: none)
        self._inside = 0  # in our own __torch_function__ (the mode is off the stack there)
        self._on_error = on_error

    # -- where the mode is ---------------------------------------------------------------------
    def resume(self) -> None:
        """The loop's code runs from here: record it."""
        self.recording = True
        if not self._stacked and not self._inside:
            _put_under(self)
            self._stacked = threading.get_ident()

    def pause(self) -> None:
        """A module call or the backward begins: stop recording, leave the stack as the job
        had it. (Inside our own handler the stack is restored after it: the mode stays, not
        recording, until the next removal.)"""
        self.recording = False
        # The stack is the training thread's: from another thread (a watch removed from
        # elsewhere) the mode stays there, passing every call through, until that thread
        # comes by again.
        if self._stacked == threading.get_ident() and not self._inside:
            _take_out(self)
            self._stacked = 0

    def clear(self) -> None:
        """The step ended (or a new one begins): off the stack, nothing held."""
        self.pause()
        self.ops = []
        self._roots = []
        self._held = 0
        self._held_ids = set()
        self.truncated = False

    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors held by strong reference this step."""
        return self._held

    def note_roots(self, roots: list[torch.Tensor]) -> None:
        """The losses ``backward()`` starts from: where :meth:`origin` walks back from."""
        for r in roots:
            self._roots.append(weakref.ref(r))

    # -- recording -----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        # The mode is off the stack while this runs, and put back after: ``_inside`` tells
        # pause() and resume() (a backward() begins in here) to leave the stack alone.
        self._inside += 1
        try:
            if not self.recording or func in BACKWARD_CALLS or _is_compiling():
                return func(*args, **kwargs)
            result = func(*args, **kwargs)
        finally:
            self._inside -= 1
        try:
            self._record(func, args, kwargs, result)
        except Exception as exc:
            self.recording = False
            self._on_error("recording the loop's code", exc)
        return result

    def _record(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        name = op_name(func, args)
        if name is None:
            return
        if len(self.ops) >= MAX_LOOP_OPS:
            self.truncated = True
            self.recording = False
            return
        inputs = iter_tensors(args, kwargs)
        outs = result_tensors(result)
        in_place = bool(inputs) and writes_inputs(name, kwargs)
        if in_place:
            outs = [inputs[0], *outs]  # x.add_(y), x[i] = v: x is what it made
        user, library = _lines(name)
        self.ops.append(
            LoopOp(
                name,
                user,
                library,
                [self._hold(t) for t in inputs],
                [self._hold(t) for t in outs],
                in_place,
                _infinite_scalar(args, kwargs),
            )
        )

    def _hold(self, t: torch.Tensor) -> Any:
        """``t`` itself while the step's held bytes stay under ``LOOP_BYTES``, else a weak
        reference (read only if the job still holds it)."""
        if id(t) in self._held_ids:
            return t
        n = t.nelement() * t.element_size()
        if self._held + n > LOOP_BYTES:
            return weakref.ref(t)
        self._held += n
        self._held_ids.add(id(t))
        return t

    # -- at a detection ------------------------------------------------------------------------
    def origin(self, also: list[torch.Tensor] = ()) -> LoopOrigin | None:  # type: ignore[assignment]
        """Where the loop's code first made a non-finite value that reached the step's loss
        (or ``also``: the inputs of the module calls after it), or first took one in; None when
        none of them was made by recorded ops. The rule is the
        tracer's (``armed/alerts.py``): the first op, in the order they ran, among the loss's
        non-finite ancestors, whose tensor inputs were finite; an Inf made on purpose (an op
        given an infinite number, ``masked_fill(mask, -inf)``) counts as finite, down the line,
        until it turns into NaN. Reads values on the host: at a detection only."""
        with torch.no_grad(), torch._C.DisableTorchFunction():
            reading = _Reading(self.ops)
            starts = [r for r in (ref() for ref in self._roots) if r is not None] + list(also)
            return reading.earliest([t for t in starts if reading.bad(t) is not None])


class _Reading:
    """One detection's reading of the recorded ops: each value read once."""

    def __init__(self, ops: list[LoopOp]) -> None:
        self.ops = ops
        self._bad: dict[int, tuple[torch.Tensor, str | None]] = {}
        self._deliberate: dict[int, bool] = {}

    def bad(self, t: torch.Tensor) -> str | None:
        """``"nan"``, ``"inf"`` (no NaN), or None for a finite (or non-float) tensor."""
        known = self._bad.get(id(t))
        if known is not None and known[0] is t:
            return known[1]
        verdict = _nonfinite(t)
        self._bad[id(t)] = (t, verdict)
        return verdict

    def producer(self, t: torch.Tensor, before: int) -> int | None:
        """The last op before ``before`` whose output ``t`` is (identity, not value)."""
        for i in range(before - 1, -1, -1):
            if any(o is t for o in self.ops[i].live_outputs()):
                return i
        return None

    def earliest(self, starts: list[torch.Tensor]) -> LoopOrigin | None:
        candidates: list[tuple[int, bool, bool]] = []  # (op index, entered, unsure)
        visited: set[int] = set()
        todo: list[tuple[torch.Tensor, int, int | None]] = [
            (t, len(self.ops), None) for t in starts
        ]
        while todo:
            t, before, consumer = todo.pop()
            i = self.producer(t, before)
            if i is None:
                if consumer is not None:
                    candidates.append((consumer, True, False))  # from outside the loop's code
                continue
            if i in visited:
                continue
            visited.add(i)
            bad = self._bad_inputs(i)
            if not bad:
                candidates.append((i, False, any(_held(h) is None for h in self.ops[i].inputs)))
            todo.extend((x, i, i) for x in bad)
        if not candidates:
            return None
        i, entered, unsure = min(candidates)
        op = self.ops[i]
        what = "nan" if any(self.bad(t) == "nan" for t in op.live_outputs()) else "inf"
        if entered:
            what = "nan" if any(self.bad(t) == "nan" for t in self._bad_inputs(i)) else "inf"
        return _made(op, what, entered, unsure)

    def _bad_inputs(self, i: int) -> list[torch.Tensor]:
        """The non-finite inputs of op ``i`` that are not finite on purpose."""
        op = self.ops[i]
        out = []
        for k, h in enumerate(op.inputs):
            x = _held(h)
            if x is None or self.bad(x) is None:
                continue
            if op.in_place and k == 0:
                # What the op wrote into: its value before the op is gone. Made earlier when
                # an earlier op made it from tensors; else (zeros, then x[0] = nan) made here.
                j = self.producer(x, i)
                if j is None or self.ops[j].factory:
                    continue
            if self._on_purpose(x, i):
                continue
            out.append(x)
        return out

    def _on_purpose(self, t: torch.Tensor, before: int) -> bool:
        """An Inf made on purpose: by an op given an infinite number, or from such values
        alone; never a NaN."""
        j = self.producer(t, before)
        if j is None or self.bad(t) == "nan":
            return False
        known = self._deliberate.get(j)
        if known is None:
            op = self.ops[j]
            self._deliberate[j] = False  # (no cycles: inputs come before; a guard anyway)
            bad = [x for x in op.live_inputs() if self.bad(x) is not None]
            known = op.infinite_scalar or (bool(bad) and all(self._on_purpose(x, j) for x in bad))
            self._deliberate[j] = known
        return known


def _made(op: LoopOp, what: str, entered: bool, unsure: bool = False) -> LoopOrigin:
    user = site_text(op.user[0].co_filename, op.user[1]) if op.user else None
    library = None
    if op.library is not None:
        path, line = op.library[0].co_filename, op.library[1]
        library = f"{path.removeprefix(_SITE_ROOT)}:{line}"
    return LoopOrigin(op.name, what, user, library, entered, unsure)


def _nonfinite(t: torch.Tensor) -> str | None:
    if not (t.is_floating_point() or t.is_complex()) or t.layout != torch.strided:
        return None
    if bool(torch.isnan(t).any()):
        return "nan"
    if bool(torch.isinf(t).any()):
        return "inf"
    return None


def _infinite_scalar(args: tuple, kwargs: dict) -> bool:
    """A call given an infinite Python number (``masked_fill(mask, -inf)``, ``full(.., inf)``)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, float) and math.isinf(a):
            return True
    return False


def _lines(name: str) -> tuple[tuple[CodeType, int] | None, tuple[CodeType, int] | None]:
    """(user frame, library frame) of the op being recorded, as (code, line): the first frame
    outside torch and torchscope, and the innermost library frame below it that is not the op's
    own wrapper (``F.cross_entropy``'s ``handle_torch_function`` line says nothing)."""
    frame: FrameType | None = sys._getframe(3)  # _record, __torch_function__, then the caller
    short = name.rpartition(".")[2]
    library: tuple[CodeType, int] | None = None
    while frame is not None:
        code = frame.f_code
        if not is_internal(code):
            return (code, frame.f_lineno), library
        if (
            library is None
            and code.co_filename != _OVERRIDES
            and code.co_name != short
            and code.co_filename.startswith(_SITE_ROOT)
        ):
            library = (code, frame.f_lineno)
        frame = frame.f_back
    return None, library


# -- the mode stack ----------------------------------------------------------------------------
def _put_under(mode: TorchFunctionMode) -> None:
    """Push ``mode`` under every mode on the stack (their ``__exit__`` pops theirs, not it);
    never a second time."""
    depth = _depth()
    if any(torch._C._get_function_stack_at(i) is mode for i in range(depth)):
        return
    above = [torch._C._pop_torch_function_stack() for _ in range(depth)]
    torch._C._push_on_torch_function_stack(mode)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def _take_out(mode: TorchFunctionMode) -> None:
    """Remove ``mode`` from the stack, wherever it is, the others kept in order."""
    above = []
    while _depth():
        m = torch._C._pop_torch_function_stack()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def _depth() -> int:
    return torch._C._len_torch_function_stack()
