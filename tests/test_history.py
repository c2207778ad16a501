"""The run's history: RunHistory's bounds, the dormant agent's loss and norm collector, and
holds that wait for a step or a condition (in-process; tests/test_history_cli.py has the
subprocess jobs)."""

from __future__ import annotations

import math
import threading

import models
import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optim_mod

from torchscope.protocol.codec import pack, unpack
from torchscope.protocol.events import HISTORY, check_event
from torchscope.protocol.history import ModuleValues, RunHistory, StepPoint, parse_condition
from torchscope.tracer import backward_calls
from torchscope.tracer.agent import Agent, ServeOptions
from torchscope.tracer.history import HistoryCollector


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def agent(**options) -> tuple[Agent, list]:
    events: list = []
    a = Agent(ServeOptions(live=False, **options)).start()
    a.sinks.append(events.extend)
    return a, events


def train(steps: int, on_step=None, scale=None, seed: int = 0) -> list[float]:
    """The tests' job: what it would print, one loss per step."""
    model = models.mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        loss = F.mse_loss(model(torch.randn(4, 8, generator=gen)), torch.zeros(4, 4))
        if scale is not None:
            loss = loss * scale(i)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def traced_steps(events: list) -> list[int]:
    return sorted({e["step"] for e in events if e["kind"] == "op"})


# -- RunHistory ------------------------------------------------------------------------------
def test_older_steps_fold_into_buckets_that_keep_min_max_and_last():
    h = RunHistory(keep=100, bucket=10)
    losses = [math.sin(i / 7) + i / 1000 for i in range(5000)]
    losses[1234] = 50.0  # a spike, long folded by the end
    losses[2345] = -50.0
    losses[3456] = math.nan
    for i, x in enumerate(losses):
        h.add(StepPoint(i, loss=x, grad_norm=float(i)))
    assert [p.step for p in h.points] == list(range(4900, 5000))
    assert len(h.buckets) <= h.keep // h.bucket
    # The buckets tile the folded steps, in order, without gaps.
    assert h.buckets[0].first == 0 and h.buckets[-1].last == 4899
    for a, b in zip(h.buckets, h.buckets[1:], strict=False):
        assert b.first == a.last + 1
    his = [b.loss.hi for b in h.buckets]
    los = [b.loss.lo for b in h.buckets]
    assert min(los) == -50.0
    assert 50.0 in his
    assert any(math.isnan(x) for x in his)  # a NaN is what a user looks for: it survives
    for b in h.buckets:
        inside = [x for x in losses[b.first : b.last + 1] if not math.isnan(x)]
        assert b.loss.lo == min(inside)
        assert b.loss.last == losses[b.last] or math.isnan(losses[b.last])
        assert (b.grad_norm.lo, b.grad_norm.hi, b.grad_norm.last) == (b.first, b.last, b.last)
        if not any(math.isnan(x) for x in losses[b.first : b.last + 1]):
            assert b.loss.hi == max(inside)


def test_history_round_trips_through_its_wire_form_and_events():
    h = RunHistory(keep=20, bucket=5)
    for i in range(60):
        h.add(StepPoint(i, loss=float(i), grad_norm=1.0, traced=i % 7 == 0))
    wire = unpack(pack(h.to_wire()))
    copy = RunHistory(keep=20, bucket=5)
    copy.merge_wire(wire)
    assert copy.to_wire() == h.to_wire()
    # A live event repeating points already held changes nothing; a newer one appends.
    copy.merge_wire({"points": [p.to_wire() for p in h.points][-3:]})
    assert copy.to_wire() == h.to_wire()
    assert [p.step for p in h.since(56)] == [57, 58, 59]
    assert h.to_wire(since=57) == {
        "points": [h.points[-2].to_wire(), h.points[-1].to_wire()],
        "buckets": [],
    }
    ev = check_event({"kind": HISTORY, "seq": 1, "step": 60, **wire})
    assert ev["points"][0]["step"] == 40


def test_module_norms_are_kept_for_the_newest_steps_only():
    h = RunHistory(keep=1000, bucket=10, module_keep=5)
    for i in range(20):
        h.add(StepPoint(i, loss=1.0, module_norms={"a": float(i)}))
    kept = [p.step for p in h.points if p.module_norms]
    assert kept == list(range(15, 20))
    assert all(p.loss == 1.0 for p in h.points)


def test_module_values_is_a_whole_mapping():
    # Its numbers once sat in an attribute named ``values``, which made .values() call an array.
    norms = ModuleValues(("a", "b"), [1.0, 2.0])
    assert list(norms.values()) == [1.0, 2.0]
    assert dict(norms.items()) == {"a": 1.0, "b": 2.0} and norms["b"] == 2.0


def test_conditions_parse_test_and_refuse_in_one_line():
    assert parse_condition("gradnorm>1e3").holds(StepPoint(0, grad_norm=1001.0))
    assert not parse_condition("gradnorm>1e3").holds(StepPoint(0, grad_norm=999.0))
    assert not parse_condition("gradnorm>1e3").holds(StepPoint(0, loss=5e3))  # no norm: no
    assert parse_condition(" loss < 0.5 ").holds(StepPoint(0, loss=0.25))
    assert parse_condition("loss>2").holds(StepPoint(0, loss=math.inf))
    assert not parse_condition("loss>2").holds(StepPoint(0, loss=math.nan))
    nonfinite = parse_condition("nonfinite")
    assert nonfinite.holds(StepPoint(0, loss=math.nan))
    assert nonfinite.holds(StepPoint(0, loss=1.0, grad_norm=math.inf))
    assert not nonfinite.holds(StepPoint(0, loss=1.0, grad_norm=2.0))
    for bad in ("loss>>1", "loss=1", "lr>1", "loss>abc", "", "nonfinite>1", "loss>nan"):
        with pytest.raises(ValueError) as info:
            parse_condition(bad)
        assert "\n" not in str(info.value) and str(info.value)


# -- the agent's collector -------------------------------------------------------------------
def test_dormant_history_holds_every_loss_and_marks_the_traced_steps():
    a, events = agent()

    def on_step(i: int) -> None:
        if i == 20:
            a._cmd_arm({"next": 3}, b"recorder")

    try:
        losses = train(40, on_step=on_step)
    finally:
        a.stop()
    assert losses == train(40)  # the job's numbers are untouched
    points = list(a.history.history.points)
    assert [p.step for p in points] == list(range(40))
    assert [p.loss for p in points] == losses  # bit for bit: the values the job prints
    assert [p.step for p in points if p.traced] == traced_steps(events) == [21, 22, 23]
    assert all(p.grad_norm is None for p in points)  # no watch: no norms (no sync for them)


def test_gradient_accumulation_keeps_the_last_micro_batch_loss():
    a, _ = agent()
    model = models.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    last = []
    try:
        for _ in range(5):
            for _ in range(3):
                loss = F.mse_loss(model(torch.randn(4, 8, generator=gen)), torch.zeros(4, 4))
                (loss / 3).backward()
                micro = (loss / 3).item()
            opt.step()
            opt.zero_grad()
            last.append(micro)
    finally:
        a.stop()
    assert [p.loss for p in a.history.history.points] == last


def test_a_job_renumbered_by_its_first_optimizer_step_keeps_one_point_per_step():
    a, _ = agent()
    model = models.mlp(0)
    gen = torch.Generator().manual_seed(0)
    seen = []
    try:
        for i in range(6):  # no optimizer yet: each backward() counts as a step
            if i == 3:
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            loss = F.mse_loss(model(torch.randn(4, 8, generator=gen)), torch.zeros(4, 4))
            loss.backward()
            seen.append(loss.item())
            if i >= 3:
                opt.step()
                opt.zero_grad()
    finally:
        a.stop()
    steps = [p.step for p in a.history.history.points]
    assert steps == sorted(set(steps))  # no step twice, in order
    assert a.history.history.points[-1].loss == seen[-1]
    assert steps[-1] == a.clock.step - 1


def test_device_values_arrive_in_batches_in_order_without_a_read_per_step():
    """The accelerator path, run on the CPU: values kept at each boundary, stacked and copied
    every ``batch`` steps (or at the next boundary after a UI asks), delivered in order."""
    c = HistoryCollector(threading.get_ident, batch=4)
    c.host_devices = ()  # treat the CPU as a device: every value goes through a batch
    c.sending = True
    c.step_ends(0)
    values = [torch.tensor(float(i) * 1.5, requires_grad=True) * 1.0 for i in range(12)]
    arrived = []
    for i, v in enumerate(values[:10]):
        c.backward_begins({"tensors": (v,)})
        arrived.append([p.step for p in c.step_ends(i + 1)])
    assert arrived[:3] == [[], [], []]  # kept on the "device" until a batch is full
    assert arrived[3] == [0, 1, 2, 3] and arrived[7] == [4, 5, 6, 7]
    assert c.pending() == 2 and len(c.history) == 8
    c.flush_soon = True  # a UI asked (or a heartbeat passed): the next boundary copies
    c.backward_begins({"tensors": values[10]})
    assert [p.step for p in c.step_ends(11)] == [8, 9, 10]
    c.backward_begins({"tensors": values[11]})
    c.step_ends(12)
    assert c.pending() == 1
    assert [p.step for p in c.finish()] == [11]  # the job's end reads what is left
    assert [p.loss for p in c.history.points] == [float(i) * 1.5 for i in range(12)]
    assert [p.step for p in c.take_unsent(every=0)] == list(range(12))
    for p in c.history.points:
        assert p.traced is False and p.grad_norm is None
    # A root of several values, or several roots, is no loss.
    c.backward_begins({"tensors": torch.ones(3)})
    c.step_ends(13)
    c.backward_begins({"tensors": (torch.ones(()), torch.ones(()))})
    c.step_ends(14)
    c.finish()
    assert [p.loss for p in c.history.points][-2:] == [None, None]


@pytest.mark.parametrize("flat", [True, False], ids=["flat copy", "a norm per tensor"])
def test_per_module_norms_equal_vector_norm_of_each_modules_gradients(flat, monkeypatch):
    """Both ways of reading the norms: the CPU's flat copy of many small gradients, and one
    fused norm per tensor (the accelerators' way, and the CPU's for large gradients)."""
    from torchscope.tracer.watch import norms

    if flat:
        monkeypatch.setattr(norms, "FLAT_MIN_TENSORS", 1)  # the model has only six
    else:
        monkeypatch.setattr(norms, "FLAT_MAX_ELEMENTS", 0)
    a, _ = agent(watch="nan")
    model = models.mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    expected = []
    try:
        for _ in range(12):
            loss = F.mse_loss(model(torch.randn(4, 8, generator=gen)), torch.zeros(4, 4))
            opt.zero_grad()
            loss.backward()
            per_module = {}
            for path, module in model.named_modules():
                grads = [p.grad.flatten() for p in module.parameters(recurse=False)]
                if grads:
                    per_module[path] = torch.linalg.vector_norm(torch.cat(grads)).item()
            every = torch.cat([p.grad.flatten() for p in model.parameters()])
            expected.append((torch.linalg.vector_norm(every).item(), per_module))
            opt.step()
    finally:
        a.stop()
    points = list(a.history.history.points)
    assert len(points) == 12
    for p, (total, per_module) in zip(points, expected, strict=True):
        assert p.grad_norm == pytest.approx(total, rel=1e-5)
        assert dict(p.module_norms) == pytest.approx(per_module, rel=1e-5)
        assert set(p.module_norms) == {"0", "2", "4"}


def test_the_history_command_answers_all_since_and_latest():
    a, _ = agent()
    try:
        train(30)
        everything = a._cmd_history({"since": None, "max_points": None}, b"ui")
        newer = a._cmd_history({"since": 25, "max_points": None}, b"ui")
        latest = a._cmd_history({"since": None, "max_points": 0}, b"ui")
    finally:
        a.stop()
    # Every step has ended (optimizer.step()): its point is in.
    assert [p["step"] for p in everything["points"]] == list(range(30))
    assert [p["step"] for p in newer["points"]] == [26, 27, 28, 29]
    assert latest["points"] == [] and latest["latest"]["step"] == 29
    assert everything["pending"] == 0 and everything["step"] == 30
    unpack(pack(everything))  # plain data


@pytest.mark.parametrize("batched", [False, True], ids=["host", "device-batches"])
def test_a_recording_holds_every_point_once_even_with_no_ui_and_no_ticks(
    tmp_path, monkeypatch, batched
):
    """live=False: no publisher, no ticks; the file alone reads the history (from step 0,
    before and after its traced window), through the armed tracer and around it; values read
    as an accelerator's are (in batches, a batch late) arrive all the same."""
    from torchscope.protocol.tracefile import TraceReader

    if batched:
        monkeypatch.setattr(HistoryCollector, "host_devices", ())
    path = tmp_path / "w.tsc"
    a, _ = agent(record=str(path), steps="10-12")
    try:
        losses = train(40)
    finally:
        a.stop()
    assert losses == train(40)
    with TraceReader(path) as reader:
        events = list(reader.iter_events())
    history = [e for e in events if e["kind"] == HISTORY]
    points = [p for e in history for p in e["points"]]
    assert [p["step"] for p in points] == list(range(40))
    assert [p["loss"] for p in points] == losses
    assert [p["step"] for p in points if p.get("traced")] == traced_steps(events) == [10, 11, 12]
    assert all(e["step"] is None and len(e["points"]) <= a.history.batch for e in history)


def test_a_dormant_recording_keeps_no_history_in_the_snapshot_ring(tmp_path):
    """Dormant with no UI reading, the history goes to the file only: the publisher's ring
    (snapshots) would hold thousands of copies over a long run; a UI asks for the history
    when it attaches, and gets it whole."""
    pytest.importorskip("zmq")
    from torchscope.protocol.client import SessionClient
    from torchscope.protocol.tracefile import TraceReader

    path = tmp_path / "d.tsc"
    a = Agent(ServeOptions(record=str(path), steps="3-4", quiet=True)).start()
    try:
        losses = train(80)
        with SessionClient() as ui:
            ui.connect(a.publisher.record.control, timeout=30)
            snap = ui.snapshot()
            reply = ui.request("history", timeout=30)
    finally:
        a.stop()
    assert not [e for e in snap["events"] if e["kind"] == HISTORY]
    assert [p["loss"] for p in reply["points"]] == losses
    with TraceReader(path) as reader:
        history = [e for e in reader.iter_events() if e["kind"] == HISTORY]
    assert [p["loss"] for e in history for p in e["points"]] == losses


def test_history_off_keeps_nothing_and_refuses_conditions(tmp_path):
    from torchscope.protocol.tracefile import TraceReader

    path = tmp_path / "off.tsc"
    a, _ = agent(record=str(path), history=False)
    try:
        train(10)
        with pytest.raises(ValueError, match="does not keep"):
            a._cmd_arm({"when": "loss>1"}, b"ui")
        reply = a._cmd_history({"since": None, "max_points": None}, b"ui")
    finally:
        a.stop()
    with TraceReader(path) as reader:
        events = list(reader.iter_events())
    assert len(a.history.history) == 0 and reply["points"] == [] and reply["latest"] is None
    assert not [e for e in events if e["kind"] == HISTORY]
    assert traced_steps(events) == list(range(10))  # the recording itself is unchanged


# -- holds that wait -------------------------------------------------------------------------
def test_arm_at_a_future_step_holds_from_that_step():
    a, events = agent()

    def on_step(i: int) -> None:
        if i == 3:
            a._cmd_arm({"at_step": 15, "next": 2}, b"ui")
            assert a._tracing_state() == "arming"

    try:
        train(25, on_step=on_step)
    finally:
        a.stop()
    assert traced_steps(events) == [15, 16]


@pytest.mark.parametrize(
    ("when", "watch"), [("loss>100", None), ("gradnorm>50", "nan"), ("nonfinite", None)]
)
def test_arm_on_condition_arms_at_the_first_boundary_after_it_holds(when, watch):
    a, events = agent(**({"watch": watch} if watch else {}))
    states = {}

    def on_step(i: int) -> None:
        if i == 5:
            a._cmd_arm({"when": when, "next": 2}, b"ui")
        states[i] = a._tracing_state()

    def scale(i: int) -> float:
        if i != 12:
            return 1.0
        return math.inf if when == "nonfinite" else 1e4

    try:
        train(25, on_step=on_step, scale=scale)
    finally:
        a.stop()
    assert traced_steps(events) == [13, 14]  # step 12 met it: the next boundary arms
    assert states[8] == "dormant"  # waiting on a condition is not arming
    condition = parse_condition(when)
    first = next(p.step for p in a.history.history.points if condition.holds(p))
    assert first == 12
    (holder,) = [h for h in a.holders.describe() if h.get("when")] or [None]
    assert holder is None  # its 2 steps done, it went


def test_a_condition_is_refused_in_one_line_and_goes_with_its_client():
    import time

    a, _ = agent(lease=0.05)
    try:
        with pytest.raises(ValueError, match="not a condition"):
            a._cmd_arm({"when": "loss>>1"}, b"ui")
        with pytest.raises(ValueError, match="only the watch computes"):
            a._cmd_arm({"when": "gradnorm>1"}, b"ui")
        a._cmd_arm({"when": "loss>1e9"}, b"ui")
        assert a.holders.describe()[0]["when"] == "loss>1e9"
        a._cmd_disarm({}, b"ui")
        assert a.holders.describe() == []
        a._cmd_arm({"when": "nonfinite"}, b"ui2")  # a client that goes silent...
        assert a.holders.describe() != []
        deadline = time.monotonic() + 60
        while a.holders.describe() != []:  # the publisher's tick, until the lease has passed
            assert time.monotonic() < deadline, "the silent client kept its hold"
            a._expire_leases()  # ... loses its waiting hold with its lease, like any other
            time.sleep(0.01)
    finally:
        a.stop()


def test_the_history_adds_no_hook_and_no_thread_to_the_dormant_agent():
    def hooks() -> tuple:
        return (
            torch._C._len_torch_function_stack(),
            dict(module_mod._global_forward_pre_hooks),
            dict(module_mod._global_forward_hooks),
            dict(module_mod._global_backward_hooks),
            dict(optim_mod._global_optimizer_pre_hooks),
            dict(optim_mod._global_optimizer_post_hooks),
        )

    before = (hooks(), set(threading.enumerate()))
    a, _ = agent()
    started = (hooks(), set(threading.enumerate()))
    during = {}

    def on_step(i: int) -> None:
        if i == 30:
            during["state"] = (hooks(), set(threading.enumerate()))
            during["listeners"] = sorted(type(x).__name__ for x in backward_calls._listeners)

    try:
        train(40, on_step=on_step)
    finally:
        a.stop()
    assert len(a.history.history) == 40
    assert during["state"] == started  # nothing added while it collects
    assert started[1] == before[1]  # no thread of its own (live=False: none at all)
    # The history's listener alone: the step clock stopped listening to backward() once an
    # optimizer counted the steps (a call less in every step of a dormant job).
    assert during["listeners"] == [HistoryCollector.__name__]
    assert hooks() == before[0]


@pytest.mark.parametrize("flat", [True, False], ids=["flat copy", "a norm per tensor"])
def test_module_norms_of_non_finite_gradients(flat, monkeypatch):
    """A NaN gradient makes the total and its own module's figure NaN, not the others'."""
    from torchscope.tracer.watch import norms

    if flat:
        monkeypatch.setattr(norms, "FLAT_MIN_TENSORS", 1)  # the model has only six
    else:
        monkeypatch.setattr(norms, "FLAT_MAX_ELEMENTS", 0)
    model = models.mlp(0)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    got = []
    module_norms = norms.ModuleNorms(lambda *a: got.append(a), lambda: [model])
    every = torch.cat([p.grad.flatten() for p in params])
    row = module_norms.read(params, [p.grad for p in params], [torch.tensor(2.0)])
    assert row[0] == pytest.approx(torch.linalg.vector_norm(every).item(), rel=1e-6)
    assert row[1] == 2.0
    assert all((group[5] is not None) == flat for group in module_norms._plan.groups)
    assert (module_norms._plan.order is not None) == flat  # the fused read
    params[2].grad[0, 0] = float("nan")
    row = module_norms.read(params, [p.grad for p in params], [torch.tensor(2.0)])
    assert math.isnan(row[0])
    module_norms.took(3, row)
    step, grad_norm, per_module = got[-1]
    assert step == 3 and math.isnan(grad_norm)
    assert math.isnan(per_module["2"]) and per_module["0"] == pytest.approx(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params[:2]])).item()
    )


@pytest.mark.parametrize("flat", [True, False], ids=["flat copy", "a norm per tensor"])
def test_module_norms_read_params_in_any_order_and_the_scale_beside_them(flat, monkeypatch):
    """An optimizer's groups may list every weight before every bias (decay / no decay): each
    module's figure is still its own parameters', and the scale comes back last, as given."""
    from torchscope.tracer.watch import norms

    if flat:
        monkeypatch.setattr(norms, "FLAT_MIN_TENSORS", 1)
    else:
        monkeypatch.setattr(norms, "FLAT_MAX_ELEMENTS", 0)
    model = models.mlp(0)
    gen = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    params = [p for n, p in model.named_parameters() if n.endswith("weight")]
    params += [p for n, p in model.named_parameters() if n.endswith("bias")]
    module_norms = norms.ModuleNorms(None, lambda: [model])
    losses = [torch.tensor(-3.0), torch.tensor(4.0)]  # two micro-batches' losses
    row = module_norms.read(params, [p.grad for p in params], losses, torch.tensor(1024.0))
    plan = module_norms._plan
    assert (plan.order is not None) == flat
    every = torch.cat([p.grad.flatten() for p in params])
    assert row[0] == pytest.approx(torch.linalg.vector_norm(every).item(), rel=1e-6)
    assert row[1] == pytest.approx(5.0)
    assert row[-1] == 1024.0 and len(row) == 2 + len(plan.names) + 1
    for name, sq in zip(plan.names, row[2:-1], strict=True):
        own = torch.cat([p.grad.flatten() for p in model.get_submodule(name).parameters()])
        assert sq == pytest.approx((own.double() ** 2).sum().item(), rel=1e-6), name
    # no loss at all (a backward() whose roots were not seen): the loss's figure is 0
    row = module_norms.read(params, [p.grad for p in params], [])
    assert row[1] == 0.0 and len(row) == 2 + len(plan.names)


def test_the_cpus_flat_copy_sums_squares_where_float32_cannot_hold_them(monkeypatch):
    """Gradients of 1e20: squares no float32 holds; the total is summed in float64."""
    from torchscope.tracer.watch import norms

    monkeypatch.setattr(norms, "FLAT_MIN_TENSORS", 1)
    model = models.mlp(0)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 1e20)
    module_norms = norms.ModuleNorms(lambda *a: None, lambda: [model])
    row = module_norms.read(params, [p.grad for p in params], [torch.tensor(2.0)])
    every = torch.cat([p.grad.flatten().double() for p in params])
    assert row[0] == pytest.approx(torch.linalg.vector_norm(every).item(), rel=1e-6)
    assert all(group[5] is not None for group in module_norms._plan.groups)  # the flat copy
