"""Autograd corners: custom Functions, in-place ops and views, multi-output ops, no_grad,
checkpointing, retain_graph, create_graph, and autograd.grad with unrequested inputs."""

from __future__ import annotations

import pytest
import torch
from models import values
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

import torchscope
from torchscope.tracer.armed.backward import NODE_ID


def grad_values(events, node: str, backward: int | None = None):
    """[(grad_inputs values, grad_outputs values)] of every event of ``node``."""
    return [
        ([values(s) for s in g.grad_inputs], [values(s) for s in g.grad_outputs])
        for g in events
        if g.node == node and (backward is None or g.backward == backward)
    ]


def leaf_node(t: torch.Tensor):
    """The AccumulateGrad node of a leaf; holding it keeps the tracer's id on it."""
    return get_gradient_edge(t).node


def arriving_at(tr, graph, node, shape=()) -> torch.Tensor:
    """Sum of the grads that nodes of ``graph`` sent along their edges into ``node``."""
    target = node.metadata[NODE_ID]
    grads = {g.node_id: g for g in tr.grads if g.backward == graph.backward}
    total = torch.zeros(shape)
    for n in graph.nodes:
        for i, edge in enumerate(n["next"]):
            if edge is not None and edge[0] == target:
                total += torch.tensor(values(grads[n["id"]].grad_inputs[i])).view(shape)
    return total


# -- the seed example ------------------------------------------------------------------------
def test_autograd_grad_with_unrequested_input():
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(2.0, requires_grad=True)
    with torchscope.trace() as tr:
        out = x * y + x / y
        (gx,) = torch.autograd.grad(out, x, grad_outputs=torch.ones_like(out))
    assert gx.item() == 2.5
    assert grad_values(tr.grads, "AddBackward0") == [([[1.0], [1.0]], [[1.0]])]
    assert grad_values(tr.grads, "DivBackward0") == [([[0.5], None], [[1.0]])]
    assert grad_values(tr.grads, "MulBackward0") == [([[2.0], None], [[1.0]])]
    assert tr.grads_of("AccumulateGrad") == []  # autograd.grad never accumulates
    assert x.grad is None and y.grad is None

    (graph,) = tr.graphs
    assert graph.call == "torch.autograd.grad"
    executed = {n["name"]: n["executed"] for n in graph.nodes}
    assert executed == {
        "AddBackward0": True,
        "MulBackward0": True,
        "DivBackward0": True,
        "AccumulateGrad": False,
    }
    assert sum(n["name"] == "AccumulateGrad" for n in graph.nodes) == 2
    (add,) = [n for n in graph.nodes if n["name"] == "AddBackward0"]
    assert graph.roots == [add["id"]]
    ops = {o.seq: o.name for o in tr.ops}
    made_by = {g.node: ops[g.op_seq] for g in tr.grads}
    assert made_by == {
        "AddBackward0": "Tensor.add",
        "MulBackward0": "Tensor.mul",
        "DivBackward0": "Tensor.div",
    }


@pytest.mark.parametrize(("xv", "yv"), [(2.0, 2.0), (4.0, 2.0)])
def test_backward_fills_the_unrequested_slots(xv, yv):
    x = torch.tensor(xv, requires_grad=True)
    y = torch.tensor(yv, requires_grad=True)
    xnode, ynode = leaf_node(x), leaf_node(y)
    with torchscope.trace() as tr:
        out = x * y + x / y
        out.backward()
    # d(xy) = (y, x); d(x/y) = (1/y, -x/y^2): for x=4, y=2 that is Mul (2, 4), Div (0.5, -1)
    assert grad_values(tr.grads, "MulBackward0") == [([[yv], [xv]], [[1.0]])]
    assert grad_values(tr.grads, "DivBackward0") == [([[1 / yv], [-xv / yv**2]], [[1.0]])]
    acc = {tuple(values(g.grad_outputs[0])) for g in tr.grads_of("AccumulateGrad")}
    assert acc == {(x.grad.item(),), (y.grad.item(),)}
    assert x.grad.item() == yv + 1 / yv and y.grad.item() == xv - xv / yv**2
    (graph,) = tr.graphs
    assert all(n["executed"] for n in graph.nodes)
    assert arriving_at(tr, graph, xnode).item() == x.grad.item()
    assert arriving_at(tr, graph, ynode).item() == y.grad.item()


# -- custom autograd.Function ----------------------------------------------------------------
class Scale(torch.autograd.Function):
    """Forward multiplies by 3; backward deliberately sends 5 * grad (not the true derivative),
    so the recorded grads can only be right if they are what the Function returned."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 5


def test_custom_function_node():
    x = torch.arange(4.0, requires_grad=True)
    with torchscope.trace() as tr:
        y = Scale.apply(x)
        (y * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    ((gi, go),) = grad_values(tr.grads, "ScaleBackward")
    assert go == [[1.0, 2.0, 3.0, 4.0]]
    assert gi == [[5.0, 10.0, 15.0, 20.0]]
    assert x.grad.tolist() == gi[0]
    (graph,) = tr.graphs
    assert any(n["name"] == "ScaleBackward" and n["executed"] for n in graph.nodes)
    assert tr.errors == []


# -- in-place ops and views ------------------------------------------------------------------
def test_inplace_and_views_pre_and_post_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    with torchscope.trace() as tr:
        a = x * 2
        a.add_(1)
        b = a.clone()
        b[0] = 10.0
        c = b.clone()
        c.view(2, 2)[1].mul_(3)
        loss = (c * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum()
        loss.backward()
    ops = tr.ops
    mul, add_, _, setitem, _, view, _, mul_ = ops[:8]
    assert (mul.name, add_.name, setitem.name, mul_.name) == (
        "Tensor.mul",
        "Tensor.add_",
        "Tensor.__setitem__",
        "Tensor.mul_",
    )
    # every op shows the values at its own time, not what later in-place ops made of them
    assert values(mul.outputs[0]) == [2.0, 4.0, 6.0, 8.0]
    assert values(add_.inputs[0]) == [2.0, 4.0, 6.0, 8.0]
    assert values(add_.outputs[0]) == [3.0, 5.0, 7.0, 9.0]
    assert add_.grad_fn == "AddBackward0" and [n["name"] for n in add_.nodes] == ["AddBackward0"]
    assert values(setitem.inputs[0]) == [3.0, 5.0, 7.0, 9.0]
    assert values(setitem.outputs[0]) == [10.0, 5.0, 7.0, 9.0]
    assert setitem.grad_fn == "CopySlices"
    assert "CopySlices" in [n["name"] for n in setitem.nodes]
    assert values(view.outputs[0]) == [10.0, 5.0, 7.0, 9.0]
    assert values(mul_.inputs[0]) == [7.0, 9.0]
    assert values(mul_.outputs[0]) == [21.0, 27.0]
    # view + in-place: the base is rebased onto CopySlices, made by this very op
    assert "CopySlices" in [n["name"] for n in mul_.nodes]
    # backward: grads through the rebased graph are autograd's
    assert x.grad.tolist() == [0.0, 4.0, 18.0, 24.0]
    (acc,) = tr.grads_of("AccumulateGrad")
    assert values(acc.grad_outputs[0]) == x.grad.tolist()
    copies = tr.grads_of("CopySlices")
    assert len(copies) == 2
    ops_by_seq = {o.seq: o.name for o in ops}
    assert sorted(ops_by_seq[g.op_seq] for g in copies) == ["Tensor.__setitem__", "Tensor.mul_"]
    (add_grad,) = tr.grads_of("AddBackward0")
    assert values(add_grad.grad_inputs[0]) == [0.0, 2.0, 9.0, 12.0]


# -- multi-output ops ------------------------------------------------------------------------
def test_multi_output_ops():
    x = torch.arange(6.0, requires_grad=True)
    with torchscope.trace() as tr:
        a, _, _ = torch.split(x * 1, 2)
        u = torch.unbind(x.view(2, 3))
        m, _ = torch.max(x.view(2, 3), dim=1)
        loss = a.sum() + u[1].sum() * 2 + m.sum() * 3
        loss.backward()
    by_name = {o.name: o for o in tr.ops}
    split = by_name["torch.functional.split"]
    assert [values(s) for s in split.outputs] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert [n["name"] for n in split.nodes] == ["SplitBackward0"]
    assert len(by_name["torch.unbind"].outputs) == 2
    mx = by_name["torch.max"]
    assert values(mx.outputs[0]) == [2.0, 5.0]
    assert mx.outputs[1]["dtype"] == "int64" and values(mx.outputs[1]) == [2, 2]
    assert all(type(v) is int for v in values(mx.outputs[1]))
    # outputs nobody used send no gradient: None slots in grad_outputs
    ((gi, go),) = grad_values(tr.grads, "SplitBackward0")
    assert go == [[1.0, 1.0], None, None]
    assert gi == [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    ((gi, go),) = grad_values(tr.grads, "UnbindBackward0")
    assert go == [None, [2.0, 2.0, 2.0]]
    ((gi, go),) = grad_values(tr.grads, "MaxBackward0")
    assert go == [[3.0, 3.0]] and gi == [[0.0, 0.0, 3.0, 0.0, 0.0, 3.0]]
    (acc,) = tr.grads_of("AccumulateGrad")
    assert values(acc.grad_outputs[0]) == x.grad.tolist() == [1.0, 1.0, 3.0, 2.0, 2.0, 5.0]


# -- no_grad ---------------------------------------------------------------------------------
def test_no_grad_ops_recorded_without_nodes():
    w = torch.randn(3, requires_grad=True)
    with torchscope.trace() as tr:
        with torch.no_grad():
            a = w * 2
            a.add_(1)
        b = (w * a).sum()
        b.backward()
    no_grad_ops = tr.ops[:2]
    assert [o.name for o in no_grad_ops] == ["Tensor.mul", "Tensor.add_"]
    for o in no_grad_ops:
        assert o.nodes == [] and o.grad_fn is None
        assert o.outputs[0]["stats"]["norm"] > 0
    assert {g.node for g in tr.grads} == {"SumBackward0", "MulBackward0", "AccumulateGrad"}
    assert torch.allclose(w.grad, a)


# -- checkpointing ---------------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint(reentrant):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)

    def f(a):
        return torch.relu(lin(a)) * 2

    a = torch.randn(2, 3, requires_grad=True)
    ref_a = a.detach().clone().requires_grad_()
    f(ref_a).sum().backward()
    ref = {n: p.grad.clone() for n, p in lin.named_parameters()}
    lin.zero_grad()

    with torchscope.trace() as tr:
        checkpoint(f, a, use_reentrant=reentrant).sum().backward()
    assert tr.errors == []
    assert torch.equal(a.grad, ref_a.grad)
    for n, p in lin.named_parameters():
        assert torch.equal(p.grad, ref[n])
    nodes = {g.node for g in tr.grads}
    forward = [o.name for o in tr.ops]
    assert forward[:3] == ["torch.nn.functional.linear", "torch.relu", "Tensor.mul"]
    if reentrant:
        assert "CheckpointFunctionBackward" in nodes
        (ckpt,) = tr.grads_of("CheckpointFunctionBackward")
        gi = ckpt.grad_inputs
        assert values(gi[0]) == pytest.approx(ref_a.grad.flatten().tolist())
    else:
        # the original nodes stay in the graph: their hooks fire with real grads
        assert {"AddmmBackward0", "ReluBackward0", "MulBackward0"} <= nodes
        (a_acc,) = [
            g for g in tr.grads_of("AccumulateGrad") if g.grad_outputs[0]["shape"] == [2, 3]
        ]
        assert values(a_acc.grad_outputs[0]) == pytest.approx(ref_a.grad.flatten().tolist())


# -- retain_graph / create_graph -------------------------------------------------------------
def test_retain_graph_two_backward_calls():
    x = torch.tensor([0.5, 1.0], requires_grad=True)
    with torchscope.trace() as tr:
        out = (x * x).sin().sum()
        out.backward(retain_graph=True)
        first = x.grad.clone()
        out.backward()
    assert [g.backward for g in tr.graphs] == [1, 2]
    assert [g.call for g in tr.graphs] == ["Tensor.backward", "Tensor.backward"]
    g1, g2 = tr.graphs
    assert [n["id"] for n in g1.nodes] == [n["id"] for n in g2.nodes]  # same nodes, same ids
    for b in (1, 2):
        (acc,) = [g for g in tr.grads_of("AccumulateGrad") if g.backward == b]
        assert values(acc.grad_outputs[0]) == pytest.approx(first.tolist())
        assert len([g for g in tr.grads if g.backward == b]) == len(g1.nodes)
    assert torch.allclose(x.grad, 2 * first)


def test_create_graph_higher_order():
    x = torch.tensor(2.0, requires_grad=True)
    xnode = leaf_node(x)
    with torchscope.trace() as tr:
        y = x**3
        (g1,) = torch.autograd.grad(y, x, create_graph=True)
        (g2,) = torch.autograd.grad(g1, x)
        (g1b,) = torch.autograd.grad(x**3, x, create_graph=True)
        g1b.backward()
    assert g1.item() == 12.0 and g2.item() == 12.0 and x.grad.item() == 12.0
    assert tr.errors == []
    assert [g.backward for g in tr.graphs] == [1, 2, 3, 4]
    assert grad_values(tr.grads, "PowBackward0", backward=1) == [([[12.0]], [[1.0]])]
    # the second call runs on the graph the first one built: it reaches x with 6x = 12
    assert arriving_at(tr, tr.graphs[1], xnode).item() == 12.0
    assert arriving_at(tr, tr.graphs[3], xnode).item() == 12.0
    assert not any(n["executed"] for n in tr.graphs[1].nodes if n["name"] == "AccumulateGrad")
    (acc,) = [g for g in tr.grads_of("AccumulateGrad") if g.backward == 4]
    assert values(acc.grad_outputs[0]) == [12.0]


def test_gradient_penalty_style_double_backward():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3, requires_grad=True)

    def penalty():
        (g,) = torch.autograd.grad(lin(x).sum(), x, create_graph=True)
        return (g.norm(dim=1) - 1).pow(2).mean()

    penalty().backward()
    ref = lin.weight.grad.clone()
    lin.zero_grad()
    x.grad = None
    with torchscope.trace() as tr:
        penalty().backward()
    assert torch.equal(lin.weight.grad, ref)
    (acc,) = [g for g in tr.grads_of("AccumulateGrad") if g.param == "weight"]
    assert acc.backward == 2
    assert values(acc.grad_outputs[0]) == pytest.approx(ref.flatten().tolist())


def test_user_hooks_still_run_and_see_the_same_grads():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    seen = []
    with torchscope.trace() as tr:
        y = x * 3
        y.register_hook(lambda g: seen.append(g.clone()))
        y.retain_grad()
        (y * y).sum().backward()
    assert seen and torch.equal(seen[0], y.grad)
    (mul3,) = [g for g in tr.grads_of("MulBackward0") if g.op_seq == tr.ops[0].seq]
    assert values(mul3.grad_outputs[0]) == y.grad.tolist()


def test_graph_from_an_earlier_trace():
    """Node ids live on the nodes: a graph built under one trace and run backward under the
    next must neither collide with the new run's ids (dropping nodes) nor link to its ops."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with torchscope.trace() as first:
        a = (x * 2).sin()
    with torchscope.trace() as second:
        b = (x + 1).exp()
        (a.sum() + b.sum()).backward()
    (graph,) = second.graphs
    names = sorted(n["name"] for n in graph.nodes)
    assert names == sorted(
        [
            "AddBackward0",
            "SumBackward0",
            "SumBackward0",
            "ExpBackward0",
            "AddBackward0",
            "SinBackward0",
            "MulBackward0",
            "AccumulateGrad",
        ]
    )
    assert len({n["id"] for n in graph.nodes}) == len(graph.nodes)
    ops = {o.seq: o.name for o in second.ops}
    old_sources = {o.name: o.source for o in first.ops}
    for n in graph.nodes:
        if n["name"] in ("SinBackward0", "MulBackward0"):
            assert n["op_seq"] is None  # made by the first run's ops
            assert n["source"] == old_sources["Tensor." + n["name"][:3].lower()]
        elif n["name"] != "AccumulateGrad":
            assert ops[n["op_seq"]] in ("Tensor.add", "Tensor.exp", "Tensor.sum")
    (sin,) = second.grads_of("SinBackward0")
    assert values(sin.grad_inputs[0]) == pytest.approx((2 * x).cos().tolist())
    (acc,) = second.grads_of("AccumulateGrad")
    assert values(acc.grad_outputs[0]) == x.grad.tolist()


def test_view_made_under_no_grad_then_written_in_place():
    """nn.Embedding(padding_idx=...) zeroes a row through a view made under no_grad: torch
    refuses to give that view's grad_fn. The op is still recorded, and no error is raised."""
    with torchscope.trace() as tr:
        emb = torch.nn.Embedding(10, 4, padding_idx=0)
        out = emb(torch.tensor([0, 3]))
        out.sum().backward()
    assert tr.errors == []
    fill = [o for o in tr.ops if o.name == "Tensor.fill_"]
    assert fill and fill[0].grad_fn is None and fill[0].outputs[0]["values"] == [0.0] * 4
    assert emb.weight.grad[0].abs().sum().item() == 0.0  # padding row gets no gradient
    assert any(g.node == "EmbeddingBackward0" for g in tr.grads)


@pytest.mark.parametrize("width", [2, 40])  # a few values (listed) and many (reduced)
def test_batched_autograd_grad_records_shapes_and_no_errors(width):
    """``autograd.grad(..., is_grads_batched=True)`` (jacobian(vectorize=True) too) runs the
    backward under vmap: the hooks see batched gradients, whose numbers cannot be read."""
    x = torch.randn(4, width, requires_grad=True)
    w = torch.randn(width, 3, requires_grad=True)
    v = torch.eye(3)[:, None, :].expand(3, 4, 3)  # one grad_output per output column
    out = torch.tanh(x @ w)
    (plain,) = torch.autograd.grad(out, x, v, is_grads_batched=True, retain_graph=True)
    with torchscope.trace() as tr:
        (traced,) = torch.autograd.grad(tr_out := torch.tanh(x @ w), x, v, is_grads_batched=True)
        jac = torch.autograd.functional.jacobian(lambda a: torch.tanh(a @ w), x, vectorize=True)
    assert tr.errors == [] and torch.equal(plain, traced)
    assert jac.shape == (4, 3, 4, width) and tr_out.shape == (4, 3)
    (tanh,) = [g for g in tr.grads if g.node == "TanhBackward0" and g.backward == 1]
    (sent,) = tanh.grad_inputs
    assert (sent["shape"], sent["stats"], sent["stats_of"]) == ([4, 3], None, "batched")
    graph = next(g for g in tr.graphs if g.backward == 1)
    assert all(n["executed"] for n in graph.nodes if n["name"] == "TanhBackward0")
