"""Expressions at a pause: their text checked, edit targets, answers as text, and what a
recording can answer.

Shared by the tracer (which runs expressions in the job: :mod:`torchscope.tracer.armed.evaluate`),
the UI and the MCP server, so it imports neither torch nor textual. An expression is Python
code that the job runs on its training thread, as pdb's ``p`` does; nothing here runs one.

A recording keeps each tensor's summary (shape, dtype, stats, up to N values), not the tensor:
:func:`evaluate_kept` answers the few expressions those summaries can (a tensor by name, its
shape, dtype and stats) and says plainly that the rest needs a live job.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from torchscope.protocol.events import number_text

MAX_EXPRESSION_CHARS = 1000
MAX_REPR_CHARS = 400  # a non-tensor answer's repr, cut there
# Where a value can be edited: a name an edit may assign to, and the tensor group it names.
TARGET_GROUPS = {
    "out": "outputs",
    "outputs": "outputs",
    "grad_inputs": "grad_inputs",
    "grad_outputs": "grad_outputs",
}


class ExpressionError(ValueError):
    """An expression that cannot be run or answered; the text is one line for the user."""


def check_expression(text: Any, *, edit: bool = False) -> None:
    """Raise ExpressionError (one line) unless ``text`` is an expression Python can compile
    (an edit may also be ``TARGET = EXPR``)."""
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("an expression, please")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(
            f"the expression is {len(text)} characters long; the limit is {MAX_EXPRESSION_CHARS}"
        )
    target, expr = split_edit(text) if edit else (None, text)
    try:
        compile(expr.strip(), "<expression>", "eval")
    except SyntaxError as exc:
        raise ExpressionError(f"syntax error: {exc.msg} in {expr.strip()!r}") from None
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:
        raise ExpressionError(f"cannot compile {expr.strip()!r}: {exc}") from None
    if target is not None:
        parse_target(target)


def split_edit(text: str) -> tuple[str | None, str]:
    """``"grad_inputs[1] = EXPR"`` -> ``("grad_inputs[1]", "EXPR")``; a bare ``EXPR``
    replaces ``x`` (the tensor in focus): ``(None, "EXPR")``."""
    try:
        tree = ast.parse(text.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, text
    body = tree.body
    if len(body) == 1 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1:
        node = body[0]
        target = ast.get_source_segment(text.strip(), node.targets[0])
        expr = ast.get_source_segment(text.strip(), node.value)
        if target is not None and expr is not None:
            return target.strip(), expr.strip()
    return None, text


def parse_target(text: str) -> tuple[str, int | None]:
    """``"grad_inputs[1]"`` -> ``("grad_inputs", 1)``; ``"x"`` -> ``("x", None)``;
    ``"out"`` -> ``("outputs", 0)``. Raises ExpressionError for anything else."""
    text = text.strip()
    if text == "x":
        return "x", None
    if text == "out":
        return "outputs", 0
    name, sep, rest = text.partition("[")
    name = name.strip()
    index = rest[:-1].strip()
    if sep and rest.endswith("]") and name in TARGET_GROUPS and index.isascii() and index.isdigit():
        return TARGET_GROUPS[name], int(index)
    raise ExpressionError(
        f"cannot edit {text!r}: an edit replaces x, out, outputs[i], grad_inputs[i] or "
        "grad_outputs[i]"
    )


def target_text(group: str, index: int) -> str:
    """How people write the tensor ``group[index]`` of an event (``out``, ``grad_inputs[0]``)."""
    return f"{group}[{index}]"


# -- answers as text --------------------------------------------------------------------------
def summary_text(summary: Any, values: list | None = None) -> str:
    """A tensor answer in one line: its value when it has one element, its values when it
    has a few, else ``tensor[3, 4] float32 min=… max=… mean=… std=…`` (+ NaN/Inf counts)."""
    if not isinstance(summary, dict):
        return "None"
    shape = summary.get("shape") if isinstance(summary.get("shape"), list) else None
    vals = values if values is not None else summary.get("values")
    numel = math.prod(d for d in shape if isinstance(d, int)) if shape is not None else None
    if isinstance(vals, list) and numel is not None and len(vals) == numel and numel <= 8:
        if not shape:
            return number_text(vals[0]) if vals else "[]"
        return "[" + ", ".join(number_text(v) for v in vals) + "]"
    dims = ", ".join(str(d) for d in shape) if shape is not None else "?"
    parts = [f"tensor[{dims}] {summary.get('dtype') or ''}".rstrip()]
    stats = summary.get("stats")
    if isinstance(stats, dict):
        for key in ("min", "max", "mean", "std"):
            if stats.get(key) is not None:
                parts.append(f"{key}={number_text(stats[key])}")
        for key in ("nan", "inf"):
            if stats.get(key):
                parts.append(f"{key}={stats[key]}")
    return " ".join(parts)


def answer_text(answer: Any) -> str:
    """An evaluation's answer (as the job or :func:`evaluate_kept` gives it) in one line."""
    if not isinstance(answer, dict):
        return str(answer)
    if answer.get("interrupted") and answer.get("error"):
        return str(answer["error"])  # interrupted after N s (why): no error of its own
    if answer.get("error"):
        return f"error: {answer['error']}"
    if answer.get("pending"):
        return str(answer.get("text") or "still running")
    if answer.get("summary") is not None:
        return summary_text(answer["summary"], answer.get("values"))
    return str(answer.get("repr") or answer.get("text") or "")


def bounded_repr(obj: Any) -> str:
    """``repr(obj)`` cut to :data:`MAX_REPR_CHARS` (containers shortened first)."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = MAX_REPR_CHARS
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 16
    try:
        text = r.repr(obj)
    except Exception as exc:  # a repr that raises: say so, the job is not affected
        text = f"<{type(obj).__name__}: repr raised {type(exc).__name__}>"
    text = " ".join(text.split())  # one line
    return text if len(text) <= MAX_REPR_CHARS else text[: MAX_REPR_CHARS - 1] + "…"


# -- a recording --------------------------------------------------------------------------------
_KEPT_METHODS = ("min", "max", "mean", "std", "norm")
KEPT_HELP = (
    "a recording keeps each tensor's summary (shape, dtype, min/max/mean/std/norm, NaN/Inf "
    "counts, a few values), not the tensor: here p answers x, out, inputs[i], outputs[i], "
    "grad_inputs[i], grad_outputs[i] and their .shape, .dtype, .numel(), .min(), .max(), "
    ".mean(), .std(), .norm(); anything else runs in a live job at a pause"
)


def event_groups(event: dict[str, Any]) -> dict[str, list]:
    """The summaries of an event's tensors by the names expressions use."""
    if event.get("kind") == "grad":
        return {
            "grad_inputs": list(event.get("grad_inputs") or ()),
            "grad_outputs": list(event.get("grad_outputs") or ()),
        }
    ins = list(event.get("inputs") or ())
    outs = list(event.get("outputs") or ())
    return {"inputs": ins, "args": ins, "outputs": outs}


def evaluate_kept(
    text: str, event: dict[str, Any], focus: tuple[str, int] | None = None
) -> dict[str, Any]:
    """Answer ``text`` over what a recording kept of ``event`` (its summaries), as the job
    answers an evaluation: ``{"summary", "values"}`` or ``{"repr"}``. Raises
    ExpressionError (one line) for anything the summaries cannot answer."""
    check_expression(text)
    groups = event_groups(event)
    tree = ast.parse(text.strip(), mode="eval").body
    method = None
    attr = None
    if isinstance(tree, ast.Call) and not tree.args and not tree.keywords:
        if isinstance(tree.func, ast.Attribute) and tree.func.attr in (*_KEPT_METHODS, "numel"):
            method, tree = tree.func.attr, tree.func.value
    elif isinstance(tree, ast.Attribute) and tree.attr in ("shape", "dtype", "device"):
        attr, tree = tree.attr, tree.value
    summary = _kept_tensor(tree, groups, focus)
    if summary is None:
        raise ExpressionError(KEPT_HELP)
    if not isinstance(summary, dict):
        return {"repr": "None"}
    if attr is not None:
        value = summary.get(attr)
        return {"repr": f"torch.Size({value})" if attr == "shape" else str(value)}
    stats = summary.get("stats")
    stats = stats if isinstance(stats, dict) else {}
    if method == "numel":
        shape = summary.get("shape") or []
        return {"repr": str(math.prod(d for d in shape if isinstance(d, int)))}
    if method is not None:
        if stats.get(method) is None:
            raise ExpressionError(f"the recording kept no {method} of this tensor")
        return {"repr": number_text(stats[method], 6)}
    return {"summary": summary, "values": summary.get("values")}


def _kept_tensor(node: ast.AST, groups: dict[str, list], focus: tuple[str, int] | None) -> Any:
    """The summary an expression names (``x``, ``out``, ``grad_inputs[0]``), False for a
    tensor slot that holds None, or None when it names nothing a recording keeps."""
    if isinstance(node, ast.Name):
        if node.id == "x":
            group, index = focus or _default_focus(groups)
        elif node.id == "out":
            group, index = "outputs", 0
        else:
            return None
    elif (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and isinstance(node.slice, ast.Constant)
        and type(node.slice.value) is int
    ):
        group, index = node.value.id, node.slice.value
        if node.value.id == "out":
            return None
    else:
        return None
    items = groups.get(group)
    if items is None or not -len(items) <= index < len(items):
        return None
    s = items[index]
    return s if isinstance(s, dict) else False


def _default_focus(groups: dict[str, list]) -> tuple[str, int]:
    for group in ("outputs", "grad_inputs", "grad_outputs", "inputs"):
        for i, s in enumerate(groups.get(group) or ()):
            if isinstance(s, dict):
                return group, i
    return "outputs", 0
