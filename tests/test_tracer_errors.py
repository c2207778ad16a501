"""A failing tracer never breaks the job: same results, one error event and one stderr line
per place, and the job's own exceptions pass through untouched."""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn.functional as F

import torchscope
from torchscope.tracer.armed import alerts, pipeline
from torchscope.tracer.armed.modules import ModuleTracker
from torchscope.tracer.armed.summary import Summarizer


def boom(*args, **kwargs):
    raise ValueError("boom")


def train(steps: int = 3, trace: bool = True):
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    g = torch.Generator().manual_seed(0)
    tr = torchscope.trace() if trace else None
    if tr is not None:
        tr.start()
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if tr is not None:
            tr.stop()
    return losses, [p.detach().clone() for p in model.parameters()], tr


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("torchscope:")]


@pytest.mark.parametrize(
    ("target", "name", "where"),
    [
        (ModuleTracker, "current", ["forward op (after)"]),
        # Only outputs are summarised up front (inputs from outside, like weights, wait until
        # an output goes bad), so every forward failure is on an output.
        (Summarizer, "summarize", ["forward op (after)", "backward hook"]),
        (ModuleTracker, "param_name", ["forward op (before)", "installing backward hooks"]),
        (alerts, "_bad_kind", ["resolving summaries"]),
    ],
    ids=["module-current", "summarize", "param-name", "alerts"],
)
def test_internal_error_is_reported_once_and_harmless(monkeypatch, capfd, target, name, where):
    ref_losses, ref_params, _ = train(trace=False)
    if target is alerts:
        monkeypatch.setattr(pipeline.AlertDetector, "check", boom)
    else:
        monkeypatch.setattr(target, name, boom)
    losses, params, tr = train()
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert [e.where for e in tr.errors] == where
    assert all(e.message == "ValueError: boom" for e in tr.errors)
    lines = error_lines(capfd.readouterr().err)
    assert lines == [
        f"torchscope: internal error in {w}: ValueError: boom (tracing continues; reported once)"
        for w in where
    ]
    # the tracer kept going around the broken piece
    assert tr.trace.steps and len(tr.trace.steps) == 3  # none after the last update


def test_failed_hook_install_leaves_no_hooks_behind(monkeypatch):
    """Hooks installed before the failure must go too: else they fire in this backward and in
    every later one on the same graph."""
    monkeypatch.setattr(ModuleTracker, "param_name", boom)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with torchscope.trace() as tr:
        out = (x * 3).exp().sum()
        out.backward(retain_graph=True)
        out.backward()
    assert tr.grads == [] and tr.graphs == []
    assert [e.where for e in tr.errors] == ["forward op (before)", "installing backward hooks"]
    assert torch.allclose(x.grad, 2 * 3 * (x * 3).exp().detach())


def test_failing_sink(capfd):
    calls = []

    def sink(events):
        calls.append(len(events))
        raise RuntimeError("disk full")

    tr = torchscope.Tracer(sinks=[sink])
    with tr:
        for _ in range(3):
            (torch.ones(2) * 2).sum()
            torchscope.step()
    assert len(calls) >= 3
    assert [e.where for e in tr.errors][:1] == [f"event sink {sink.__qualname__}"]
    assert len(error_lines(capfd.readouterr().err)) == 1
    assert len(tr.ops) == 9


def test_job_exceptions_pass_through_unchanged(capfd):
    a, b = torch.ones(2, 3), torch.ones(4, 5)
    with pytest.raises(RuntimeError) as plain:
        a @ b
    with torchscope.trace() as tr:
        with pytest.raises(RuntimeError) as traced:
            a @ b
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.ones(2).sum().backward()
        c = a + 1
    assert str(traced.value) == str(plain.value)
    assert tr.errors == [] and error_lines(capfd.readouterr().err) == []
    assert [o.name for o in tr.ops][-1] == "Tensor.add" and c.sum().item() == 12.0


def test_stderr_failure_does_not_reach_the_job(monkeypatch):
    """Reporting an error must not raise either (a closed or broken stderr)."""
    import sys

    class Broken:
        def write(self, s):
            raise BrokenPipeError("stderr is gone")

        def flush(self):
            raise BrokenPipeError("stderr is gone")

    monkeypatch.setattr(ModuleTracker, "current", boom)
    monkeypatch.setattr(sys, "stderr", Broken())
    with torchscope.trace() as tr:
        y = torch.ones(3) * 2
    assert y.tolist() == [2.0, 2.0, 2.0]
    assert [e.where for e in tr.errors] == ["forward op (after)"]


def test_warnings_raised_in_traced_calls_point_at_the_callers_line():
    """torch warns about "the frame that called me"; under the tracer's mode that frame must
    still be the user's line (C warnings and torch's Python warnings with a stacklevel)."""
    import inspect
    import warnings

    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, torchscope.trace(live=False):
        warnings.simplefilter("always")
        here = inspect.currentframe().f_lineno
        float((x * 2).sum())  # C: "Converting a tensor with requires_grad=True to a scalar"
        torch.nn.functional.softmax(torch.randn(3))  # Python, stacklevel: "Implicit dimension"
    where = {str(w.message)[:20]: (w.filename, w.lineno) for w in caught}
    assert where["Converting a tensor "] == (__file__, here + 1), where
    assert where["Implicit dimension c"] == (__file__, here + 2), where


def test_trace_takes_its_documented_options_and_refuses_others():
    """trace() forwards its options to the Tracer it builds; an internal knob (sinks=) or a
    typo is a TypeError naming it, as for any Python function."""
    with torchscope.trace(keep=3, steps="1", values=4, optimizer_steps=False) as tr:
        pass
    assert tr.steps.text == "1" and tr.summarizer.value_limit == 4
    assert tr.clock is not None and tr.clock.optimizer_steps is False
    for bad in ({"sinks": []}, {"step": 1}):
        with pytest.raises(TypeError, match=repr(next(iter(bad)))):
            torchscope.trace(**bad)


def test_options_are_checked_in_one_line_each():
    """trace() and serve() check their keywords through torchscope.Options: an option of the
    other says so, a bad value is refused before anything starts."""
    with pytest.raises(TypeError, match=r"'watch' \(it is an option of serve\(\)\)"):
        torchscope.Options.for_trace(watch="nan")
    with pytest.raises(TypeError, match=r"'keep' \(it is an option of trace\(\)\)"):
        torchscope.Options.for_serve(keep=3)
    for bad, words in (
        ({"values": -1}, "values must be"),
        ({"steps": "x"}, "bad step spec"),
        ({"on_nan": "halt"}, "on_nan must be one of"),
        ({"lease": 0}, "lease must be a positive"),
        ({"aten": "("}, "not a regular expression"),
    ):
        with pytest.raises((TypeError, ValueError), match=words) as info:
            torchscope.Options.for_serve(**bad)
        assert "\n" not in str(info.value)


def test_step_moves_a_trace_block_that_hooks_no_optimizer():
    """With optimizer_steps=False and the update's ops traced, only torchscope.step() ends a
    step, and step(n) numbers it."""
    with torchscope.trace(optimizer_steps=False, optimizer_ops=True) as tr:
        torch.ones(2).add(1)
        torchscope.step()
        torch.ones(2).mul(2)
        torchscope.step(7)
        torch.ones(2).sub(1)
    assert sorted({e["step"] for e in tr.ops}) == [0, 1, 7]
