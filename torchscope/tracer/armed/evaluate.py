"""Ask and change at a pause: expressions over the paused event's tensors, edits, logpoints.

An expression is Python code the job runs, on its training thread, as pdb's ``p`` runs code:
only at a pause (a UI's ``evaluate`` / ``edit``, answered through :class:`Stepper.run_at_pause
<torchscope.tracer.stepper.Stepper>`) or at a hit of a breakpoint with an action (``--log``,
``--edit``), under ``no_grad`` and with torchscope's own modes off (nothing it computes is
traced). Its answer is plain data: a tensor's summary and a few of its values, or a bounded
repr; an exception is its one line. Nothing is pickled.

An edit replaces one tensor of the event with a value of the same shape, dtype and device:

* an op's output is overwritten in place (through ``.data``, so autograd's version counter
  is untouched and a backward that saved the output reads the new values) before any later
  op reads it;
* a backward node's ``grad_inputs[i]`` (after the node ran) or ``grad_outputs[i]`` (before)
  goes back to autograd as the node hook's return value (see ``BackwardRecorder.on_grad``).

Every edit is an ``edit`` event (where, the expression, the summaries before and after).
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from torchscope.protocol.breakpoints import AFTER, BEFORE, Breakpoint, BreakpointError
from torchscope.protocol.events import ATEN, EDIT, GRAD, LOG, Event
from torchscope.protocol.expressions import (
    MAX_EXPRESSION_CHARS,
    ExpressionError,
    answer_text,
    bounded_repr,
    check_expression,
    parse_target,
    split_edit,
    target_text,
)
from torchscope.tracer.armed.interrupt import ExpressionInterrupted, Run, check_budget, guarded
from torchscope.tracer.armed.summary import tensor_meta

if TYPE_CHECKING:
    from torchscope.tracer.stepper import PausePoint


class Pauser(Protocol):
    """What an evaluator needs of the pauser that made it (tracer/armed/pausing.py)."""

    @property
    def eval_budget(self) -> float: ...

    def disable(self, bp: Breakpoint, line: str) -> None: ...

    def module_named(self, path: Any) -> Any: ...

    def edited(self, point: PausePoint, tensor: Any, summary: dict, in_place: bool) -> None: ...

    def edit_event(
        self,
        point: PausePoint,
        target: str,
        expr: str,
        before: dict,
        after: dict,
        by_ui: bool,
        bp: Breakpoint | None,
    ) -> Event: ...

    def log_event(self, event: dict[str, Any], bp: Breakpoint, text: str) -> None: ...

    def say_log(self, bp: Breakpoint, line: str, took: float) -> None: ...

    def say_once(self, bp: Breakpoint, line: str) -> None: ...


# An expression that takes longer than this at a logpoint is said once (it runs at every hit).
SLOW_LOG_S = 0.5


class Evaluator:
    """What one pause point (or one action's hit) can run: the event, its live tensors
    (``point.tensors``) and, for an op, the call (``args``, ``kwargs``, ``result``)."""

    def __init__(self, pauser: Pauser, point: PausePoint, call: dict[str, Any] | None) -> None:
        self._pauser = pauser
        self.point = point
        self._call = call or {}
        self.edited = False  # a gradient list of point.tensors now holds a replacement

    # -- the names an expression sees ---------------------------------------------------------
    def focus(self, group: str | None = None, index: int | None = None) -> tuple[str, int]:
        """The tensor ``x`` names: the one asked for, else the event's main one (an op's
        output, a node's first gradient sent on, what came in before it ran)."""
        tensors = self.point.tensors
        if group is not None:
            items = tensors.get(group)
            if items is None:
                have = ", ".join(tensors) or "nothing"
                raise BreakpointError(f"no {group} at this point (have {have})")
            index = index or 0
            if not 0 <= index < len(items):
                raise BreakpointError(f"{group} has {len(items)} tensors, not index {index}")
            return group, index
        for name in ("outputs", "grad_inputs", "grad_outputs", "inputs"):
            for i, t in enumerate(tensors.get(name) or ()):
                if t is not None:
                    return name, i
        return next(iter(tensors), "inputs"), 0

    def namespace(self, focus: tuple[str, int] | None) -> dict[str, Any]:
        tensors = self.point.tensors
        ev = self.point.event
        ns: dict[str, Any] = {"torch": torch, "F": F, "math": math}
        if ev.get("kind") == GRAD:
            for group in ("grad_inputs", "grad_outputs"):
                if group in tensors:
                    ns[group] = tuple(tensors[group])
        else:
            ins = tuple(tensors.get("inputs") or ())
            ns["inputs"] = ins
            ns["args"] = self._call.get("args", ins)
            ns["kwargs"] = dict(self._call.get("kwargs") or {})
            if "outputs" in tensors:
                outs = tuple(tensors["outputs"])
                ns["outputs"] = outs
                ns["out"] = self._call["result"] if "result" in self._call else outs[0]
                if ns["out"] is None:  # in place, returning None (__setitem__)
                    ns["out"] = outs[0] if outs else None
        module = self._pauser.module_named(ev.get("module"))
        if module is not None:
            ns["module"] = module
        if focus is not None:
            group, index = focus
            items = tensors.get(group) or ()
            ns["x"] = items[index] if index < len(items) else None
        return ns

    def control(self, args: dict[str, Any], control: Run | None) -> Run:
        """What interrupts this evaluation: the asker's (a UI's task, which it can cancel),
        else one with the expression's budget or the job's."""
        if control is not None:
            return control
        budget = args.get("budget")
        if budget is not None:
            try:
                budget = check_budget(budget, "budget")
            except (TypeError, ValueError) as exc:
                raise BreakpointError(str(exc)) from None
        return Run(budget if budget is not None else self._pauser.eval_budget)

    def run(self, expr: str, focus: tuple[str, int] | None, control: Run | None = None) -> Any:
        """Evaluate ``expr``; raises what it raises, and ExpressionInterrupted when
        ``control`` (by default: the job's budget) stops it. No torchscope mode sees what
        it runs; the modes are back as they were however it ends."""
        code = _code(expr.strip())
        scope = self.namespace(focus)
        scope["__builtins__"] = __builtins__
        run = control if control is not None else Run(self._pauser.eval_budget)
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            # the user's own expression, as in pdb; only it can be interrupted
            return guarded(lambda: eval(code, scope), run)

    # -- the control commands (run by the paused thread) --------------------------------------
    def evaluate(
        self, args: dict[str, Any], by_ui: bool = True, control: Run | None = None
    ) -> dict[str, Any]:
        expr = args["expr"]
        try:
            _code(expr.strip())  # a logpoint's, at every hit: compiled once
        except Exception:  # compile() raises several types: the check below words it
            try:
                check_expression(expr)  # says why in one line
            except ExpressionError as exc:
                raise BreakpointError(str(exc)) from None
            raise
        focus = self.focus(args.get("group"), args.get("index"))
        count = args.get("count", 16)
        run = self.control(args, control)
        t0 = time.perf_counter()
        try:
            value = self.run(expr, focus, run)
        except ExpressionInterrupted:
            return {"expr": expr, "error": run.text(), "interrupted": True, "took_s": _took(t0)}
        except Exception as exc:
            return {"expr": expr, "error": one_line(exc), "took_s": _took(t0)}
        answer = answer_of(value, count)
        answer.update(expr=expr, took_s=_took(t0), x=target_text(*focus))
        answer["text"] = answer_text(answer)
        return answer

    def edit(
        self,
        args: dict[str, Any],
        by_ui: bool = True,
        bp: Breakpoint | None = None,
        control: Run | None = None,
    ) -> dict[str, Any]:
        """Replace one tensor of the event; raises BreakpointError (one line) when refused."""
        text = args["expr"]
        try:
            check_expression(text, edit=True)
            target, expr = split_edit(text)
            group, index = parse_target(target) if target is not None else ("x", None)
        except ExpressionError as exc:
            raise BreakpointError(f"edit refused: {exc}") from None
        if group == "x":
            group, index = self.focus(args.get("group"), args.get("index"))
        assert index is not None
        self._editable(group, index)
        items = self.point.tensors[group]
        old = items[index]
        if old is None:
            raise BreakpointError(
                f"edit refused: {target_text(group, index)} is None (no gradient flows there)"
            )
        run = self.control(args, control)
        try:
            value = self.run(expr, (group, index), run)
        except ExpressionInterrupted:
            raise BreakpointError(f"edit not applied: {run.text()}") from None
        except Exception as exc:
            raise BreakpointError(f"edit refused: {one_line(exc)}") from None
        new = _replacement(value, old, target_text(group, index))
        before = tensor_summary(old)
        if group == "outputs":
            # In place, through .data: the op's output object stays (later ops and the
            # job's own variable hold it), autograd's version counter does not move.
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
                old.data.copy_(new)
            new = old
        else:
            items[index] = new
            self.edited = True
        after = tensor_summary(new)
        self._pauser.edited(self.point, new, after, group == "outputs")
        edit = self._pauser.edit_event(
            self.point, target_text(group, index), text, before, after, by_ui, bp
        )
        return {"edit": edit, "text": f"{edit['target']}: {summary_pair(before, after)}"}

    def _editable(self, group: str, index: int) -> None:
        point = self.point
        kind = point.event.get("kind")
        name = target_text(group, index)
        if kind == ATEN:
            raise BreakpointError("edit refused: an aten call's tensors cannot be edited")
        if kind == GRAD:
            want = "grad_inputs" if point.phase == AFTER else "grad_outputs"
            if group != want:
                when = "after" if point.phase == AFTER else "before"
                raise BreakpointError(
                    f"edit refused: {name}: {when} a node runs, its {want} can be edited"
                )
        elif group != "outputs" or point.phase == BEFORE:
            raise BreakpointError(
                f"edit refused: {name}: an op's output can be edited, once it has run "
                "(its inputs are the job's own tensors)"
            )
        if group not in point.tensors:
            have = ", ".join(point.tensors) or "nothing"
            raise BreakpointError(f"edit refused: no {group} at this point (have {have})")
        n = len(point.tensors[group])
        if not 0 <= index < n:
            raise BreakpointError(f"edit refused: {group} has {n} tensors, not index {index}")

    # -- a breakpoint's action (at its hit, on the training thread) ---------------------------
    def act(self, bp: Breakpoint) -> None:
        """Log or edit for ``bp``; never raises into the job. One whose expression fails
        or runs over the job's budget is disabled, said in one line: it would at every hit."""
        pauser = self._pauser
        where = _where(self.point.event)
        if bp.log is not None:
            t0 = time.perf_counter()
            answer = self.evaluate({"expr": bp.log, "count": 8}, by_ui=False)
            text = answer_text(answer)
            pauser.log_event(self.point.event, bp, text)
            if answer.get("error"):
                pauser.disable(
                    bp, f"log {where}: {bp.log} = {text}; breakpoint {bp.id} disabled{_AGAIN}"
                )
                return
            pauser.say_log(bp, f"log {where}: {bp.log} = {text}", time.perf_counter() - t0)
            return
        try:
            self.edit({"expr": bp.edit}, by_ui=False, bp=bp)
        except BreakpointError as exc:
            pauser.disable(bp, f"breakpoint {bp.id} at {where}: {exc}; disabled{_AGAIN}")
            return
        pauser.say_once(
            bp,
            f"edit at {where}: {bp.edit} (breakpoint {bp.id}, at every hit; this run's "
            "numbers are changed by hand)",
        )


# Said when a logpoint or an edit at every hit is disabled.
_AGAIN = " (not tried again at later hits)"


@functools.lru_cache(maxsize=256)
def _code(expr: str) -> Any:
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError("too long")
    return compile(expr, "<torchscope expression>", "eval")


def _where(ev: dict[str, Any]) -> str:
    name = ev.get("node") if ev.get("kind") == GRAD else ev.get("name")
    return f"{name or '?'} (step {ev.get('step', '?')})"


def _took(t0: float) -> float:
    return round(time.perf_counter() - t0, 6)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:299] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _replacement(value: Any, old: torch.Tensor, name: str) -> torch.Tensor:
    """The value to put in place of ``old``: a tensor like it, copied (never an alias of
    something the job holds). Raises BreakpointError in one line otherwise."""
    if isinstance(value, (int, float, bool)) and not isinstance(value, torch.Tensor):
        value = torch.full_like(old, value)
    if not isinstance(value, torch.Tensor):
        raise BreakpointError(f"edit refused: {name} needs a tensor, not {type(value).__name__}")
    for what, got, want in (
        ("shape", list(value.shape), list(old.shape)),
        ("dtype", value.dtype, old.dtype),
        ("device", value.device, old.device),
    ):
        if got != want:
            got_s = str(got).removeprefix("torch.")
            want_s = str(want).removeprefix("torch.")
            raise BreakpointError(f"edit refused: {what} {got_s} is not {name}'s {want_s}")
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        return value.detach().clone()


def answer_of(value: Any, count: int) -> dict[str, Any]:
    """An expression's value as plain data: a tensor's summary and its first ``count``
    values, or a bounded repr."""
    if isinstance(value, torch.Tensor):
        summary = tensor_summary(value, count)
        kept = summary.get("values")  # a small tensor's: read once
        return {"summary": summary, "values": kept if kept is not None else _values(value, count)}
    return {"repr": bounded_repr(value), "type": type(value).__name__}


def tensor_summary(t: torch.Tensor, small: int = 16) -> dict[str, Any]:
    """Shape, dtype, device and stats (min, max, mean, std, norm over the finite values; NaN
    and Inf counted), read now: a pause may sync. Its values when it has at most ``small``."""
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        summary = tensor_meta(t)
        x = t.detach()
        if hasattr(x, "to_local"):
            x = x.to_local()
            summary["stats_of"] = "local"
        if x.layout != torch.strided:
            x = x.to_dense()
        flat = x.reshape(-1)
        n = flat.numel()
        summary["stats"] = None
        if n and (flat.is_floating_point() or flat.is_complex() or flat.dtype != torch.bool):
            f = flat.abs() if flat.is_complex() else flat
            f = f.double() if not f.is_floating_point() or f.element_size() < 4 else f
            nan = int(torch.isnan(f).sum())
            inf = int(torch.isinf(f).sum())
            g = f[torch.isfinite(f)] if nan or inf else f
            stats: dict[str, Any] = {"nan": nan, "inf": inf}
            if g.numel():
                stats.update(
                    min=float(g.min()),
                    max=float(g.max()),
                    mean=float(g.mean()),
                    std=float(g.std(correction=0)),
                    norm=float(torch.linalg.vector_norm(g)),
                )
            summary["stats"] = stats
        elif n:
            vals = flat.to(torch.uint8)
            summary["stats"] = {"min": int(vals.min()), "max": int(vals.max()), "nan": 0, "inf": 0}
        if n <= small:
            summary["values"] = _values(x, small)
        return summary


def _values(t: torch.Tensor, count: int) -> list:
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        x = t.detach()
        if hasattr(x, "to_local"):
            x = x.to_local()
        if x.layout != torch.strided:
            x = x.to_dense()
        part = x.reshape(-1)[:count]
        if part.is_complex():
            part = torch.view_as_real(part).reshape(-1)
        if part.dtype == torch.bool:
            part = part.to(torch.uint8)
        return part.cpu().tolist()


def summary_pair(before: dict[str, Any], after: dict[str, Any]) -> str:
    from torchscope.protocol.expressions import summary_text

    return f"{summary_text(before)} -> {summary_text(after)}"


def _about(ev: dict[str, Any]) -> dict[str, Any]:
    """The event a log line or an edit is about: its seq, its name (a node's), its node id."""
    return {
        "at": ev.get("seq"),
        "name": ev.get("node") if ev.get("kind") == GRAD else ev.get("name"),
        "node_id": ev.get("node_id"),
    }


def log_line_event(seq: int, step: int, ev: dict[str, Any], bp: Breakpoint, text: str) -> Event:
    return Event(
        kind=LOG,
        seq=seq,
        step=step,
        **_about(ev),
        expr=bp.log,
        text=text,
        bp=bp.id,
    )


def edit_event(
    seq: int,
    step: int,
    point: PausePoint,
    target: str,
    expr: str,
    before: dict[str, Any],
    after: dict[str, Any],
    by_ui: bool,
    bp: Breakpoint | None,
) -> Event:
    ev = point.event
    return Event(
        kind=EDIT,
        seq=seq,
        step=step,
        **_about(ev),
        phase=point.phase,
        target=target,
        expr=expr,
        before=[before],
        after=[after],
        by="a UI" if by_ui else "command line",
        bp=bp.id if bp is not None else None,
    )


__all__ = ["Evaluator", "answer_of", "tensor_summary"]
