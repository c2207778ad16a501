"""NaN/Inf origin alerts: the op (or node) where the bad value first appears, with its line."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import torchscope


def line_of(func, needle: str) -> str:
    """``path:line`` of the line of ``func`` containing ``needle``."""
    lines, first = inspect.getsourcelines(func)
    (i,) = [i for i, s in enumerate(lines) if needle in s]
    return f"{inspect.getsourcefile(func)}:{first + i}"


class NegLog(nn.Module):
    def forward(self, x):
        shifted = x - 100.0
        return torch.log(shifted) * 2.0  # NaN: log of a negative number


class DivZero(nn.Module):
    def forward(self, x):
        y = x.abs() + 1.0
        return y / torch.zeros_like(y)  # Inf


def model_with(bad: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), bad, nn.Linear(4, 2))


def train(model: nn.Module, steps: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchscope.trace() as tr:
        for _ in range(steps):
            opt.zero_grad()
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            opt.step()
    return tr


@pytest.mark.parametrize(
    ("bad", "needle", "what", "op"),
    [
        (NegLog(), "torch.log(shifted)", "nan", "torch.log"),
        (DivZero(), "y / torch.zeros_like(y)", "inf", "Tensor.div"),
    ],
)
def test_forward_origin_names_the_op_and_line(bad, needle, what, op):
    tr = train(model_with(bad), steps=3)
    source = line_of(type(bad).forward, needle)
    forward = [a for a in tr.alerts if a.where == "forward"]
    assert len(forward) == 1, forward
    (alert,) = forward
    assert (alert.what, alert.name, alert.module, alert.step) == (what, op, "1", 0)
    assert alert.source == source
    origin = next(o for o in tr.ops if o.seq == alert.event_seq)
    assert origin.name == op and origin.source == source
    assert source in alert.message
    # everything downstream is non-finite too, but none of it is blamed
    later = [o for o in tr.ops if o.seq > origin.seq and o.step == 0 and o.module == "2"]
    assert later and all(o.outputs[0]["stats"]["nan"] + o.outputs[0]["stats"]["inf"] for o in later)
    # the backward NaN/Inf comes from the forward one (saved values): not a new origin, and
    # the NaN weights of later steps raise nothing new either
    assert [a for a in tr.alerts if a.where == "backward"] == []
    assert tr.errors == []


def test_backward_only_origin_names_the_node():
    def f(x):
        return torch.sqrt(x) * 3.0

    x = torch.tensor([0.0, 4.0], requires_grad=True)
    with torchscope.trace() as tr:
        y = f(x)
        y.sum().backward()
    assert torch.isinf(x.grad[0])
    (alert,) = tr.alerts
    assert (alert.what, alert.where, alert.name) == ("inf", "backward", "SqrtBackward0")
    assert alert.source == line_of(f, "torch.sqrt")
    grad = next(g for g in tr.grads if g.seq == alert.event_seq)
    assert grad.node == "SqrtBackward0" and alert.node_id == grad.node_id
    assert grad.grad_inputs[0]["stats"]["inf"] == 1
    assert all(o.outputs[0]["stats"]["inf"] == 0 for o in tr.ops)


def test_no_alerts_for_finite_training():
    tr = train(model_with(nn.ReLU()), steps=2)
    assert tr.alerts == []


def test_nan_in_backward_of_a_finite_forward():
    """0 * inf-derivative: a NaN born in backward from finite values."""

    def f(x):
        return torch.sqrt(x) * 0.0

    x = torch.tensor([0.0, 1.0], requires_grad=True)
    with torchscope.trace() as tr:
        f(x).sum().backward()
    (alert,) = tr.alerts
    assert (alert.what, alert.where, alert.name) == ("nan", "backward", "SqrtBackward0")
    assert alert.source == line_of(f, "torch.sqrt")
