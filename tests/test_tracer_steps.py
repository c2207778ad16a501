"""Step boundaries and step selection: untraced steps run with no mode and no hooks."""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules import module as module_mod

import torchscope
from torchscope.tracer.steps import StepSpecError


def tracing_state() -> tuple[int, int, int]:
    """(function modes on the stack, global forward hooks, global forward pre-hooks)."""
    return (
        torch._C._len_torch_function_stack(),
        len(module_mod._global_forward_hooks),
        len(module_mod._global_forward_pre_hooks),
    )


def train(n: int, *, manual: bool = False, **trace):
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    idle = tracing_state()
    states = []
    with torchscope.trace(optimizer_steps=not manual, **trace) as tr:
        for _ in range(n):
            states.append(tracing_state())
            opt.zero_grad()
            F.mse_loss(model(torch.randn(2, 8)), torch.zeros(2, 4)).backward()
            opt.step()
            if manual:
                torchscope.step()
    assert tracing_state() == idle
    return tr, states, idle


def event_steps(tr) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for e in tr.events:
        if e.kind != "session":
            out.setdefault(e.kind, set()).add(e.step)
    return out


def test_step_advances_at_optimizer_step():
    tr, states, idle = train(3)
    # step 3 began after the last update, and nothing ran in it: it left no event
    assert [e.step for e in tr.trace.steps] == [0, 1, 2]
    assert tr.step_index == 3
    assert event_steps(tr) == {
        "step": {0, 1, 2},
        "op": {0, 1, 2},
        "grad": {0, 1, 2},
        "graph": {0, 1, 2},
    }
    for step in range(3):
        ops = [o for o in tr.ops if o.step == step]
        assert ops[0].name == "torch.randn"  # each step starts with its own forward
        assert len([g for g in tr.graphs if g.step == step]) == 1
    # traced: our mode and our two module hooks are installed
    assert all(s == (idle[0] + 1, idle[1] + 1, idle[2] + 1) for s in states)
    steps = [e for e in tr.events if e.kind == "step"]
    assert all(isinstance(e.t, float) for e in steps)


@pytest.mark.parametrize(
    ("spec", "traced"),
    [
        ("2-3", {2, 3}),
        ("every:2", {0, 2, 4}),
        (4, {4}),
        ("1,3-", {1, 3, 4, 5}),
        ("all", set(range(6))),
    ],
)
def test_step_selection(spec, traced):
    tr, states, idle = train(6, steps=spec)
    kinds = event_steps(tr)
    assert kinds["op"] == kinds["grad"] == kinds["graph"] == traced
    assert kinds["step"] - {6} == traced  # step 6 begins (and may be traced) at the last step()
    for step, state in enumerate(states):
        if step in traced:
            assert state == (idle[0] + 1, idle[1] + 1, idle[2] + 1), step
        else:
            # untraced steps: nothing on the function mode stack, no global module hooks
            assert state == idle, step
    assert tr.trace.session.steps == str(spec)


def test_manual_steps():
    tr, states, idle = train(4, manual=True, steps="1-2")
    assert event_steps(tr)["op"] == {1, 2}
    assert tr.step_index == 4
    assert [s[0] for s in states] == [idle[0], idle[0] + 1, idle[0] + 1, idle[0]]
    # without torchscope.step(), optimizer steps do not count when optimizer_steps=False
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torchscope.trace(optimizer_steps=False) as tr3:
        for _ in range(3):
            model(torch.randn(1, 8)).sum().backward()
            opt.step()
    assert tr3.step_index == 0 and event_steps(tr3)["op"] == {0}


def test_step_outside_a_trace_is_a_no_op():
    torchscope.step()
    assert torch._C._len_torch_function_stack() == 0


def test_bad_specs():
    for bad in ("x", "3-1", "every:0", "-2", "every:x"):
        with pytest.raises(StepSpecError):
            torchscope.trace(steps=bad)
    assert issubclass(StepSpecError, ValueError)


def test_nested_trace_collects_what_the_outer_one_emits_meanwhile():
    with torchscope.trace() as outer:
        torch.ones(1) + 1
        with torchscope.trace() as inner:
            torch.zeros(2) * 3
        assert torch._C._len_torch_function_stack() == 1  # the outer one still traces
        torch.ones(1) - 1
    assert [o.name for o in outer.ops] == [
        "torch.ones",
        "Tensor.add",
        "torch.zeros",
        "Tensor.mul",
        "torch.ones",
        "Tensor.sub",
    ]
    assert [o.name for o in inner.ops] == ["torch.zeros", "Tensor.mul"]
    with torchscope.trace() as again:  # a new one starts once the first stopped
        torch.ones(1) + 1
    assert [o.name for o in again.ops] == ["torch.ones", "Tensor.add"]


def test_a_nested_trace_keeps_its_own_steps_and_another_threads_gets_nothing(capsys):
    """A nested trace(steps=...) collects those of its steps only (it took every step the
    outer run traced); one started on another thread collects nothing and says so (it took
    the traced thread's events as its own)."""
    import threading

    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(n: int) -> None:
        for _ in range(n):
            model(torch.randn(1, 8)).sum().backward()
            opt.step()

    with torchscope.trace() as outer:
        train(1)
        with torchscope.trace(steps="1") as inner:
            train(3)
        got: list = []
        worker = threading.Thread(
            target=lambda: got.append(_traced(lambda: torch.ones(2) * 2)), name="worker"
        )
        worker.start()
        worker.join(60)
    assert sorted({o.step for o in outer.ops}) == [0, 1, 2, 3]
    assert sorted({o.step for o in inner.ops}) == [2]  # its step 1: the outer run's 2
    assert got == [[]]
    assert "trace() on thread 'worker' is not traced: 'MainThread' is" in capsys.readouterr().err


def _traced(body) -> list:
    with torchscope.trace() as tr:
        body()
    return tr.ops


def test_untraced_first_step_then_traced_backward_only_hooks_in_traced_steps():
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torchscope.trace(steps="1") as tr:
        for _ in range(3):
            loss = model(torch.randn(1, 8)).sum()
            loss.backward()
            opt.step()
    assert [g.step for g in tr.graphs] == [1]
    acc = [g.param for g in tr.grads if g.node == "AccumulateGrad"]
    assert sorted(acc) == sorted(n for n, _ in model.named_parameters())


def test_keep_newest_n():
    with torchscope.trace(keep=5) as tr:
        for i in range(20):
            torch.full((2,), float(i)) * 2
    assert len(tr.events) == 5
    assert [o.outputs[0]["values"] for o in tr.ops][-1] == [38.0, 38.0]
    with torchscope.trace(keep=False) as tr:
        torch.ones(3) * 2
    assert tr.events == [] and tr.ops == []


class RecordingSGD(torch.optim.SGD):
    """SGD that notes how many torch-function modes are on the stack while it steps, and can
    be told to fail."""

    def __init__(self, params, fail_at: set[int] = frozenset()):
        super().__init__(params, lr=0.01)
        self.modes_seen: list[int] = []
        self.calls = 0
        self.fail_at = fail_at

    def step(self, closure=None):
        self.calls += 1
        self.modes_seen.append(torch._C._len_torch_function_stack())
        if self.calls in self.fail_at:
            raise RuntimeError("update failed")
        return super().step(closure)


def one_step(model, opt) -> None:
    opt.zero_grad()
    F.mse_loss(model(torch.randn(2, 8)), torch.zeros(2, 4)).backward()
    opt.step()


def test_optimizer_step_runs_outside_the_mode():
    """The update's calls do not even reach the tracer's mode (as untraced), and tracing
    resumes for the next step. A subclass whose step() calls super().step() runs the global
    hooks twice, nested: still one step."""
    model = models.mlp()
    opt = RecordingSGD(model.parameters())
    with torchscope.trace() as tr:
        for _ in range(3):
            one_step(model, opt)
    assert opt.modes_seen == [0, 0, 0]
    assert {o.step for o in tr.ops} == {0, 1, 2}
    assert not any(o.name == "Tensor.add_" for o in tr.ops)  # SGD's update is not traced
    assert torch._C._len_torch_function_stack() == 0


def test_a_failing_optimizer_step_does_not_end_tracing():
    """Post-hooks do not run when a step raises; the next module call puts the mode back."""
    model = models.mlp()
    opt = RecordingSGD(model.parameters(), fail_at={2})
    with torchscope.trace() as tr:
        one_step(model, opt)
        with pytest.raises(RuntimeError, match="update failed"):
            one_step(model, opt)
        one_step(model, opt)
        one_step(model, opt)
    assert torch._C._len_torch_function_stack() == 0
    assert module_mod._global_forward_pre_hooks == {}
    # The failed step did not advance the index; the ops after it are traced all the same.
    layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    forward_ops = [o for o in tr.ops if o.name == "torch.nn.functional.linear"]
    assert [o.step for o in forward_ops] == [0] * layers + [1] * (2 * layers) + [2] * layers
    assert tr.errors == []


def test_a_mode_entered_after_ours_is_left_alone_during_optimizer_step():
    from torch.overrides import TorchFunctionMode

    class Outer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = models.mlp()
    opt = RecordingSGD(model.parameters())
    with torchscope.trace() as tr:
        with Outer():
            one_step(model, opt)  # ours is not on top: it stays, switched off, for the update
        one_step(model, opt)
    assert opt.modes_seen == [2, 0]
    assert not any(o.name == "Tensor.add_" for o in tr.ops)
    assert {o.step for o in tr.ops} == {0, 1}
    assert torch._C._len_torch_function_stack() == 0


def test_a_step_closure_is_traced():
    """LBFGS runs the model's forward and backward inside step(closure): those are the
    model's ops, and they are traced (the update's own ops come along with them)."""
    torch.manual_seed(0)
    w = torch.randn(8, 4, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=3)
    x, y = torch.randn(16, 8), torch.randn(16, 4)

    def closure():  # plain tensor ops, no module
        opt.zero_grad()
        loss = (x @ w - y).pow(2).mean()
        loss.backward()
        return loss

    with torchscope.trace() as tr:
        for _ in range(2):
            opt.step(closure)
    assert tr.errors == []
    assert {o.step for o in tr.ops if o.name == "Tensor.matmul"} == {0, 1}
    assert {g.step for g in tr.grads if g.node == "MmBackward0"} == {0, 1}
    assert tr.step_index == 2


def test_a_step_in_which_nothing_is_traced_leaves_no_step_event():
    """The code after the loop's last update is no step: a recording ends with the last step
    that traced something; code there that does run ops is a step of its own."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(after_loop):
        with torchscope.trace() as tr:
            for _ in range(3):
                loss = model(torch.ones(1, 2)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
            after_loop()
        return sorted(e.step for e in tr.events if e.kind == "step")

    assert train(lambda: None) == [0, 1, 2]
    assert train(lambda: model(torch.ones(1, 2))) == [0, 1, 2, 3]  # an evaluation after it
