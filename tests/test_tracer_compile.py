"""torch.compile inside a traced run: the job runs and computes exactly as untraced, Dynamo
does not trace into the tracer (its graph holds the model's ops only), and the code around
the compiled region is traced."""

from __future__ import annotations

import warnings

import torch

import torchscope


def run(trace: bool) -> tuple[list[float], object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    losses = []
    tr = torchscope.trace() if trace else None
    if tr is not None:
        tr.start()
    try:
        for _ in range(3):
            loss = compiled(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if tr is not None:
            tr.stop()
    return losses, tr


def test_a_compiled_model_runs_unchanged_under_tracing():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    expected, _ = run(trace=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on global module hooks
        losses, tr = run(trace=True)
    assert losses == expected
    assert tr.errors == []
    names = {o.name for o in tr.ops}
    assert "Tensor.pow" in names and "Tensor.mean" in names  # around the compiled region
    assert {g.step for g in tr.grads} == {0, 1, 2}
    # One graph, no breaks: the tracer's Python was not compiled into (nor broke) it.
    counters = torch._dynamo.utils.counters
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_jit_trace_records_only_the_model():
    """torch.jit.trace records every op that runs: the tracer's own reductions must not be
    among them, nor warn (TracerWarning) about reading numbers on the host."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 8)
    plain = torch.jit.trace(model, x)
    with torchscope.trace() as tr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, x)
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]

    def kinds(m):
        return [n.kind() for n in m.inlined_graph.nodes()]

    assert kinds(traced) == kinds(plain)
    assert torch.equal(traced(x), model(x))
    assert tr.errors == []
