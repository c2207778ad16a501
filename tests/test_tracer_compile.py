"""torch.compile inside a traced run: the job runs and computes exactly as untraced, Dynamo
does not trace into the tracer (its graph holds the model's ops only), and the code around
the compiled region is traced."""

from __future__ import annotations

import contextlib
import warnings

import pytest
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


_weight = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))


@torch.compile(backend="aot_eager")
def compiled_block(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ _weight).sum()


def test_arming_and_disarming_around_a_compiled_function_never_recompiles_it():
    """A ``torch.compile``'d function has no module hooks: the hook torchscope puts on its
    compile context steps the modes off for each call, once per context however often a job
    is armed. Its backward node is still traced."""

    def step() -> float:
        loss = compiled_block(torch.randn(4, 8))
        _weight.grad = None
        loss.backward()
        return loss.item()

    torch._dynamo.reset()
    torch.manual_seed(0)
    expected = [step() for _ in range(4)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    losses, grads = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i in range(4):
            if i in (1, 2):
                with torchscope.trace() as tr:
                    losses.append(step())
                assert tr.errors == []
                grads.append({g.node for g in tr.grads})
            else:
                losses.append(step())
    assert losses == expected
    assert compiles() == 1
    assert all("CompiledFunctionBackward" in names for names in grads), grads
    (context,) = [
        c.cell_contents
        for c in compiled_block.__closure__
        if hasattr(c.cell_contents, "enter_exit_hooks")
    ]
    ours = [h for h in context.enter_exit_hooks if h.__name__ == "_around_compiled_function"]
    assert len(ours) == 1


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


class NormNet(torch.nn.Module):
    """BatchNorm (buffers the eager run must not advance) and dropout (RNG it must repeat)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.bn(torch.nn.functional.gelu(self.a(x))), 0.2)
        return self.b(h)


def train_compiled(backend, steps: int, ctx_for=lambda i: contextlib.nullcontext(), net=NormNet):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend=backend)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i in range(steps):
            with ctx_for(i):
                loss = compiled(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
    return losses, model


class CompiledDiffers(NormNet):
    """Computes 1% more when compiled: the graph Dynamo captures takes the other branch."""

    def forward(self, x):
        out = super().forward(x)
        return out * 1.01 if torch.compiler.is_compiling() else out


def test_an_eager_check_finds_nothing_where_compiled_agrees_and_changes_nothing():
    """aot_eager computes as eager: both reports agree within tolerance; with the check on
    at step 1 the job's losses, weights and BatchNorm statistics are bit-identical."""
    plain, plain_model = train_compiled("aot_eager", 3)
    tracers = {}

    def ctx_for(i):
        if i != 1:
            return contextlib.nullcontext()
        tracers[i] = torchscope.trace(eager_check=True)
        return tracers[i]

    checked, model = train_compiled("aot_eager", 3, ctx_for)
    assert checked == plain
    assert torch.equal(model.bn.running_mean, plain_model.bn.running_mean)
    assert torch.equal(model.a.weight, plain_model.a.weight)
    tr = tracers[1]
    assert tr.errors == []
    forward, backward = [a for a in tr.alerts if a.what == "eager_check"]
    assert "outputs: eager agrees within tolerance" in forward.message
    assert "gradients: eager agrees within tolerance" in backward.message
    assert {d["of"] for d in backward.differences} == {
        "a.weight",
        "a.bias",
        "bn.weight",
        "bn.bias",
        "b.weight",
        "b.bias",
    }
    call = next(o for o in tr.ops if o.get("compiled"))
    eager = [o.name for o in tr.ops if o.get("eager_check") == call.seq]
    assert "torch.nn.functional.batch_norm" in eager and "torch.nn.functional.dropout" in eager


def test_an_eager_check_names_the_outputs_and_gradients_a_compiled_graph_got_wrong():
    tracers = []

    def ctx_for(i):
        tracers.append(torchscope.trace(eager_check=True))
        return tracers[-1]

    train_compiled("aot_eager", 1, ctx_for, net=CompiledDiffers)
    (tr,) = tracers
    forward, backward = [a for a in tr.alerts if a.what == "eager_check"]
    assert forward.message.startswith(
        "torch.compile:CompiledDiffers against its eager run: outputs: 1 of 1 differ beyond "
        "tolerance (rtol 1.3e-06, atol 1e-05); worst output 0: max |Δ| "
    )
    (out,) = forward.differences
    assert out["within"] is False and out["max_rel"] == pytest.approx(0.01, rel=1e-3)
    assert "gradients: 6 of 6 differ beyond tolerance" in backward.message
    for d in backward.differences:  # every gradient 1% larger, where it is not ~0
        assert d["within"] is False and d["max_rel"] <= 0.0101


def test_a_ui_asks_one_eager_checked_step_beside_its_own_hold():
    """A UI holding a dormant compiled job traced asks one step eager-checked (``also``):
    that step reports, the next does not, and the UI's own hold stays (the job stays traced);
    `record --eager-check` on the command line is the same request."""
    from torchscope.tracer.agent import Agent, ServeOptions

    events: list = []
    agent = Agent(ServeOptions(live=False)).start()
    agent.sinks.append(events.extend)
    job = CompiledJob("aot_eager")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for i in range(6):
                if i == 1:
                    agent._cmd_arm({"by": "ui"}, b"ui-1")
                if i == 2:
                    agent._cmd_arm(
                        {"by": "ui", "next": 1, "also": True, "eager_check": True}, b"ui-1"
                    )
                job.step()
    finally:
        agent.stop()
    checks = [e for e in events if e["kind"] == "alert" and e.get("what") == "eager_check"]
    assert {e["step"] for e in checks} == {3} and len(checks) == 2
    assert {e["step"] for e in events if e["kind"] == "op"} == {2, 3, 4, 5}  # still held


class Net(torch.nn.Module):
    """A model of the user's own class: ``module.compile()`` compiles its forward (torch's own
    containers are skipped by Dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x)))


class InPlaceJob:
    """A training job that holds its model (as a trainer does: no local names it)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Net()
        self.model.compile(backend="aot_eager")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self) -> float:
        loss = self.model(torch.randn(4, 8)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()


def train_in_place_compiled(traced_steps: range) -> tuple[list[float], list]:
    """Four steps of a model compiled in place (built and compiled inside the first step, as
    a script traced from its start does), traced where asked."""
    losses, sessions = [], []
    tr = None
    for i in range(4):
        if i in traced_steps and tr is None:
            tr = torchscope.trace().start()
            sessions.append(tr)
        if i == 0:
            job = InPlaceJob()
        losses.append(job.step())
        if tr is not None and i + 1 not in traced_steps:
            tr.stop()
            tr = None
    # torch's own compiled call again, not the tracer's wrapper of it
    assert type(job.model.__dict__["_compiled_call_impl"]).__name__ == "function"
    return losses, sessions


def test_a_model_compiled_in_place_is_one_op_and_never_recompiles():
    """``model.compile()`` calls straight into compiled code, with no module hook before it:
    the tracer wraps its compiled call while armed (found at arming, here as an attribute of
    the job's object, or as it is compiled),
    so the call runs with the modes off, as ``torch.compile(model)``'s does. Dynamo never
    compiles the tracer's code, the model compiles once whether tracing began before it was
    compiled or after, and ``nn.Module.compile`` is torch's own again after the session."""
    torch._dynamo.reset()
    expected, _ = train_in_place_compiled(range(0))
    original_compile = torch.nn.Module.compile
    for traced in (range(0, 2), range(2, 4)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        losses, (tr,) = train_in_place_compiled(traced)
        assert losses == expected
        assert tr.errors == []
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, traced
        calls = [o for o in tr.ops if o.name == "torch.compile:Net"]
        assert [o.step for o in calls] == [0, 1]  # one call per traced step
        assert not {o.name for o in tr.ops} & {"torch.nn.functional.linear", "torch._C._nn.linear"}
        assert torch.nn.Module.compile is original_compile
