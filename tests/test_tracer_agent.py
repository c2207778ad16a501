"""The dormant agent in-process: step numbering, arming at step boundaries, detaching clean.

Control requests are made the way the publisher's thread makes them (the agent's command
handlers with a client id); the socket path is covered by tests/test_attach.py.
"""

from __future__ import annotations

import gc
import threading

import models
import torch
import torch.nn.functional as F
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optim_mod

import torchscope
from torchscope.protocol.events import DORMANT, TRACED, TRACING
from torchscope.tracer.agent import Agent, ServeOptions, current_agent


def hooks_and_modes() -> tuple[int, int, int, int]:
    return (
        torch._C._len_torch_function_stack(),
        len(module_mod._global_forward_pre_hooks),
        len(module_mod._global_forward_hooks),
        len(optim_mod._global_optimizer_pre_hooks),
    )


def agent(**options) -> tuple[Agent, list]:
    events: list = []
    a = Agent(ServeOptions(live=False, **options)).start()
    a.sinks.append(events.extend)
    return a, events


def train(steps: int, on_step=None, seed: int = 0) -> list[float]:
    model = models.mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        x = torch.randn(4, 8, generator=gen)
        loss = F.mse_loss(model(x), torch.zeros(4, 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def traced_steps(events: list) -> list[int]:
    return sorted({e["step"] for e in events if e["kind"] == "op"})


def test_dormant_job_traces_nothing_counts_steps_and_keeps_losses_bit_identical():
    plain = train(12)
    before = hooks_and_modes()
    a, events = agent()
    seen = []
    try:
        losses = train(12, on_step=lambda i: seen.append((a.clock.step, hooks_and_modes())))
    finally:
        a.stop()
    assert losses == plain
    assert [s for s, _ in seen] == list(range(12))  # the job's own numbering, from its start
    # Dormant: no mode, no module hooks; only the clock's two optimizer hooks.
    assert all(h == (before[0], before[1], before[2], before[3] + 1) for _, h in seen)
    assert events == [] and a.armed_periods == 0 and a.tracer is None
    assert hooks_and_modes() == before and current_agent() is None


def test_arm_for_the_next_3_steps_at_step_20_then_dormant_again():
    baseline_threads = None
    a, events = agent()
    states = {}

    def on_step(i: int) -> None:
        nonlocal baseline_threads
        states[i] = (hooks_and_modes(), {t.name for t in threading.enumerate()})
        if i == 20:
            baseline_threads = states[i][1]
            a._cmd_arm({"next": 3}, b"recorder")  # as the control thread would, mid-step

    try:
        losses = train(30, on_step=on_step)
    finally:
        a.stop()
    assert losses == train(30)
    assert traced_steps(events) == [21, 22, 23]  # numbered as the job counts
    marks = [(e["state"], e["step"], e["released"]) for e in events if e["kind"] == TRACING]
    assert marks == [(TRACED, 21, []), (DORMANT, 24, [1])]
    # Each traced step begins with its own forward: the update of step 20 is not in it.
    first_ops = {
        s: next(e["name"] for e in events if e["kind"] == "op" and e["step"] == s)
        for s in (21, 22, 23)
    }
    assert set(first_ops.values()) == {"torch.randn"}
    # Dormant again: no mode, no module hooks, no thread of the tracer's left.
    assert states[25][0] == states[20][0] == states[5][0]
    assert states[25][1] == baseline_threads
    assert states[22][0][0] == states[20][0][0] + 1  # armed: our mode on the stack


def test_a_ui_holds_tracing_while_its_lease_lasts_and_takes_its_breakpoints_with_it():
    from torchscope.tracer.stepper import Stepper

    a, events = agent(lease=0.3)
    a.stepper = Stepper(lease_seconds=0.3, note=lambda text: None)

    def on_step(i: int) -> None:
        if i == 3:
            a._cmd_arm({"next": None}, b"ui")
            a.stepper.add_breakpoint({"op": "^never$"}, owner=b"ui")
        if i in (4, 5, 6):
            a._contact(b"ui", "ping")  # pings renew the lease
        if i == 7:
            # the publisher's tick, until this UI's lease (0.3 s) has passed: it went silent
            _until(lambda: _expired(a), timeout=60)

    try:
        train(10, on_step=on_step)
    finally:
        a.stop()
    assert traced_steps(events) == [4, 5, 6, 7]
    assert a.stepper.breakpoints == {}  # its breakpoint went with it


def test_ui_breakpoints_go_when_the_ui_disarms_command_line_ones_stay():
    a, _ = agent(breakpoints=[{"op": "^never$"}])
    try:
        assert a.stepper is not None
        a._cmd_arm({"next": None}, b"ui-1")
        a.stepper.add_breakpoint({"op": "^Tensor.mul$"}, owner=b"ui-1")
        a._cmd_arm({"next": None}, b"ui-2")
        a.stepper.add_breakpoint({"op": "^Tensor.div$"}, owner=b"ui-2")
        a._cmd_disarm({}, b"ui-1")
        ops = sorted(bp.op for bp in a.stepper.breakpoints.values())
        assert ops == ["^Tensor.div$", "^never$"]
    finally:
        a.stop()


def test_a_breakpoint_set_on_a_dormant_job_hits_in_its_next_step():
    a, events = agent()
    assert a.stepper is None  # live=False: no stepper; give it one as a UI would find
    from torchscope.tracer.stepper import Stepper

    a.stepper = Stepper(lease_seconds=0.2, note=lambda text: None)
    hits = []
    a.stepper.at_point = lambda point: hits.append(point.event.get("step")) or "continue"

    def on_step(i: int) -> None:
        if i == 5:
            a._cmd_arm({"next": None}, b"ui")
            a.stepper.add_breakpoint({"op": "^torch.nn.functional.mse_loss$"}, owner=b"ui")

    try:
        train(8, on_step=on_step)
    finally:
        a.stop()
    assert hits[0] == 6 and traced_steps(events)[0] == 6


def test_jobs_without_an_optimizer_count_a_step_per_backward():
    gc.collect()  # optimizers of earlier tests, if any are still waiting to be freed
    model = models.mlp()
    a, events = agent()

    def step(i: int) -> None:
        if i == 4:
            a._cmd_arm({"next": 2}, b"rec")
        loss = model(torch.randn(2, 8)).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():  # the update by hand, as word_language_model does
                p.data.add_(p.grad, alpha=-0.01)
                p.grad = None

    try:
        numbers = []
        for i in range(8):
            step(i)
            numbers.append(a.clock.step)
    finally:
        a.stop()
    # The boundary after backward() is taken at the next module call: the hand-written
    # update still belongs to its own step.
    assert numbers == [0, 1, 2, 3, 4, 5, 6, 7]
    # Asked after step 3's backward, before step 4's first module call: that call is the
    # boundary, so step 4 is the first traced one.
    assert traced_steps(events) == [4, 5]
    assert a.clock.counted_by == "backward"


def test_a_job_that_updates_by_hand_beside_an_optimizer_it_never_steps_counts_its_loop():
    """An optimizer built and never stepped (kept for its state dict, a scheduler): the
    weights written between two backward() calls show the loop updates by hand, and from
    then on every backward() ends a step, numbered as the loop's iterations."""
    gc.collect()
    model = models.mlp()
    idle = torch.optim.SGD(model.parameters(), lr=0.01)
    a, _ = agent()
    numbers = []
    try:
        for _ in range(6):
            model(torch.randn(2, 8)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.01)
                    p.grad = None
            numbers.append(a.clock.step)
    finally:
        a.stop()
    # Step 0 ends when the second backward() shows the weights changed; from then on as in a
    # job without an optimizer (each update by hand belongs to the step numbered as its loop).
    assert numbers == [0, 1, 2, 3, 4, 5]
    assert a.steps_seen() == (6, 0)  # the last step ended at its backward()
    assert a.clock.counted_by == "backward"
    del idle


def test_gradient_accumulation_counts_optimizer_steps_from_the_first_micro_batch():
    """The job holds its optimizer when the first backward() ends: micro-batches are never
    steps, so a trace from the start numbers each step once (it numbered the first step's
    micro-batches 0, 1, 2, 3, then the optimizer renumbered, and two steps were "1")."""
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    events: list = []
    a = Agent(ServeOptions(live=False, steps="all"))
    a.sinks.append(events.extend)  # before start(): tracing begins there, at step 0
    a.start()
    try:
        for _ in range(3):
            for _micro in range(4):
                model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert a.clock.step == 3
    finally:
        a.stop()
    graphs = [(e["step"], e["backward"]) for e in events if e["kind"] == "graph"]
    assert graphs == [(step, b) for step in range(3) for b in range(1, 5)]


def test_an_optimizer_built_after_the_first_backwards_renumbers_the_steps():
    gc.collect()  # optimizers of earlier tests, if any are still waiting to be freed
    model = models.mlp()
    a, _ = agent()
    try:
        for _micro in range(4):  # a warm-up with no optimizer yet: a step per backward
            model(torch.randn(2, 8)).sum().backward()
        model(torch.randn(2, 8))
        assert a.clock.step == 4
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            opt.step()
            opt.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
        assert a.clock.step == 2  # counted as the optimizer counts
    finally:
        a.stop()


def test_manual_steps_and_resuming_at_a_step_number():
    model = models.mlp()
    a, events = agent(steps="101-102")
    try:
        torchscope.step(100)  # resumed from a checkpoint at step 100
        for _ in range(4):
            model(torch.randn(2, 8)).sum().backward()
            for p in model.parameters():
                p.grad = None
            torchscope.step()  # the script's own calls, not backward(), end its steps
    finally:
        a.stop()
    assert a.clock.step == 104 and a.clock.counted_by == "torchscope.step"
    assert traced_steps(events) == [101, 102]

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a, _ = agent()
    try:
        torchscope.step(7)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
    finally:
        a.stop()
    assert a.clock.step == 10  # optimizer steps count on from the number given


def test_arming_while_the_job_sits_in_optimizer_step_starts_at_the_next_step():
    model = models.mlp()
    a, events = agent()

    class ArmingSGD(torch.optim.SGD):
        """An arm request arriving while the update runs."""

        def step(self, closure=None):
            if a.clock.step == 2:
                a._cmd_arm({"next": 1}, b"rec")
            return super().step(closure)

    opt = ArmingSGD(model.parameters(), lr=0.01)
    try:
        for _ in range(5):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        a.stop()
    assert traced_steps(events) == [3]
    names = [e["name"] for e in events if e["kind"] == "op"]
    assert names[0] == "torch.randn" and "Tensor.add_" not in names  # no update ops


def test_arming_while_the_job_waits_in_a_dataloader():
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a, events = agent()

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int):
            if i == 6:
                a._cmd_arm({"next": 2}, b"rec")  # arrives while the batch is being made
            return torch.full((8,), float(i))

    try:
        for batch in torch.utils.data.DataLoader(Data(), batch_size=2):
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        a.stop()
    assert traced_steps(events) == [4, 5]  # batch 3 (items 6, 7) was being made in step 3


def test_serve_is_idempotent_and_a_trace_block_keeps_working_beside_it():
    a = torchscope.serve(quiet=True)
    try:
        assert torchscope.serve() is a and current_agent() is a
        model = models.mlp()
        with torchscope.trace() as tr:
            model(torch.randn(2, 8)).sum().backward()
        assert tr.ops and tr.grads
    finally:
        a.stop()


def _job_thread(a: Agent, go: threading.Event, steps: int = 3) -> threading.Thread:
    def body() -> None:
        a.start()  # the training thread owns the clock
        try:
            go.wait(60)
            model = models.mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(steps):
                F.relu(model(torch.ones(2, 8))).sum().backward()
                opt.step()
        finally:
            a.stop()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def _expired(a: Agent) -> bool:
    """The publisher's tick (leases); whether no client holds the job any more."""
    a._expire_leases()
    return not a.holders.describe()


def _until(cond, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_recorder_is_not_a_ui_for_wait_or_for_pauses(monkeypatch):
    """A recorder that comes and goes does not end --wait; the last UI quitting ends a
    command-line breakpoint's pause at once although a recorder is still attached (it held
    the job for the whole lease, 'its UI stopped responding')."""
    from test_stepping import WakeCounter

    from torchscope.protocol.breakpoints import parse_break_spec
    from torchscope.tracer.stepper import Stepper

    init = Stepper.__init__

    def counting(self, *args, **kwargs) -> None:  # the agent's stepper counts its wakes
        init(self, *args, **kwargs)
        self._cv = WakeCounter()

    monkeypatch.setattr(Stepper, "__init__", counting)
    go = threading.Event()
    go.set()
    a = Agent(ServeOptions(live=False, wait=True, lease=30))
    job = _job_thread(a, go)
    _until(lambda: a.stepper is not None and a.stepper.paused is not None)
    a._cmd_arm({"by": "record"}, b"rec")
    a._cmd_disarm({}, b"rec")
    cv = a.stepper._cv
    with cv:  # the waiting thread looks again: it still waits (a UI never came)
        woke = cv.woke
        cv.notify_all()

    def looked() -> bool:
        with cv:
            return cv.woke > woke

    _until(looked, timeout=60)
    assert a.stepper.paused is not None and a.stepper.paused.reason == "waiting for a UI"
    a._cmd_arm({"by": "ui"}, b"ui")  # a UI: the job goes on
    job.join(20)
    assert not job.is_alive()

    go = threading.Event()
    a = Agent(ServeOptions(live=False, breakpoints=[parse_break_spec("op:relu")], lease=30))
    job = _job_thread(a, go, steps=1)
    _until(lambda: a.started)
    a._cmd_arm({"by": "record"}, b"rec")
    a._cmd_arm({"by": "ui"}, b"ui")
    go.set()
    _until(lambda: a.stepper.paused is not None)
    first = a.stepper.paused
    a._cmd_disarm({}, b"ui")  # q in the UI; the recorder stays
    _until(lambda: a.stepper.paused is not first, timeout=20)  # not the 30 s lease
    assert a.stepper.auto_resumed == 0
    a._cmd_detach({}, b"rec")  # the command line's breakpoint goes: the job runs out
    job.join(20)
    assert not job.is_alive()


def test_numbering_a_step_with_its_own_number_changes_nothing():
    """A framework callback that numbers each step by its global step (equal to the count
    already) makes no second boundary: `record --next 2` still records two whole steps."""
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a, events = agent()
    try:
        a._cmd_arm({"next": 2, "by": "record"}, b"rec")
        for _ in range(5):
            torchscope.step(a.clock.step)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
    finally:
        a.stop()
    assert a.clock.step == 5
    assert traced_steps(events) == [1, 2]


def test_a_live_agent_serves_its_commands_from_the_moment_a_ui_can_find_it(monkeypatch):
    """The publisher registers the session (a UI finds it in ``ls``) as it starts: the
    stepper's and the agent's commands are in place by then. (They once came after: a UI
    that connected at once had its first ``state`` refused as not supported.)"""
    from torchscope.tracer.publisher import EventPublisher

    at_start: dict = {}
    real_start = EventPublisher.start

    def start(self):
        at_start.update(commands=set(self.commands), on_request=self.on_request)
        return real_start(self)

    monkeypatch.setattr(EventPublisher, "start", start)
    a = Agent(ServeOptions(live=True, quiet=True)).start()
    try:
        assert a.publisher is not None
    finally:
        a.stop()
    assert {"state", "continue", "arm", "disarm", "history"} <= at_start["commands"]
    assert at_start["on_request"] is not None
