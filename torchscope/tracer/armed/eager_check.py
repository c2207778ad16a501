"""A compiled module's call run once more eagerly, traced, and compared with what the
compiled graph produced ("my compiled model goes NaN, eager doesn't").

Asked for a step (``trace(eager_check=True)``, ``run --eager-check``, ``record PID
--eager-check``, the UI's key), each call of a ``torch.compile``'d module in it runs again as
its original module, right after the compiled call: same inputs, same RNG state, traced op by
op (at the aten level when that is on). The job keeps the compiled results: the RNG state and
the module's buffers (BatchNorm's running statistics) are put back as the compiled call left
them, and the eager outputs feed nothing of the job.

Two ``alert`` events (``what: "eager_check"``) say what differs, each against the tolerance
``torch.testing.assert_close`` uses for the dtype:

- after the forward: each output's largest absolute and relative difference, and NaN/Inf on
  one side only;
- when the compiled graph's backward node has run: the gradient the eager graph sends each
  parameter for the same incoming gradient, against the compiled one.

Inside the compiled graph there are no intermediate values to compare (inductor fuses them
away): the eager run's own ops are in the trace, between the compiled call's op event and
the first report, to step through.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.func import functional_call

from torchscope.protocol.events import ALERT, Event
from torchscope.tracer.armed.calls import nested_tensors
from torchscope.tracer.eager import drew_random, eager_module, rng_state, set_rng_state
from torchscope.tracer.in_place import running_eagerly

EAGER_CHECK = "eager_check"
# torch.testing.assert_close's defaults: (rtol, atol) per dtype.
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


_RANDOM_HINT = (
    " (it draws random numbers, as dropout does: inductor draws them differently unless "
    "torch._inductor.config.fallback_random = True)"
)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def difference(compiled: torch.Tensor, eager: torch.Tensor) -> dict[str, Any]:
    """How far apart two tensors are: largest absolute and relative difference over the
    elements finite on both sides, NaN/Inf found on one side only, and whether that is
    within the dtype's tolerance."""
    with torch.no_grad():
        a = compiled.detach().double()
        b = eager.detach().double()
        finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
        both = finite_a & finite_b
        rtol, atol = tolerance(eager.dtype)
        diff = (a - b).abs().where(both, torch.zeros_like(a))
        # Relative to the eager value, or to atol where that is about zero.
        scale = b.abs().where(both, torch.ones_like(b)).clamp_min(max(atol, 1e-12))
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / scale).max()) if diff.numel() else 0.0
        only_compiled = int((~finite_a & finite_b).sum())
        only_eager = int((finite_a & ~finite_b).sum())
        within = bool((diff <= atol + rtol * b.abs().where(both, torch.zeros_like(b))).all())
    return {
        "max_abs": max_abs,
        "max_rel": max_rel,
        "nonfinite_only_compiled": only_compiled,
        "nonfinite_only_eager": only_eager,
        "within": within and not only_compiled and not only_eager,
        "rtol": rtol,
        "atol": atol,
    }


def _worst_text(label: str, d: dict[str, Any]) -> str:
    if d["nonfinite_only_compiled"]:
        return f"{label}: {d['nonfinite_only_compiled']} NaN/Inf in compiled, finite in eager"
    if d["nonfinite_only_eager"]:
        return f"{label}: {d['nonfinite_only_eager']} NaN/Inf in eager, finite in compiled"
    return f"{label}: max |Δ| {d['max_abs']:.3g} (rel {d['max_rel']:.3g})"


def _nonfinite(d: dict[str, Any]) -> int:
    return d["nonfinite_only_compiled"] + d["nonfinite_only_eager"]


def summary_text(what: str, diffs: list[tuple[str, dict[str, Any]]]) -> str:
    """One line: within tolerance, or the worst of them."""
    if not diffs:
        return f"{what}: nothing to compare"
    bad = [(label, d) for label, d in diffs if not d["within"]]
    if not bad:
        worst = max(diffs, key=lambda x: x[1]["max_abs"])
        return f"{what}: eager agrees within tolerance ({_worst_text(*worst)})"
    label, d = max(
        bad,
        key=lambda x: (
            x[1]["nonfinite_only_compiled"] + x[1]["nonfinite_only_eager"],
            x[1]["max_abs"],
        ),
    )
    return (
        f"{what}: {len(bad)} of {len(diffs)} differ beyond tolerance "
        f"(rtol {d['rtol']:g}, atol {d['atol']:g}); worst {_worst_text(label, d)}"
    )


class EagerCheck:
    """One compiled call checked against its eager run (see the module doc)."""

    def __init__(
        self,
        emit: Callable[[Event], None],
        quiet: Callable[[], AbstractContextManager],
        tagged: Callable[[int], AbstractContextManager],
    ) -> None:
        self._emit = emit  # numbers and sends an event
        self._quiet = quiet  # torchscope's own tensor work: not traced, no grad
        self._tagged = tagged  # the eager run's op events marked with the compiled call's seq
        self._base: dict[str, Any] = {}  # the compiled call's op event
        self._rng_before = rng_state()  # taken as the compiled call begins

    def run(self, module: torch.nn.Module, args: tuple, output: Any, op: Event) -> None:
        """Right after the compiled call (``op``, its event): the eager run, the forward
        report, and the hook that makes the gradient report."""
        self._base = op
        original = eager_module(module)
        with self._quiet():
            rng_after = rng_state()
            # The eager run updates copies of the buffers (BatchNorm's running statistics):
            # the job's own stay as the compiled call left them.
            buffers = {name: b.clone() for name, b in original.named_buffers()}
            set_rng_state(self._rng_before)
        drew = False
        try:
            with self._tagged(op["seq"]), running_eagerly(original):
                eager = functional_call(original, buffers, args, strict=False)
        finally:
            with self._quiet():
                drew = drew_random(self._rng_before, rng_state())
                set_rng_state(rng_after)
        compiled_outs, eager_outs = nested_tensors(output), nested_tensors(eager)
        with self._quiet():
            diffs = [
                (f"output {i}", difference(c, e))
                for i, (c, e) in enumerate(zip(compiled_outs, eager_outs, strict=False))
                if c.is_floating_point() and c.shape == e.shape
            ]
        text = summary_text("outputs", diffs)
        if drew and any(not d["within"] for _, d in diffs):
            text += _RANDOM_HINT
        self._report("forward", text, diffs)
        self._watch_backward(original, compiled_outs, eager_outs)

    def _watch_backward(self, original: torch.nn.Module, compiled: list, eager: list) -> None:
        pairs = [(c, e) for c, e in zip(compiled, eager, strict=False) if c.grad_fn is not None]
        if not pairs or any(e.grad_fn is None for _, e in pairs):
            return
        node = pairs[0][0].grad_fn  # CompiledFunctionBackward: every output's node
        if any(c.grad_fn is not node for c, _ in pairs):
            return
        params = {id(p): name for name, p in original.named_parameters()}
        eager_outs = [e for _, e in pairs]
        handle: Any = None

        def compare(grad_inputs: tuple, grad_outputs: tuple) -> None:
            handle.remove()
            try:
                self._compare_gradients(node, grad_inputs, grad_outputs, eager_outs, params)
            except Exception as exc:  # never into the job's backward
                self._report(
                    "backward", f"gradients: not compared ({type(exc).__name__}: {exc})", []
                )

        handle = node.register_hook(compare)

    def _compare_gradients(
        self, node: Any, grad_inputs: tuple, grad_outputs: tuple, eager_outs: list, params: dict
    ) -> None:
        leaves, compiled_grads, names = [], [], []
        for (fn, _), g in zip(node.next_functions, grad_inputs, strict=False):
            variable = getattr(fn, "variable", None)  # AccumulateGrad: a parameter's grad
            if g is not None and variable is not None and id(variable) in params:
                leaves.append(variable)
                compiled_grads.append(g)
                names.append(params[id(variable)])
        if not leaves:
            return
        upstream = [
            g if g is not None else torch.zeros_like(e)
            for g, e in zip(grad_outputs, eager_outs, strict=False)
        ]
        eager_grads = torch.autograd.grad(eager_outs, leaves, upstream, allow_unused=True)
        with self._quiet():
            diffs = [
                (name, difference(c, e))
                for name, c, e in zip(names, compiled_grads, eager_grads, strict=True)
                if e is not None
            ]
        self._report("backward", summary_text("gradients", diffs), diffs)

    def _report(self, where: str, message: str, diffs: list[tuple[str, dict]]) -> None:
        base = self._base
        self._emit(
            Event(
                kind=ALERT,
                seq=None,
                step=base["step"],
                what=EAGER_CHECK,
                where=where,
                name=base["name"],
                module=base.get("module"),
                source=base.get("source"),
                event_seq=base["seq"],
                message=f"{base['name']} against its eager run: {message}",
                differences=[{"of": label, **d} for label, d in diffs],
            )
        )
