"""The aten level: every aten call under the ops and backward nodes, linked to its parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torchscope
from torchscope.protocol.events import ATEN


def aten_events(tr) -> list:
    return [e for e in tr.events if e.kind == ATEN]


def seed_example(**trace_args):
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(2.0, requires_grad=True)
    with torchscope.trace(**trace_args) as tr:
        out = x * y + x / y
        (gx,) = torch.autograd.grad(out, x)
    return tr, gx


def test_the_seed_example_at_the_aten_level_forward_and_backward():
    tr, gx = seed_example(aten=True)
    assert tr.errors == []
    ops = {e.name: e for e in tr.ops}
    calls = aten_events(tr)
    forward = [e for e in calls if e.node is None and e.op_seq is not None]
    # forward: each op's aten call, linked to it, delivered just before it
    assert [(e.name, e.op_seq) for e in forward] == [
        ("aten.mul.Tensor", ops["Tensor.mul"].seq),
        ("aten.div.Tensor", ops["Tensor.div"].seq),
        ("aten.add.Tensor", ops["Tensor.add"].seq),
    ]
    for e in forward:
        op = ops[f"Tensor.{e.name.split('.')[1]}"]
        assert e.seq < op.seq and e.source == op.source and e.source.startswith(__file__)
    # backward: div under DivBackward0; mul, then the engine's add of x's two gradients,
    # under MulBackward0
    backward = [(e.name, e.node, bool(e.get("accumulate"))) for e in calls if e.node]
    assert backward == [
        ("aten.div.Tensor", "DivBackward0", False),
        ("aten.mul.Tensor", "MulBackward0", False),
        ("aten.add.Tensor", "MulBackward0", True),
    ]
    grads = {g.node: g for g in tr.grads}
    by_name = {(e.name, e.node): e for e in calls if e.node}
    assert by_name[("aten.div.Tensor", "DivBackward0")].node_id == grads["DivBackward0"].node_id
    # the numbers are autograd's: d/dx (x/y) = 0.5, d/dx (x*y) = 2, summed by the engine 2.5
    assert by_name[("aten.div.Tensor", "DivBackward0")].outputs[0]["values"] == [0.5]
    assert by_name[("aten.mul.Tensor", "MulBackward0")].outputs[0]["values"] == [2.0]
    (acc,) = [e for e in calls if e.get("accumulate")]
    assert acc.outputs[0]["values"] == [gx.item()] == [2.5]


def test_the_aten_level_is_off_unless_asked_and_leaves_no_mode_behind():
    tr, _ = seed_example()
    assert aten_events(tr) == []
    tr, _ = seed_example(aten=True)
    assert aten_events(tr)
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0


def test_the_tracers_own_reductions_are_never_recorded():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    with torchscope.trace(aten=True) as tr:
        (x @ w).relu().sum().backward()
    names = {e.name for e in aten_events(tr)}
    assert "aten.mm.default" in names and "aten.threshold_backward.default" in names
    # summaries reduce every tensor with aminmax, sum and dot: none of them is the job's
    assert not names & {"aten.aminmax.default", "aten.dot.default"}, names


def test_a_nan_made_inside_cross_entropy_is_seen_in_its_log_softmax_call():
    logits = torch.zeros(2, 5, requires_grad=True)
    target = torch.tensor([1, 3])
    bad = logits.detach().clone()
    bad[0] = float("-inf")  # a row of -inf logits: log_softmax makes NaN there
    with torchscope.trace(aten=True) as tr:
        F.cross_entropy(bad.requires_grad_(), target)
    (ce,) = [e for e in tr.ops if e.name == "torch.nn.functional.cross_entropy"]
    under = [e for e in aten_events(tr) if e.op_seq == ce.seq and e.name != "aten.detach.default"]
    assert [e.name for e in under] == ["aten._log_softmax.default", "aten.nll_loss_forward.default"]
    log_softmax = under[0]
    assert log_softmax.outputs[0]["stats"]["nan"] == 5
    assert log_softmax.inputs[0]["stats"] is None or log_softmax.inputs[0]["stats"]["nan"] == 0


def test_a_module_regex_keeps_the_calls_inside_that_module_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with torchscope.trace(aten=r"^2$") as tr:
        # scoped: the mode is on the stack only inside module 2 and its nodes' kernels
        assert torch._C._len_torch_dispatch_stack() == 0
        model(x).sum().backward()
        assert torch._C._len_torch_dispatch_stack() == 0
    calls = aten_events(tr)
    assert calls and {e.module for e in calls} == {"2"}
    assert {e.node for e in calls if e.node} <= {"AddmmBackward0", "TBackward0", "AccumulateGrad"}
    with torchscope.trace(aten=True) as everything:
        model(x).sum().backward()
    assert {"0", "1", "2"} <= {e.module for e in aten_events(everything)}


def test_losses_are_bit_identical_with_the_aten_level_on():
    def train(ctx) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        with ctx:
            for _ in range(5):
                loss = F.mse_loss(model(torch.randn(8, 8)), torch.zeros(8, 4))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses

    import contextlib

    plain = train(contextlib.nullcontext())
    traced = train(torchscope.trace(aten=True, keep=False))
    assert traced == plain


def test_a_bad_module_regex_is_one_line():
    with pytest.raises(ValueError, match="not a regular expression"):
        torchscope.trace(aten="(")


def test_run_records_aten_calls_into_the_file(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch\nx = torch.tensor(2.0, requires_grad=True)\n(x * x).backward()\n"
    )
    out = tmp_path / "t.tsc"
    run = [sys.executable, "-m", "torchscope", "run", "--quiet", "--no-live"]
    proc = subprocess.run(
        [*run, "--aten", "--record", str(out), str(script)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    calls = [e for e in torchscope.load(out).events if e.kind == ATEN]
    assert ("aten.mul.Tensor", None) in {(e.name, e.node) for e in calls}
    assert ("aten.mul.Tensor", "MulBackward0") in {(e.name, e.node) for e in calls}
    dump = subprocess.run(
        [sys.executable, "-m", "torchscope", "dump", str(out)], capture_output=True, text=True
    )
    assert dump.returncode == 0
    lines = [line for line in dump.stdout.splitlines() if " aten " in line]
    assert any("aten.mul.Tensor" in line and "in MulBackward0" in line for line in lines)
    nested = subprocess.run(
        [sys.executable, "-m", "torchscope", "dump", "--aten", str(out)],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    op = next(i for i, line in enumerate(nested) if line.startswith("  Tensor.mul -> "))
    assert nested[op + 1].startswith("    aten.mul.Tensor -> [] float32 4")
    node = next(i for i, line in enumerate(nested) if line.startswith("  MulBackward0 (node "))
    assert nested[node + 1].startswith("    aten.mul.Tensor -> [] float32 2")  # grad * x
    assert "    + engine sum aten.add.Tensor -> [] float32 4" in nested  # x's two grads
    bad = subprocess.run([*run, "--aten=(", str(script)], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "not a regular expression" in bad.stderr


def test_a_nan_origin_is_named_down_to_the_aten_call_that_made_it():
    """Forward: a fully masked row of logits (an Inf made on purpose) turns into NaN in
    cross_entropy's log_softmax, not in its nll_loss. Without the aten level the same origin
    is named at the op."""
    logits = torch.zeros(2, 5, requires_grad=True)
    mask = torch.tensor([[True] * 5, [False] * 5])
    target = torch.tensor([1, 3])

    def run(**trace_args):
        with torchscope.trace(**trace_args) as tr:
            F.cross_entropy(logits.masked_fill(mask, float("-inf")), target)
        return tr

    tr = run(aten=True)
    (alert,) = tr.alerts
    assert alert.message.startswith(
        "NaN first appears in aten._log_softmax.default inside "
        "torch.nn.functional.cross_entropy (forward) at "
    )
    (made,) = [e for e in aten_events(tr) if e.seq == alert.aten_seq]
    assert made.name == "aten._log_softmax.default" and made.outputs[0]["stats"]["nan"] == 5
    (plain,) = run().alerts
    assert plain.message.startswith(
        "NaN first appears in torch.nn.functional.cross_entropy (forward)"
    )
    assert "aten_seq" not in plain


def test_a_nan_made_inside_a_backward_kernel_is_named_with_its_node():
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    with torchscope.trace(aten=True) as tr:
        x.sqrt().sum().backward()
    (alert,) = tr.alerts
    (node,) = [g for g in tr.grads if g.node == "SqrtBackward0"]
    assert alert.message.startswith(
        f"Inf first appears in aten.div.Tensor inside SqrtBackward0 (node {node.node_id}, "
        "created by Tensor.sqrt) (backward)"
    )
    (made,) = [e for e in aten_events(tr) if e.seq == alert.aten_seq]
    assert made.node_id == node.node_id and made.outputs[0]["stats"]["inf"] == 1


def test_a_recorder_asks_for_the_aten_level_in_the_steps_it_arms_only():
    """`record PID --next 1 --aten` on a dormant job: that step at the aten level; a later
    `record --next 1` without it arms the function level only; a bad pattern is refused."""
    from torchscope.tracer.agent import Agent, ServeOptions

    events: list = []
    agent = Agent(ServeOptions(live=False)).start()
    agent.sinks.append(events.extend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for i in range(8):
            if i == 2:
                agent._cmd_arm({"next": 1, "by": "record", "aten": r"^2$"}, b"rec-1")
            if i == 5:
                agent._cmd_arm({"next": 1, "by": "record"}, b"rec-2")
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with pytest.raises(ValueError, match="not a regular expression"):
            agent._cmd_arm({"next": 1, "by": "record", "aten": "("}, b"rec-3")
    finally:
        agent.stop()
    assert {e["step"] for e in events if e["kind"] == "op"} == {3, 6}
    calls = [e for e in events if e["kind"] == ATEN]
    assert calls and {e["step"] for e in calls} == {3} and {e["module"] for e in calls} == {"2"}


def test_perfetto_nests_aten_calls_in_their_op_and_node_and_pandas_tables_them(tmp_path):
    import json

    from torchscope.export.perfetto import write

    tr, _ = seed_example(aten=True)
    out = tmp_path / "t.json"
    with open(out, "w") as f:
        write(tr.events, f)
    slices = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("ph") == "X"]
    by_name = {}
    for e in slices:
        by_name.setdefault((e["name"], e["cat"]), []).append(e)

    def inside(child, parent):
        return (
            child["tid"] == parent["tid"]
            and parent["ts"] <= child["ts"]
            and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 1e-3
        )

    (div_op,) = by_name[("Tensor.div", "forward")]
    (div_node,) = by_name[("DivBackward0", "backward")]
    divs = by_name[("aten.div.Tensor", "aten")]
    assert any(inside(c, div_op) for c in divs) and any(inside(c, div_node) for c in divs)
    (engine_sum,) = [c for c in by_name[("aten.add.Tensor", "aten")] if c["args"]["accumulate"]]
    (mul_node,) = by_name[("MulBackward0", "backward")]
    # after the node, on its own (µs floats: equal up to rounding)
    assert engine_sum["ts"] >= mul_node["ts"] + mul_node["dur"] - 1e-3
    table = tr.trace.to_pandas(kind="aten")
    assert list(table["name"]).count("aten.div.Tensor") == 2
    assert table["accumulate"].fillna(False).astype(bool).sum() == 1


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


@pytest.mark.parametrize("mode", ["autocast", "checkpoint", "reentrant", "function"])
def test_autocast_checkpoint_and_custom_functions_at_the_aten_level(mode):
    """Results bit-identical with the level on, no internal error, and the calls of each
    recorded (autocast's casts among them)."""
    import contextlib

    from torch.utils.checkpoint import checkpoint

    def run(ctx):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
        with ctx:
            if mode == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = lin(x)
                loss = y.float().pow(2).mean()
            elif mode in ("checkpoint", "reentrant"):
                reentrant = mode == "reentrant"
                loss = checkpoint(lambda t: lin(t).relu(), x, use_reentrant=reentrant).sum()
            else:
                loss = _Square.apply(lin(x)).sum()
            loss.backward()
        return loss.item(), x.grad

    plain = run(contextlib.nullcontext())
    tr = torchscope.trace(aten=True)
    traced = run(tr)
    assert traced[0] == plain[0] and torch.equal(traced[1], plain[1])
    assert tr.errors == []
    calls = aten_events(tr)
    names = {e.name for e in calls}
    assert "aten.addmm.default" in names and "aten.mm.default" in names
    labelled = {(e.name, e.get("node"), e.get("label")) for e in calls if e.get("label")}
    ops = {e.seq: e.name for e in tr.events if e.kind == "op"}
    if mode == "autocast":
        # the casts autocast put before F.linear, not the user's own y.float() after it
        casts = [e for e in calls if e.name == "aten._to_copy.default" and e.node is None]
        assert [(ops[e.op_seq], e.get("label")) for e in casts] == [
            ("torch.nn.functional.linear", "autocast")
        ] * 3 + [("Tensor.float", None)]
        assert {lbl for _, _, lbl in labelled} == {"autocast"}
        from torchscope.analysis.render import aten_log

        log = list(aten_log(tr.events))
        linear = log.index(next(x for x in log if x.startswith("  torch.nn.functional.linear")))
        assert log[linear + 1].startswith("    aten._to_copy.default [autocast] -> [8] bfloat16")
    elif mode == "checkpoint":
        # the forward re-run inside the first node whose saved tensors it unpacks
        assert ("aten.addmm.default", "ReluBackward0", "recompute") in labelled
        assert not any(e.get("label") for e in calls if e.node is None)
        assert ("aten.threshold_backward.default", "ReluBackward0", None) in {
            (e.name, e.node, e.get("label")) for e in calls
        }
    elif mode == "reentrant":
        assert ("aten.addmm.default", "CheckpointFunctionBackward", "recompute") in labelled
        assert not any(e.get("label") for e in calls if e.node == "AddmmBackward0")
    else:
        assert labelled == set()


def test_calls_under_vmap_are_labelled_with_the_transform():
    w = torch.randn(4)
    x = torch.randn(3, 4)
    plain = torch.vmap(lambda r: (r * w).sum())(x)
    with torchscope.trace(aten=True) as tr:
        traced = torch.vmap(lambda r: (r * w).sum())(x)
        y = (x * w).sum()
    assert torch.equal(plain, traced) and tr.errors == []
    labels = [(e.name, e.get("label")) for e in aten_events(tr)]
    # the batched kernels vmap chose (a sum over dim 1 for each row's sum), then the plain ones
    assert labels == [
        ("aten.mul.Tensor", "vmap"),
        ("aten.sum.dim_IntList", "vmap"),
        ("aten.mul.Tensor", None),
        ("aten.sum.default", None),
    ]
    assert y.item() == pytest.approx(plain.sum().item(), rel=1e-5)


def on_one_gloo_rank(tmp_path, body: str) -> dict:
    """Run ``body`` in a fresh process inside a 1-rank gloo group; the JSON it prints last."""
    code = (
        "import json, os, torch, torchscope, torch.distributed as dist\n"
        'dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"],'
        " rank=0, world_size=1)\n" + body + "\ndist.destroy_process_group()\n"
    )
    env = {**os.environ, "STORE": str(tmp_path / "store")}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_dtensor_records_its_local_shard_and_placement(tmp_path):
    """DTensor on one gloo rank: its aten calls and ops carry the global shape, the local
    shard's stats and the placement; results as without tracing."""
    got = on_one_gloo_rank(
        tmp_path,
        """
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
w = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
def run():
    y = (w * 3).relu().sum()
    y.backward()
    return y.full_tensor().item()
plain = run()
with torchscope.trace(aten=True) as tr:
    traced = run()
mul = [e for e in tr.events if e.kind == "aten" and e.name == "aten.mul.Tensor"][0]
print(json.dumps({"same": plain == traced, "errors": len(tr.errors), "mul": mul.outputs[0],
                  "norm": (w.to_local() * 3).norm().item()}))
""",
    )
    assert got["same"] and got["errors"] == 0
    out = got["mul"]
    assert out["type"] == "torch.distributed.tensor.DTensor"
    assert (out["shape"], out["local_shape"]) == ([4, 6], [4, 6])
    assert out["placement"] == "Shard(dim=0)" and out["stats_of"] == "local"
    assert out["stats"]["norm"] == pytest.approx(got["norm"], rel=1e-6)


def test_collective_kernels_carry_their_group_size_and_no_numbers_before_they_complete(
    tmp_path,
):
    """A functional all_reduce (what compiled code and FSDP2 issue) and c10d's all-gather
    kernel: the group size, and outputs read only once the collective is done (by its op)."""
    got = on_one_gloo_rank(
        tmp_path,
        """
import torch.distributed._functional_collectives as fc
def run():
    y = fc.all_reduce(torch.ones(3) * 2, "sum", dist.group.WORLD) + 1
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, torch.arange(4.0))
    return y.tolist() + out.tolist()
plain = run()
with torchscope.trace(aten=True) as tr:
    traced = run()
calls = {e.name: e for e in tr.events if e.kind == "aten"}
ops = {e.name: e for e in tr.events if e.kind == "op"}
print(json.dumps({"same": plain == traced, "errors": len(tr.errors),
                  "functional": calls["_c10d_functional.all_reduce.default"],
                  "gather": calls["c10d._allgather_base_.default"],
                  "gather_op": [e for n, e in ops.items() if "all_gather" in n][0]}))
""",
    )
    assert got["same"] and got["errors"] == 0
    for call in (got["functional"], got["gather"]):
        assert call["group_size"] == 1
        assert call["outputs"][0]["pending"] is True and call["outputs"][0]["stats"] is None
    op = got["gather_op"]
    assert op["group_size"] == 1 and op["outputs"][0]["stats"]["max"] == 3.0


def test_gpt2_from_a_config_trains_bit_identically_at_the_aten_level():
    """Hugging Face GPT-2 (2 layers, built from a config): losses and weights bit-identical
    with every aten call traced, and the attention's kernels found under its modules."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def train(ctx):
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 16))
        losses = []
        with ctx:
            for _ in range(3):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, model.lm_head.weight.detach().clone()

    import contextlib

    plain = train(contextlib.nullcontext())
    traced = train(tr := torchscope.trace(aten=True))
    assert traced[0] == plain[0] and torch.equal(traced[1], plain[1])
    assert tr.errors == []
    calls = aten_events(tr)
    attention = {e.name for e in calls if e.module.endswith("attn") and e.node is None}
    assert attention & {
        "aten.bmm.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
    }
    assert any(e.node == "AddmmBackward0" and e.name == "aten.mm.default" for e in calls)
