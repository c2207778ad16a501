"""The aten level's whole nodes: the backward formulas PyTorch changes while a dispatch mode is
on run without the level's mode, and are recorded whole (tracer/armed/aten_formulas.py)."""

from __future__ import annotations

import os
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchscope
from torchscope.protocol.events import ATEN
from torchscope.tracer.armed.aten_formulas import BACKWARD_NODES, VALUE_HELPERS, WHOLE_NODE


def test_the_whole_nodes_are_the_nodes_whose_formula_calls_a_value_helper():
    """Derived from the derivatives.yaml torch ships (torchgen), so a new torch that moves a
    formula fails here rather than in a job."""
    import torchgen
    from torchgen.packaged.autograd.load_derivatives import load_derivatives

    base = os.path.join(os.path.dirname(torchgen.__file__), "packaged")
    infos, _ = load_derivatives(
        f"{base}/autograd/derivatives.yaml",
        f"{base}/ATen/native/native_functions.yaml",
        f"{base}/ATen/native/tags.yaml",
    )
    helpers = re.compile(r"\b(" + "|".join(VALUE_HELPERS) + r")\b")
    subclass_like = re.compile(r"\b(isTensorSubclassLike|areAny\w*TensorSubclassLike)\b")
    derived: dict[str, str] = {}
    inline = []
    for by_key in infos.values():
        for info in by_key.values():
            for d in info.derivatives:
                found = helpers.search(d.formula)
                if found:
                    derived[info.op] = found.group(1)
                if subclass_like.search(d.formula):
                    inline.append(info.op)
    assert derived == BACKWARD_NODES
    assert inline == []  # no formula branches on it in the yaml itself


def _prod_grad() -> torch.Tensor:
    x = torch.tensor([1e-300, 1e-300, 1e300], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(x.prod(), x)
    return g


def test_a_whole_node_is_one_event_with_its_gradients_and_no_calls_under_it():
    with torchscope.trace(aten=True) as tr:
        g = _prod_grad()
    assert g.tolist() == [0.0, 0.0, 0.0]
    assert tr.errors == []
    calls = [e for e in tr.events if e.kind == ATEN]
    under = [e for e in calls if e.node == "ProdBackward0"]
    assert [(e.name, e.label) for e in under] == [("ProdBackward0", WHOLE_NODE)]
    (whole,) = under
    assert whole.node_id is not None
    assert whole.outputs[0]["shape"] == [3]
    assert whole.outputs[0]["values"] == [0.0, 0.0, 0.0]
    assert whole.inputs[0]["shape"] == []
    # the forward op's own calls are still recorded
    assert any(e.name == "aten.prod.default" for e in calls)
    # and after the node the mode is back: the next backward's calls are recorded
    with torchscope.trace(aten=True) as tr:
        _prod_grad()
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()
    names = [e.name for e in tr.events if e.kind == ATEN and e.node == "MulBackward0"]
    assert names == ["aten.mul.Tensor"]


def test_a_scoped_level_records_a_whole_node_in_its_modules_only():
    class Prod(torch.nn.Module):
        def forward(self, x):
            return x.prod()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Prod(), Prod()

        def forward(self, x):
            return self.a(x) + self.b(x)

    net = Net()
    x = torch.tensor([1e-300, 1e-300, 1e300], dtype=torch.float64, requires_grad=True)
    plain = torch.autograd.grad(net(x), x)[0]
    with torchscope.trace(aten="^a$") as tr:
        got = torch.autograd.grad(net(x), x)[0]
    assert torch.equal(plain, got)
    whole = [e for e in tr.events if e.kind == ATEN and e.get("label") == WHOLE_NODE]
    assert [e.module for e in whole] == ["a"]


class _Counting(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_under_another_mode_the_job_takes_the_subclass_branch_and_so_does_the_trace():
    with _Counting():
        plain = _prod_grad()
    assert plain.tolist() == [1.0, 1.0, 0.0]  # the job's own mode picks the other formula
    with torchscope.trace(aten=True) as tr, _Counting():
        got = _prod_grad()
    assert got.tolist() == plain.tolist()
    assert tr.errors == []
