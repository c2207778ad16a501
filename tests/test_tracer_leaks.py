"""Nothing accumulates: graphs, saved tensors and hooks die with their step; memory is flat."""

from __future__ import annotations

import gc
import weakref

import torch

import torchscope
from torchscope.tracer.armed import calls as mode
from torchscope.tracer.armed import session, source


def test_ten_thousand_steps_stay_bounded():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(3)
    dead_checked = 0
    # The caches are process-wide (other tests may have filled them): what counts is growth.
    names_before, internal_before = len(mode.op_names), len(source._internal)

    def one_step(keep_graph: bool):
        if keep_graph:
            prod = w * x  # saved by SinBackward0: lives exactly as long as the graph
            loss = prod.sin().sum()
        else:
            prod = None
            loss = (w * x).sum()
        loss.backward(retain_graph=keep_graph)
        with torch.no_grad():
            w.sub_(w.grad, alpha=1e-3)
        w.grad = None
        torchscope.step()
        return weakref.ref(prod) if prod is not None else None

    counts = {}
    with torchscope.trace(keep=1000, optimizer_steps=False) as tr:
        for i in range(10_000):
            ref = one_step(keep_graph=i % 100 == 0)
            if i % 100 == 0:
                # the graph (kept alive through the backward call) and everything it held is
                # freed as soon as the step's last reference goes: no hook closure, memo entry
                # or node id keeps it, not even through a reference cycle
                assert ref() is None, f"step {i}: the graph outlived its step"
                dead_checked += 1
            if i in (2_000, 9_999):
                gc.collect()
                counts[i] = len(gc.get_objects())
                assert len(tr.summaries.memo) < 50
        assert len(tr.events) == 1000
    assert dead_checked == 100
    assert tr.step_index == 10_000
    assert tr.errors == []
    # a linear leak of even one object per step would add ~8000
    assert counts[9_999] - counts[2_000] < 500, counts
    # the tracer's caches hold per-function and per-code-object entries only: the few this
    # loop calls, not one per step
    assert len(mode.op_names) - names_before < 100
    assert len(source._internal) - internal_before < 5000
    assert len(tr.trace.steps) > 0 and {o.step for o in tr.ops} <= set(range(9_700, 10_000))


def test_hooks_are_removed_after_each_backward_call():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with torchscope.trace(steps="0") as tr:
        out = (x * 3).exp().sum()
        out.backward(retain_graph=True)
        torchscope.step()  # step 1: not traced
        out.backward(retain_graph=True)  # the same graph: no hook of ours may fire
    out.backward()  # nor after the trace ended
    assert [(g.step, g.backward) for g in tr.grads] == [(0, 1)] * 4
    assert len(tr.graphs) == 1 and tr.errors == []
    assert torch.allclose(x.grad, 3 * 3 * (x * 3).exp().detach())


def test_tracer_objects_are_freed_after_stop():
    x = torch.randn(3, requires_grad=True)
    with torchscope.trace() as tr:
        (x * 2).sum().backward()
    ref = weakref.ref(tr)
    events = tr.events
    del tr
    gc.collect()
    assert ref() is None, "the stopped tracer is still referenced (hooks, globals, threads)"
    assert session.current_tracer() is None
    assert len(events) > 0


def test_listening_to_backward_calls_again_and_again_leaves_nothing():
    """The watch switched on and off from a UI listens and stops listening each time: the
    wrapper of torch.autograd.backward it installs goes with the last listener."""
    from torchscope.tracer import backward_calls
    from torchscope.tracer.armed.calls import BACKWARD_CALLS

    class Listener:
        def backward_begins(self, kwargs):
            return None

        def backward_ends(self, ok):
            pass

    original, known = torch.autograd.backward, len(BACKWARD_CALLS)
    for _ in range(50):
        handle = backward_calls.listen(Listener())
        assert torch.autograd.backward is not original
        handle.remove()
    assert torch.autograd.backward is original
    assert len(BACKWARD_CALLS) == known
