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


def test_nan_written_into_a_weight_by_the_optimizer_is_reported_once_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e38)  # the update overflows: Inf, then NaN
    with torchscope.trace() as tr:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(3, 4) * 1e3).pow(2).mean().backward()
            opt.step()
    inputs = [a for a in tr.alerts if a.where == "input"]
    assert inputs, tr.alerts
    names = [a.name for a in inputs]
    assert len(names) == len(set(names)), "a bad weight is reported once, not every step"
    assert all(n.startswith("parameter ") for n in names)
    params = {n for n, _ in model.named_parameters()}
    assert {n.removeprefix("parameter ") for n in names} <= params
    first = inputs[0]
    op = next(o for o in tr.ops if o.seq == first.event_seq)
    bad = [s for s in op.inputs if s.get("param") == first.name.removeprefix("parameter ")]
    assert bad and (bad[0]["stats"]["nan"] or bad[0]["stats"]["inf"])


def test_nan_in_the_input_data_is_reported_at_its_first_use():
    model = nn.Linear(3, 1)
    x = torch.tensor([[1.0, float("nan"), 2.0]])
    with torchscope.trace() as tr:
        model(x).sum().backward()
    (alert,) = [a for a in tr.alerts if a.where == "input"]
    assert alert.what == "nan" and "input 0 of torch.nn.functional.linear" in alert.name
    assert [a for a in tr.alerts if a.where == "forward"] == []


class MaskedAttention(nn.Module):
    def __init__(self, mask_everything: bool) -> None:
        super().__init__()
        self.mask_everything = mask_everything

    def forward(self, scores):
        mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
        if self.mask_everything:
            mask[0] = True
        masked = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(masked, dim=-1)  # a fully masked row: NaN


@pytest.mark.parametrize("mask_everything", [False, True])
def test_intentional_inf_mask_is_not_an_alert_but_a_fully_masked_row_is(mask_everything):
    attn = MaskedAttention(mask_everything)
    with torchscope.trace() as tr:
        attn(torch.randn(3, 3))
    forward = [a for a in tr.alerts if a.where == "forward"]
    if not mask_everything:
        assert forward == []
    else:
        (alert,) = forward
        assert alert.what == "nan" and alert.name == "torch.softmax"
        assert alert.source == line_of(MaskedAttention.forward, "torch.softmax")


def test_initialising_uninitialised_memory_is_not_an_alert():
    """nn.LSTM (like many modules) makes its weights with torch.empty, wraps them in a
    Parameter and fills them with nn.init.uniform_: whatever NaN the allocator left there is
    overwritten unread, so nothing enters. A NaN that is read still does."""
    nan = float("nan")
    # NaN memory from outside the trace, as the allocator may hand it out.
    weights = [torch.nn.Parameter(torch.full((64, 64), nan)) for _ in range(3)]
    buffers = [torch.full((8,), nan) for _ in range(3)]
    bad = torch.full((4,), nan)
    with torchscope.trace() as tr:
        for w, buf in zip(weights, buffers, strict=True):
            torch.nn.init.kaiming_uniform_(w)
            buf.copy_(torch.ones(8))
            buf.zero_()
        torch.nn.LSTM(8, 8)
        bad.add_(1.0)  # reads the NaN
    inits = [o for o in tr.ops if o.name == "torch.nn.init.kaiming_uniform_"]
    assert len(inits) == 3 and all(o.inputs[0]["stats"] is None for o in inits)
    assert not any("external" in o.inputs[0] for o in inits)
    assert [(a.where, a.name) for a in tr.alerts] == [
        ("input", "input 0 of Tensor.add_ (from outside the traced ops)")
    ]


def test_the_standard_causal_mask_is_not_an_inf_origin_but_a_fully_masked_row_is_a_nan():
    """``nn.Transformer.generate_square_subsequent_mask``: ``triu(full(-inf))``. The Inf is
    intended at ``full`` and stays intended through ``triu`` and the masked scores; a row
    that is masked entirely still turns into NaN in ``softmax``, which is reported there."""
    scores = torch.randn(4, 4)
    with torchscope.trace() as tr:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
        attn = torch.softmax(scores + mask, dim=-1)
        full = torch.full((4, 4), float("-inf"))
        dead = torch.softmax(scores + full, dim=-1)  # every position masked
    assert torch.isfinite(attn).all() and torch.isnan(dead).all()
    assert [(a.what, a.name) for a in tr.alerts] == [("nan", "torch.softmax")]
    assert tr.alerts[0].event_seq == [o for o in tr.ops if o.name == "torch.softmax"][1].seq


def test_a_view_of_an_uninitialized_buffer_is_not_an_origin():
    """FSDP's all-gather: ``torch.empty`` then views of it before anything the tracer sees
    writes it. Its bytes (NaN here, written behind the tracer's back as a collective does)
    mean nothing: no stats, no alert; once written, its views have stats again."""
    with torchscope.trace(live=False) as tr:
        buf = torch.empty(8)
        buf.numpy()[:] = float("nan")  # no version bump, no traced op: garbage to the tracer
        garbage = buf.view(2, 4)
        buf.copy_(torch.ones(8))
        written = buf.view(2, 4)
        assert torch.equal(written, torch.ones(2, 4)) and garbage.data_ptr() == buf.data_ptr()
    views = [e for e in tr.ops if e["name"] == "Tensor.view"]
    assert views[0]["outputs"][0].get("uninitialized") and views[0]["outputs"][0]["stats"] is None
    assert views[1]["outputs"][0]["stats"]["norm"] == pytest.approx(8**0.5)
    assert tr.alerts == []


def test_alerts_hold_when_a_step_is_delivered_in_several_batches():
    """Delivery skips the NaN/Inf checks while no non-finite summary was made since the
    step began; a step whose events arrive in several batches is still checked whole: the
    origin is found, and the backward NaN it causes is not a second origin."""
    w = torch.nn.Parameter(torch.ones(4))
    with torchscope.trace() as tr:
        for step in range(3):
            x = torch.full((4,), -1.0 if step == 1 else 1.0)
            h = w * x
            tr.pipeline.flush()  # what came so far goes out in its own batch
            y = h.sqrt()  # NaN at step 1
            tr.pipeline.flush()
            y.sum().backward()
            torchscope.step()
    assert tr.errors == []
    by_step = {s: [a for a in tr.alerts if a.step == s] for s in range(3)}
    assert by_step[0] == [] and by_step[2] == []
    (alert,) = by_step[1]
    assert alert.where == "forward" and alert.name == "Tensor.sqrt" and alert.what == "nan"


def test_alerts_keep_seq_order_when_summaries_land_late(monkeypatch):
    """On CUDA a batch's numbers land after later events were numbered: the alert found in
    it is numbered then, so it must go out behind them. Here no sealed batch is ever ready
    until the tracer waits for them all, as a slow device copy would be."""
    from torchscope.tracer.armed import pipeline

    monkeypatch.setattr(pipeline.SealedBatch, "ready", lambda self: False)
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with torchscope.trace(live=False) as tr:
        tr.summarizer.host_now = False  # the device path: numbers land when a batch resolves
        for step in range(3):
            opt.zero_grad()
            out = m(torch.randn(3, 4))
            if step == 1:
                out = out * torch.tensor(float("nan"))
            out.sum().backward()
            opt.step()
    seqs = [e["seq"] for e in tr.events if e.get("seq") is not None]
    assert tr.alerts and seqs == sorted(seqs)


def test_a_view_of_memory_from_outside_is_from_outside_too():
    """FSDP views its gathered-parameter buffers (allocated and filled outside the traced
    ops) before it writes them: the view computes nothing and raises no alert. Data with a
    NaN from outside is reported where it is first read, as from outside."""
    x = torch.randn(8)
    x[3] = float("nan")
    buf = torch.empty(8)
    buf.numpy()[:] = float("nan")  # garbage a library is about to overwrite
    with torchscope.trace(live=False) as tr:
        buf.view(2, 4).copy_(torch.ones(2, 4))
        y = x.view(2, 4) * 2
    assert torch.isnan(y).any() and torch.equal(buf, torch.ones(8))
    messages = [a["message"] for a in tr.alerts]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "NaN enters as input 0 of Tensor.mul (from outside the traced ops)"
    ), messages


def test_the_destinations_of_an_out_call_are_written_not_read():
    """``torch.add(a, b, out=dst)`` and FSDP's ``split_with_sizes_copy(..., out=[...])``
    write into buffers whose old bytes (NaN garbage here) nobody reads: no stats of them,
    no alert. A NaN among the real inputs still is one."""
    garbage = [torch.full((4,), float("nan")) for _ in range(3)]
    a, b = torch.ones(4), torch.full((4,), 2.0)
    bad = torch.full((4,), float("nan"))
    with torchscope.trace(live=False) as tr:
        torch.add(a, b, out=garbage[0])
        torch.split_with_sizes_copy(torch.cat([a, b]), [4, 4], out=garbage[1:])
        torch.add(bad, b, out=torch.empty(4))
    assert torch.equal(garbage[0], torch.full((4,), 3.0)) and torch.equal(garbage[2], b)
    adds = [e for e in tr.ops if e["name"] == "torch.add"]
    assert adds[0]["inputs"][2]["stats"] is None
    messages = [a["message"] for a in tr.alerts]
    assert len(messages) == 1 and messages[0].startswith(
        "NaN enters as input 0 of torch.add (from outside the traced ops)"
    ), messages


def test_a_destination_the_memo_knows_as_garbage_is_still_only_written():
    """FSDP views its uninitialised all-gather buffer (a traced view of outside memory: in
    the memo, NaN garbage) and passes the views as ``out=``: still no stats, no alert."""
    buf = torch.empty(8)
    buf.numpy()[:] = float("nan")  # garbage, behind the tracer's back
    src = torch.arange(8.0)
    with torchscope.trace(live=False) as tr:
        dests = [buf.narrow(0, 0, 4), buf.narrow(0, 4, 4)]
        torch.split_with_sizes_copy(src, [4, 4], out=dests)
    assert torch.equal(buf, src)
    (split,) = [e for e in tr.ops if e["name"] == "torch.split_with_sizes_copy"]
    assert [s["stats"] is None for s in split["inputs"]] == [False, True, True]
    assert tr.alerts == []


def clipped_training(record: str | None, *, set_to_none: bool, micro_batches: int):
    """Five traced steps of a small model with gradient clipping and SGD; one NaN in the
    data of step 1. ``set_to_none=False`` (and several micro-batches) makes AccumulateGrad
    sum into the ``.grad`` it already holds instead of storing the gradient it received."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [[torch.randn(3, 4) for _ in range(micro_batches)] for _ in range(5)]
    batches[1][0][0, 0] = float("nan")
    with torchscope.trace(record=record, live=False) as tr:
        for micro in batches:
            opt.zero_grad(set_to_none=set_to_none)
            for x in micro:
                model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert all(torch.isnan(p).all() for p in model.parameters())
    return tr


@pytest.mark.parametrize(
    ("set_to_none", "micro_batches"), [(True, 1), (False, 2)], ids=["stored", "summed"]
)
def test_one_nan_is_one_origin_and_its_consequences_are_counted_under_it(
    tmp_path, capsys, set_to_none, micro_batches
):
    """One NaN in the data gave an alert per gradient at every step (``clip_grad_norm_``
    reading them "from outside the traced ops") and one per parameter after the update. The
    gradients are the traced backward's own (reading them is downstream of the origin), and
    the NaN parameters of the next step are the origin's consequences: one alert, with their
    count, in the trace, the file and ``dump --kind alert``."""
    from torchscope.cli import main

    path = tmp_path / "t.tsc"
    tr = clipped_training(str(path), set_to_none=set_to_none, micro_batches=micro_batches)
    assert tr.errors == []
    recorded = tr.trace.of_kind("alert")
    assert not [a for a in recorded if "_foreach_norm" in a["message"]], recorded
    n_params = 4
    for alerts in (tr.alerts, torchscope.load(path).alerts):
        (origin,) = alerts
        assert (origin.what, origin.where, origin.step) == ("nan", "input", 1)
        assert origin.name == "input 0 of torch.nn.functional.linear (from outside the traced ops)"
        assert origin.origin == f"0:{origin.seq}"
        assert origin.consequences == n_params and origin.consequence_steps == [2, 2]
        first = origin.first_consequences
        assert len(first) == n_params and all(c["origin"] == origin.origin for c in first)
        assert first[0]["message"] == (
            "NaN enters as parameter 0.weight \u2014 written by the optimizer from the NaN "
            "gradient of step 1 (consequence of the origin at step 1)"
        )
    # The file holds the origin and one update of its count (it cannot rewrite the origin).
    assert [a["where"] for a in recorded] == ["input", "consequences"]

    assert main(["dump", str(path), "--kind", "alert"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    heads = [line for line in lines if " ALERT " in line]
    assert len(heads) == 1 and heads[0].endswith(f"[+{n_params} consequences, step 2]"), lines
    assert len(lines) == 1 + n_params  # the origin, then its consequences in words


def test_a_nan_breakpoint_stops_once_per_origin_not_at_its_consequences():
    """Gradient clipping and the NaN parameters of the next steps do not stop a ``nan``
    breakpoint again: it stops once, where the NaN enters."""
    import threading

    from torchscope.protocol.breakpoints import parse_break_spec
    from torchscope.tracer.armed.session import Tracer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(3, 4) for _ in range(4)]
    batches[1][0, 0] = float("nan")
    tracer = Tracer(live=False, breakpoints=[parse_break_spec("nan")])
    stops: list[str] = []

    def ui() -> None:  # continues each pause, noting where it was
        while job.is_alive():
            point = tracer.stepper.paused
            if point is not None:
                stops.append(point.describe()["event"]["name"])
                tracer.stepper.request_continue()
                while tracer.stepper.paused is point:
                    pass
            job.join(0.005)

    def train() -> None:
        with tracer:
            for x in batches:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

    job = threading.Thread(target=train, daemon=True)
    job.start()
    ui()
    job.join(30)
    assert stops == ["torch.nn.functional.linear"]
