"""Custom ``torch.autograd.Function``s as users write them: the ``apply`` call is an op with
its module and line, its backward node belongs to that op, a bad value made in the backward
is placed at the backward's own line, and under torch.func (per-sample gradients) the op is
named what the user called and the kernels say which transforms batched them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import torchscope

JOB = """\
import torch
from torch import nn


class ScaledTanh(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, scale):
        return torch.tanh(x) * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output, inputs[1])

    @staticmethod
    def backward(ctx, g):
        y, scale = ctx.saved_tensors
        slope = 1 - (y / scale) ** 2  # the backward's division
        return g * slope * scale, None


class Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return ScaledTanh.apply(x, self.scale)  # the apply call


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = Act()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.act(self.lin(x)))


if __name__ == "__main__":
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(BAD + 2):
        if step == BAD:
            with torch.no_grad():
                net.act.scale.zero_()  # the backward divides by zero from here on
        loss = net(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} {loss.item()!r}", flush=True)
"""


def line_in(text: str, needle: str) -> int:
    return next(i for i, s in enumerate(text.splitlines(), 1) if needle in s)


def load_job(tmp_path: Path, bad: int = 3):
    """The job's classes, imported from its file (sources name that file)."""
    import importlib.util

    path = tmp_path / "custom_job.py"
    path.write_text(JOB.replace("BAD", str(bad)))
    spec = importlib.util.spec_from_file_location("custom_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def train(module, steps: int, tr=None) -> list[float]:
    torch.manual_seed(0)
    net = module.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    losses = []
    if tr is not None:
        tr.start()
    try:
        for _ in range(steps):
            loss = net(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if tr is not None:
            tr.stop()
    return losses


def test_apply_is_an_op_of_its_module_and_line_and_owns_its_backward_node(tmp_path):
    module, path = load_job(tmp_path)
    plain = train(module, 3)
    tr = torchscope.trace()
    assert train(module, 3, tr) == plain  # bit-identical
    assert tr.errors == []
    # a stopped tracer records no more of it
    n = len(tr.ops)
    module.ScaledTanh.apply(torch.ones(2, requires_grad=True), torch.tensor(1.0)).sum().backward()
    assert len(tr.ops) == n
    text = path.read_text()
    applied = f"{path}:{line_in(text, '# the apply call')}"
    ops = [o for o in tr.ops if o.name == "ScaledTanh.apply"]
    assert len(ops) == 3
    op = ops[-1]
    assert (op.module, op.source, op.function) == ("act", applied, "forward")
    assert op.grad_fn == "ScaledTanhBackward" and op.inputs[0]["shape"] == [8, 4]
    assert [n["name"] for n in op.nodes] == ["ScaledTanhBackward"]
    # the ops of its forward are traced as before, just ahead of it
    step_ops = [o.name for o in tr.ops if o.step == op.step]
    i = step_ops.index("ScaledTanh.apply")
    assert step_ops[i - 2 : i] == ["torch.tanh", "Tensor.mul"]
    (node,) = [g for g in tr.grads if g.node == "ScaledTanhBackward" and g.step == op.step]
    assert (node.op_seq, node.module, node.source) == (op.seq, "act", applied)


def test_apply_is_torchs_own_again_once_no_tracer_is_left():
    code = (
        "import gc, torch, torchscope\n"
        "original = torch.autograd.Function.__dict__['apply']\n"
        "with torchscope.trace() as tr:\n"
        "    torch.ones(1)\n"
        "    wrapped = torch.autograd.Function.__dict__['apply'] is not original\n"
        "del tr\n"
        "gc.collect()\n"
        "print(wrapped, torch.autograd.Function.__dict__['apply'] is original)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=180,
    )


def test_a_division_by_zero_in_a_custom_backward_is_placed_at_its_line(tmp_path):
    _, path = load_job(tmp_path, bad=3)
    text = path.read_text()
    apply_line = line_in(text, "# the apply call")
    div_line = line_in(text, "# the backward's division")
    plain = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert plain.returncode == 0, plain.stderr

    # The watch replays the bad step at the aten level: the kernel, its node, its module and
    # the line of the backward that made the value.
    watched = run_cli("run", "--watch", "nan", str(path), cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout  # the job's numbers, untouched
    (report,) = [ln for ln in watched.stderr.splitlines() if "first appears" in ln]
    assert "at step 3 in aten.div.Tensor inside ScaledTanhBackward (backward)" in report
    assert f"custom_job.py:{div_line}" in report and "— replayed" in report

    # A recording: the apply call is an op of act, its node belongs to it, the alert names
    # the node with the op's line.
    recorded = run_cli("run", "--record", "f.tsc", "--steps", "3", str(path), cwd=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    assert recorded.stdout == plain.stdout
    dump = run_cli("dump", "f.tsc", cwd=tmp_path)
    assert dump.returncode == 0, dump.stderr
    rows = dump.stdout.splitlines()
    (op_row,) = [r for r in rows if " op " in r and "ScaledTanh.apply" in r]
    assert " act " in op_row and op_row.rstrip().endswith(f"custom_job.py:{apply_line}")
    op_seq = op_row.split()[0]
    (node_row,) = [r for r in rows if " grad " in r and "ScaledTanhBackward" in r]
    assert f"op {op_seq} " in node_row and node_row.rstrip().endswith(f":{apply_line}")
    (alert,) = [r for r in rows if "ALERT" in r and "first appears" in r]
    assert "ScaledTanhBackward (backward)" in alert and f"custom_job.py:{apply_line}" in alert


def test_per_sample_gradients_name_the_function_and_label_the_transforms(tmp_path):
    """``vmap(grad(loss))`` over ``functional_call``: the op is ``ScaledTanh.apply`` (what the
    user called), and the batched kernels, forward and backward, say ``vmap(grad)``."""
    from torch.func import functional_call, grad, vmap

    module, path = load_job(tmp_path)
    torch.manual_seed(0)
    net = module.Net()
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, x, y):
        out = functional_call(net, p, (x.unsqueeze(0),))
        return (out.squeeze(0) - y).pow(2).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    plain = per_sample(params, x, y)
    with torchscope.trace(aten=True) as tr:
        traced = per_sample(params, x, y)
    assert tr.errors == []
    assert all(torch.equal(plain[k], traced[k]) for k in plain)
    (op,) = [o for o in tr.ops if "apply" in o.name or "HigherOrderOperator" in o.name]
    applied = f"{path}:{line_in(path.read_text(), '# the apply call')}"
    assert (op.name, op.module, op.source) == ("ScaledTanh.apply", "act", applied)
    calls = [e for e in tr.events if e.kind == "aten"]
    labels = {e.get("label") for e in calls}
    assert "vmap(grad)" in labels and "grad" not in labels and "vmap" not in labels
    # the forward's kernels under the op, and the backward's batched matmul (one per sample)
    assert ("aten.tanh.default", "vmap(grad)") in {
        (e.name, e.get("label")) for e in calls if e.get("op_seq") == op.seq
    }
    (bmm,) = [e for e in calls if e.name == "aten.bmm.default" and e.module == "lin"]
    assert bmm.node == "AddmmBackward0" and bmm.get("label") == "vmap(grad)"
    assert bmm.outputs[0]["shape"] == [5, 4, 4]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def test_recomputed_calls_belong_to_the_recomputed_ops_module():
    """Gradient checkpointing re-runs each block's forward inside the first backward node that
    needs its values (the block's LayerNorm): each recomputed kernel is the module's that
    computes it, as in the forward."""
    import contextlib

    def run(ctx):
        torch.manual_seed(0)
        net = Checkpointed()
        with ctx:
            loss = net(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
        return loss.item(), [p.grad for p in net.parameters()]

    plain = run(contextlib.nullcontext())
    tr = torchscope.trace(aten=True)
    traced = run(tr)
    assert tr.errors == []
    assert traced[0] == plain[0] and all(map(torch.equal, traced[1], plain[1]))
    recomputed = [e for e in tr.events if e.kind == "aten" and e.get("label") == "recompute"]
    assert {e.node for e in recomputed} == {"NativeLayerNormBackward0"}
    where = {(e.name, e.module) for e in recomputed}
    for b in ("blocks.0", "blocks.1"):
        assert ("aten.addmm.default", f"{b}.fc") in where
        assert ("aten.relu.default", b) in where
        assert ("aten.native_layer_norm.default", f"{b}.norm") in where
    # as in the forward: the same kernels, the same modules (but checkpointing's own detaches
    # of what it keeps aside)
    forward = {(e.name, e.module) for e in tr.events if e.kind == "aten" and e.node is None}
    assert {w for w in where if w[0] != "aten.detach.default"} <= forward
