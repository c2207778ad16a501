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


class CompiledJob:
    """A compiled MLP and its optimizer; ``step()`` is one training step."""

    def __init__(self, backend: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.compiled = torch.compile(self.model, backend=backend)

    def step(self) -> float:
        loss = self.compiled(torch.randn(4, 8)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()


def compiles() -> int:
    """Frames Dynamo compiled so far (a recompile adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_arming_and_disarming_a_compiled_model_never_recompiles_it():
    """Dynamo guards on the function-mode stack and on the global module hooks: torchscope's
    leave both while compiled code runs. Compiled untraced then traced, and compiled traced
    then untraced: one compile each, and the same losses as a job never traced."""
    plain = CompiledJob("eager")
    expected = [plain.step() for _ in range(4)]
    for traced_steps in ((2, 3), (0, 1)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        job = CompiledJob("eager")
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note on global hooks
            for i in range(4):
                if i in traced_steps:
                    with torchscope.trace() as tr:
                        losses.append(job.step())
                    assert tr.errors == []
                else:
                    losses.append(job.step())
        assert losses == expected
        assert compiles() == 1, traced_steps


def test_a_compiled_call_is_one_op_whose_backward_is_the_compiled_graphs_node():
    torch._dynamo.reset()
    job = CompiledJob("aot_eager")
    job.step()  # compiled before tracing, as in a job attached to mid-run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with torchscope.trace(aten=True) as tr:
            job.step()
    assert tr.errors == []
    (call,) = [o for o in tr.ops if o.get("compiled")]
    assert call.name == "torch.compile:Sequential" and call.module == ""
    assert call.source.endswith("test_tracer_compile.py:" + str(line_of_step()))
    assert call.inputs[0]["shape"] == [4, 8] and call.outputs[0]["shape"] == [4, 1]
    assert [o.name for o in tr.ops] == [
        "torch.randn",
        "torch.compile:Sequential",
        "Tensor.pow",
        "Tensor.mean",
    ]  # nothing inside the compiled region, at either level
    assert not any(e.get("op_seq") == call.seq for e in tr.events if e.kind == "aten")
    (node,) = [g for g in tr.grads if g.node == "CompiledFunctionBackward"]
    assert node.op_seq == call.seq and [n["name"] for n in call.nodes] == [
        "CompiledFunctionBackward"
    ]
    # both sides: the gradient that arrives at the output, and those it sends to the weights
    assert node.grad_outputs[0]["shape"] == [4, 1]
    assert [s["shape"] for s in node.grad_inputs if s] == [[8, 8], [8], [1, 8], [1]]
    # parameters named as in the model, not through the wrapper (_orig_mod.0.weight)
    assert {g.param for g in tr.grads if g.node == "AccumulateGrad"} == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }


def line_of_step() -> int:
    import inspect

    lines, first = inspect.getsourcelines(CompiledJob.step)
    return first + next(i for i, s in enumerate(lines) if "self.compiled(" in s)


def test_code_torch_generates_is_never_the_users_line():
    """A compiled function (the eager backend runs an FX graph from "<eval_with_key>.N") and
    torch.mm, which torch.overrides calls torch.spmm: the user's line, the user's name."""

    def f(x):
        return torch.sin(x) * 2

    torch._dynamo.reset()
    cf = torch.compile(f, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with torchscope.trace() as tr:
            cf(torch.randn(3))
            torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    sin = next(o for o in tr.ops if o.name == "torch.sin")
    # f's own lines (a compiled frame reports its function's first line), not generated code
    body = line_of("return torch.sin(x) * 2")
    assert sin.source in (f"{__file__}:{body - 1}", f"{__file__}:{body}")
    assert "torch.mm" in {o.name for o in tr.ops} and "torch.spmm" not in {o.name for o in tr.ops}


def line_of(needle: str) -> int:
    with open(__file__) as f:
        return next(i for i, s in enumerate(f, 1) if needle in s and "line_of" not in s)
