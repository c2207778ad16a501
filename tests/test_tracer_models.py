"""Real nn.Module models: module paths on ops, parameter names on AccumulateGrad, and every
recorded gradient checked against autograd's own numbers."""

from __future__ import annotations

import inspect

import models
import pytest
import torch
import torch.nn.functional as F
from models import OutputCapture, node_id_of, norm

import torchscope


def train(model, batches, loss_fn, capture_step: int | None = None, lr: float = 0.05):
    """Train under the tracer; returns the tracer, per-step {param: grad} copies and the capture."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads: list[dict[str, torch.Tensor]] = []
    capture = OutputCapture()
    with torchscope.trace() as tr:
        for step, batch in enumerate(batches):
            opt.zero_grad()
            if step == capture_step:
                with capture:
                    loss = loss_fn(model, *batch)
                    loss.backward()
            else:
                loss = loss_fn(model, *batch)
                loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
    assert tr.errors == []
    return tr, grads, capture


def check_param_grads(tr, model, grads) -> None:
    """One AccumulateGrad event per parameter per step, named as named_parameters() names it,
    carrying exactly the gradient autograd accumulated into ``.grad``."""
    names = [n for n, _ in model.named_parameters()]
    for step, step_grads in enumerate(grads):
        acc = [g for g in tr.grads if g.step == step and g.node == "AccumulateGrad"]
        assert sorted(g.param for g in acc) == sorted(names)
        for g in acc:
            (incoming,) = g.grad_outputs
            want = step_grads[g.param]
            assert incoming["shape"] == list(want.shape)
            assert norm(incoming) == pytest.approx(want.norm().item(), rel=1e-5, abs=1e-7)
            assert incoming["stats"]["mean"] == pytest.approx(want.mean().item(), abs=1e-6)
            assert g.grad_inputs == []


def check_op_grads(tr, capture, step: int) -> int:
    """For every op whose output autograd kept a grad for: the grad event of the node that op
    created receives exactly that grad. Returns how many ops were checked."""
    # the step's first ops are the captured forward (then come the test's clones, the optimizer)
    ops = [o for o in tr.ops if o.step == step][: len(capture.calls)]
    assert [o.name for o in ops] == [name for name, _ in capture.calls]
    by_node = {g.node_id: g for g in tr.grads if g.step == step}
    checked = 0
    for op, (_, outs) in zip(ops, capture.calls, strict=True):
        if len(outs) != 1 or not op.nodes or outs[0].grad is None:
            continue
        t = outs[0]
        if node_id_of(t) != op.nodes[0]["id"]:
            continue  # a later in-place op moved the tensor onto another node
        assert op.grad_fn == op.nodes[0]["name"] == t.grad_fn.name().rsplit("::", 1)[-1]
        g = by_node[op.nodes[0]["id"]]
        assert g.op_seq == op.seq
        assert g.source == op.source
        got = g.grad_outputs[0]
        assert got["shape"] == list(t.grad.shape)
        assert norm(got) == pytest.approx(t.grad.norm().item(), rel=1e-5, abs=1e-8)
        assert got["stats"]["max"] == pytest.approx(t.grad.max().item(), rel=1e-5, abs=1e-8)
        checked += 1
    return checked


def check_modules(tr, model) -> None:
    known = {name for name, _ in model.named_modules()}
    assert {o.module for o in tr.ops} <= known


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def xent(model, x, y):
    return F.cross_entropy(model(x), y)


def test_mlp_module_paths_param_names_and_grads():
    model = models.mlp()
    torch.manual_seed(1)
    batches = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)]
    tr, grads, capture = train(model, batches, mse, capture_step=1)

    check_modules(tr, model)
    check_param_grads(tr, model, grads)
    assert check_op_grads(tr, capture, step=1) >= 6

    step0 = [o for o in tr.ops if o.step == 0]
    forward = [(o.name, o.module) for o in step0 if o.module]
    assert forward == [
        ("torch.nn.functional.linear", "0"),
        ("torch.nn.functional.relu", "1"),
        ("torch.nn.functional.linear", "2"),
        ("torch.tanh", "3"),
        ("torch.nn.functional.linear", "4"),
    ]
    loss_op = next(o for o in step0 if o.name == "torch.nn.functional.mse_loss")
    assert loss_op.module == ""
    # the op's own summary is the real value
    assert loss_op.outputs[0]["shape"] == []
    assert [s.step for s in tr.trace.steps] == [0, 1, 2]  # none for the code after the last update
    assert [g.backward for g in tr.graphs] == [1, 1, 1]


def test_mlp_linear_nodes_and_graph_links():
    model = models.mlp()
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    with torchscope.trace() as tr:
        mse(model, x, y).backward()
    linear = next(o for o in tr.ops if o.name == "torch.nn.functional.linear")
    # F.linear on a 2-d input makes one AddmmBackward0 and one TBackward0 for the weight
    assert sorted(n["name"] for n in linear.nodes) == ["AddmmBackward0", "TBackward0"]
    (graph,) = tr.graphs
    ops = {o.seq: o for o in tr.ops}
    ids = {n["id"] for n in graph.nodes}
    assert graph.call == "Tensor.backward"
    assert all(n["executed"] for n in graph.nodes)
    for n in graph.nodes:
        for edge in n["next"]:
            assert edge is None or edge[0] in ids
        if n["name"] == "AccumulateGrad":
            assert n["param"] in dict(model.named_parameters())
            assert n["op_seq"] is None
        else:
            assert n["op_seq"] in ops
            assert n["id"] in {m["id"] for m in ops[n["op_seq"]].nodes}
    assert {g.node_id for g in tr.grads} == ids


def test_convnet_batchnorm_pool():
    model = models.convnet()
    torch.manual_seed(2)
    batches = [(torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))) for _ in range(2)]
    tr, grads, capture = train(model, batches, xent, capture_step=0)
    check_modules(tr, model)
    check_param_grads(tr, model, grads)
    assert check_op_grads(tr, capture, step=0) >= 8
    step1 = [(o.name, o.module) for o in tr.ops if o.step == 1 and o.module]
    mods = list(dict.fromkeys(m for _, m in step1))
    assert mods == [f"features.{i}" for i in range(8)] + ["head"]
    assert step1[:5] == [
        ("torch.nn.functional.conv2d", "features.0"),
        ("Tensor.add_", "features.1"),  # BatchNorm counting num_batches_tracked
        ("torch.nn.functional.batch_norm", "features.1"),
        ("torch.nn.functional.relu", "features.2"),
        ("torch.nn.functional.max_pool2d", "features.3"),
    ]
    assert step1[-1] == ("torch.nn.functional.linear", "head")
    # flatten is called in ConvNet.forward itself: the root module, path ""
    assert any(o.name == "torch.flatten" and o.module == "" for o in tr.ops)
    nodes = {g.node for g in tr.grads}
    assert {"ConvolutionBackward0", "NativeBatchNormBackward0", "ReluBackward0"} <= nodes
    assert any(n.startswith("MaxPool2DWithIndicesBackward") for n in nodes)


def test_transformer_paths_sources_tied_weights_and_grads():
    model = models.transformer()
    batches = [models.lm_batch(seed) for seed in range(2)]
    tr, grads, capture = train(model, batches, models.lm_loss, capture_step=1)
    check_modules(tr, model)
    check_param_grads(tr, model, grads)
    assert check_op_grads(tr, capture, step=1) >= 40

    # tied head/embedding weight: one parameter, one AccumulateGrad, its first name
    acc = [g.param for g in tr.grads if g.step == 0 and g.node == "AccumulateGrad"]
    assert acc.count("tok.weight") == 1 and "head.weight" not in acc

    step0 = [o for o in tr.ops if o.step == 0]
    by_module: dict[str, set[str]] = {}
    for o in step0:
        by_module.setdefault(o.module, set()).add(o.name)
    for i in range(2):
        assert by_module[f"blocks.{i}.ln1"] == {"torch.nn.functional.layer_norm"}
        assert by_module[f"blocks.{i}.attn.qkv"] == {"torch.nn.functional.linear"}
        assert "torch.softmax" in by_module[f"blocks.{i}.attn"]
        assert "Tensor.matmul" in by_module[f"blocks.{i}.attn"]
        assert "torch.nn.functional.gelu" in by_module[f"blocks.{i}.mlp"]
        assert "Tensor.add" in by_module[f"blocks.{i}"]  # the residual adds
    assert by_module["tok"] == {"torch.nn.functional.embedding"}
    assert by_module["head"] == {"torch.nn.functional.linear"}

    # ops inside a user module's forward point at the user's line in that forward
    lines, first = inspect.getsourcelines(models.Attention.forward)
    softmax_line = first + next(i for i, s in enumerate(lines) if "torch.softmax" in s)
    softmax = [o for o in step0 if o.name == "torch.softmax"]
    assert len(softmax) == 2
    for o in softmax:
        assert o.source == f"{models.__file__}:{softmax_line}"
        assert o.function == "forward"
        assert o.grad_fn == "SoftmaxBackward0"
    # multi-output split: one op, three outputs, one node
    split = next(o for o in step0 if o.name == "Tensor.split")
    assert len(split.outputs) == 3 and [n["name"] for n in split.nodes] == ["SplitBackward0"]
    assert all(o.thread == "MainThread" for o in tr.ops)
    assert all(o.duration_us >= 0 for o in tr.ops)


def test_names_stay_relative_to_the_outer_model_when_a_submodule_runs_first():
    """A submodule called on its own before its model (an embedding, an encoder) must not pin
    names relative to itself: once the model runs, names are the model's."""
    model = models.mlp()
    with torchscope.trace() as tr:
        out = model[0](torch.randn(2, 8)).sum() + model(torch.randn(2, 8)).sum()
        out.backward()
    acc = {g.param for g in tr.grads if g.node == "AccumulateGrad"}
    assert acc == {n for n, _ in model.named_parameters()}
    linear = [o.module for o in tr.ops if o.name == "torch.nn.functional.linear"]
    assert linear == ["", "0", "2", "4"]  # model[0] was a root of its own when it first ran


def test_foreach_optimizer_ops_are_named_as_torch_functions():
    model = models.mlp()
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with torchscope.trace(optimizer_ops=True) as tr:
        opt.step()
    names = {o.name for o in tr.ops}
    assert {"torch._foreach_add_", "torch._foreach_addcdiv_"} <= names
    assert not any(n.startswith("_VariableFunctionsClass") for n in names)
    # an in-place foreach op lists every tensor it changed, with its new value
    addcdiv = next(o for o in tr.ops if o.name == "torch._foreach_addcdiv_")
    params = list(model.parameters())
    assert len(addcdiv.outputs) == len(params)
    for s, p, b in zip(addcdiv.outputs, params, before, strict=True):
        assert s["shape"] == list(p.shape)
        assert s["stats"]["norm"] == pytest.approx(p.norm().item(), rel=1e-6)
        assert s["stats"]["norm"] != pytest.approx(b.norm().item(), rel=1e-9)


def test_two_models_never_share_a_name_and_a_parameter_used_before_any_call_is_named():
    class Generator(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.main = torch.nn.Sequential(torch.nn.Linear(4, 4))

        def forward(self, x):
            return self.main(x)

    class Discriminator(Generator):
        def init_hidden(self):
            return next(self.parameters()).new_zeros(2, 4)  # before any module call

    net_g, net_d = Generator(), Discriminator()
    with torchscope.trace() as tr:
        h = net_d.init_hidden()
        fake = net_g(torch.randn(2, 4))
        net_d(fake + h).sum().backward()
    params = {g.param for g in tr.grads if g.node == "AccumulateGrad"}
    assert params == {
        "main.0.weight",
        "main.0.bias",
        "Discriminator:main.0.weight",
        "Discriminator:main.0.bias",
    } or params == {
        "Generator:main.0.weight",
        "Generator:main.0.bias",
        "main.0.weight",
        "main.0.bias",
    }
    (first,) = [o for o in tr.ops if o.name == "Tensor.new_zeros"]
    assert first.inputs[0]["param"].endswith("main.0.weight")
    modules = {o.module for o in tr.ops if o.name == "torch.nn.functional.linear"}
    assert len(modules) == 2  # the two Linear layers are told apart


def test_alerts_are_written_in_seq_order(tmp_path):
    path = tmp_path / "t.tsc"
    x = torch.full((3,), -1.0, requires_grad=True)
    with torchscope.trace(record=path):
        for _ in range(3):
            y = torch.sqrt(x) * 2  # NaN origin, then ops downstream
            (y.sum() + x.sum()).backward()
            torchscope.step()
    seqs = [e["seq"] for e in torchscope.load(path).events]
    assert any(e.kind == "alert" for e in torchscope.load(path).events)
    assert seqs == sorted(seqs)
