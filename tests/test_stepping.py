"""Step-through debugging: breakpoints, pause/step/next/continue, inspection, the lease.

In-process tests run the "training" on a worker thread (the thread that starts tracing is the
one that pauses) and drive the stepper from the test thread, the way the control thread does.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable

import pytest
import torch

from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec
from torchscope.tracer.armed.session import Tracer


def line_of(func: Callable, needle: str) -> str:
    lines, first = inspect.getsourcelines(func)
    (i,) = [i for i, s in enumerate(lines) if needle in s]
    return f"{inspect.getsourcefile(func)}:{first + i}"


class WakeCounter(threading.Condition):
    """A stepper's lock and condition that counts the waits that returned: how often its
    paused thread woke and looked again."""

    def __init__(self) -> None:
        super().__init__()
        self.woke = 0

    def wait(self, timeout: float | None = None) -> bool:
        try:
            return super().wait(timeout)
        finally:
            self.woke += 1  # the lock is held again here


class StepperClock:
    """The clock of a job's stepper, moved on by the test: a pause that must outlast its
    lease is checked without waiting the lease out. Make it before the job starts."""

    def __init__(self, job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
        from torchscope.tracer import stepper as stepper_module

        self.offset = 0.0
        clock = self

        class Time:  # the ``time`` the stepper module sees
            def __getattr__(self, name: str) -> object:
                return getattr(time, name)

            def monotonic(self) -> float:
                return time.monotonic() + clock.offset

        monkeypatch.setattr(stepper_module, "time", Time())
        self.cv = job.stepper._cv = WakeCounter()

    def pass_time(self, seconds: float) -> None:
        """Move the clock on by ``seconds``, wake the paused thread and wait (a poll) until
        it has looked again: a lease that applied has ended by then."""
        with self.cv:
            woke = self.cv.woke
            self.offset += seconds
            self.cv.notify_all()
        deadline = time.monotonic() + 60
        while True:
            with self.cv:
                if self.cv.woke > woke:
                    return
            assert time.monotonic() < deadline, "the paused thread never woke"
            time.sleep(0.005)


class Job(threading.Thread):
    """Runs ``body`` traced on its own thread; the test thread plays the UI."""

    def __init__(self, body: Callable[[], object], **tracer_args: object) -> None:
        super().__init__(daemon=True)
        self.body = body
        self.tracer = Tracer(live=False, **tracer_args)  # type: ignore[arg-type]
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.tracer:
                self.result = self.body()
        except BaseException as exc:  # surfaced by finish()
            self.error = exc

    @property
    def stepper(self):
        return self.tracer.stepper

    def wait_paused(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            point = self.stepper.paused
            if point is not None:
                return point.describe()
            assert self.is_alive(), f"job ended without pausing ({self.error!r})"
            time.sleep(0.005)
        raise AssertionError("the job did not pause")

    def wait_running(self, previous: dict, timeout: float = 60.0) -> None:
        """Until the pause ``previous`` is over (the job may pause again right after)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            point = self.stepper.paused
            if point is None or point.since != previous["since"]:
                return
            time.sleep(0.005)
        raise AssertionError("the job did not resume")

    def finish(self, timeout: float = 30.0):
        self.join(timeout)
        assert not self.is_alive(), "the job is still running"
        if self.error is not None:
            raise self.error
        return self.result


def name_of(point: dict) -> str:
    ev = point["event"]
    return ev.get("name") or ev.get("node")


def two_layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    out = (h / 2).sum()
    out.backward()
    return out


def make_inputs():
    torch.manual_seed(0)
    return torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)


def test_break_spec_parsing():
    assert parse_break_spec("nan") == {"nan": "nan"}
    assert parse_break_spec("op:^Tensor.div$") == {"op": "^Tensor.div$"}
    assert parse_break_spec(r"module:^blocks\.3\.,nan") == {"module": r"^blocks\.3\.", "nan": "nan"}
    assert parse_break_spec("op:a{1,3},step:4") == {"op": "a{1,3}", "step": 4}
    assert parse_break_spec("line:train.py:12,from:2") == {"source": "train.py:12", "from_step": 2}
    assert parse_break_spec("gradnorm:1e3") == {"grad_norm": 1000.0}
    for bad in ("", "nope", "op:(", "step:x", "line:12", "gradnorm:big", "nan,infinity"):
        with pytest.raises(BreakpointError) as err:
            parse_break_spec(bad)
        assert "\n" not in str(err.value)


def test_op_breakpoint_pauses_before_then_step_shows_outputs_then_continue():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": r"^torch\.relu$"}])
    job.start()
    before = job.wait_paused()
    assert (before["phase"], name_of(before), before["reason"]) == (
        "before",
        "torch.relu",
        "breakpoint 1",
    )
    assert before["event"]["source"] == line_of(two_layer, "torch.relu")
    assert before["event"]["inputs"][0]["shape"] == [3, 5]
    assert before["stack"][0][0].endswith("test_stepping.py")  # the training thread's frames
    with pytest.raises(BreakpointError, match="no 'outputs'"):
        job.stepper.inspect("outputs", 0)
    ins = job.stepper.inspect("inputs", 0, start=0, count=4)
    assert ins["values"] == pytest.approx((x @ w).reshape(-1)[:4].tolist())

    job.stepper.request_step()  # the same op, run: its outputs
    job.wait_running(before)
    after = job.wait_paused()
    assert (after["phase"], name_of(after), after["reason"]) == ("after", "torch.relu", "step")
    out = job.stepper.inspect("outputs", 0, count=100)
    assert out["shape"] == [3, 5] and min(out["values"]) >= 0.0 and out["numel"] == 15

    job.stepper.request_step()  # one more op, complete
    job.wait_running(after)
    nxt = job.wait_paused()
    assert (nxt["phase"], name_of(nxt)) == ("after", "Tensor.div")

    job.stepper.request_continue()
    result = job.finish()
    assert torch.equal(result, (torch.relu(x @ w) / 2).sum().detach())
    kinds = [e.kind for e in job.tracer.events]
    assert kinds.count("pause") == 3 and kinds.count("resume") == 3


def test_step_walks_into_backward_node_by_node():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": "^SumBackward0$"}])
    job.start()
    first = job.wait_paused()
    # a node breakpoint by name stops before the node runs: what arrives is known
    assert (first["phase"], name_of(first)) == ("before", "SumBackward0")
    assert first["event"]["grad_outputs"][0]["values"] == [1.0]
    assert job.stepper.inspect("grad_outputs", 0)["values"] == [1.0]
    seen = []
    point = first
    for _ in range(4):
        job.stepper.request_step()
        job.wait_running(point)
        point = job.wait_paused()
        seen.append((point["phase"], name_of(point)))
    assert seen == [
        ("after", "SumBackward0"),
        ("after", "DivBackward0"),
        ("after", "ReluBackward0"),
        ("after", "MmBackward0"),
    ]
    gi = job.stepper.inspect("grad_inputs", 1, count=1000)  # MmBackward0's grad for w
    job.stepper.request_continue()
    job.finish()
    assert gi["values"] == pytest.approx(w.grad.reshape(-1).tolist())


def nan_model(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    z = torch.log(y - 100.0)  # NaN: log of a negative number
    return (z * 3).sum()


def test_nan_breakpoint_stops_at_the_origin_only():
    x = torch.randn(5)
    job = Job(lambda: nan_model(x), breakpoints=[parse_break_spec("nan")])
    job.start()
    point = job.wait_paused()
    assert (point["phase"], name_of(point)) == ("after", "torch.log")
    assert point["event"]["source"] == line_of(nan_model, "torch.log")
    assert point["event"]["outputs"][0]["stats"]["nan"] == 5
    job.stepper.request_continue()
    job.finish()
    assert [e.kind for e in job.tracer.events].count("pause") == 1  # not the downstream ops


def test_anynan_stops_at_every_op_with_nan_and_conditions_combine():
    x = torch.randn(5)
    job = Job(lambda: nan_model(x), breakpoints=[parse_break_spec("anynan,op:^Tensor")])
    job.start()
    names = []
    for _ in range(2):
        point = job.wait_paused()
        names.append(name_of(point))
        job.stepper.request_continue()
        job.wait_running(point)
    job.finish()
    assert names == ["Tensor.mul", "Tensor.sum"]  # torch.log has NaN but is not Tensor.*


def test_source_line_grad_norm_and_step_conditions():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(8, 4) * 10).pow(2).mean()
            loss.backward()
            opt.step()

    line = line_of(train, "model(torch.randn")
    job = Job(
        train,
        breakpoints=[
            {"source": line.rsplit("/", 1)[-1], "module": "^1$", "step": 1},
            {"grad_norm": 1.0, "from_step": 2},
        ],
    )
    job.start()
    first = job.wait_paused()
    assert first["reason"] == "breakpoint 1" and first["event"]["step"] == 1
    # the pause carries the breakpoint as set: a UI need not have its list yet
    assert first["breakpoint"]["id"] == 1 and first["breakpoint"]["module"] == "^1$"
    assert first["event"]["module"] == "1" and name_of(first) == "torch.nn.functional.linear"
    job.stepper.request_continue()
    job.wait_running(first)
    # the same line and module also name the backward nodes that op created: they stop too
    nodes = []
    point = job.wait_paused()
    while point["reason"] == "breakpoint 1":
        assert point["phase"] == "before" and point["event"]["module"] == "1"
        nodes.append(name_of(point))
        job.stepper.request_continue()
        job.wait_running(point)
        point = job.wait_paused()
    assert sorted(nodes) == ["AddmmBackward0", "TBackward0"]
    second = point
    assert second["reason"] == "breakpoint 2" and second["event"]["step"] == 2
    assert second["breakpoint"]["grad_norm"] == 1.0
    assert second["event"]["kind"] == "grad"
    norms = [
        s["stats"]["norm"]
        for s in second["event"]["grad_inputs"] + second["event"]["grad_outputs"]
        if s
    ]
    assert max(norms) > 1.0
    job.stepper.detach()  # forgets every breakpoint: no more stops
    job.finish()
    assert job.stepper.breakpoints == {}


def test_a_breakpoint_on_the_backward_line_stops_before_it_runs_with_the_loss_as_x():
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)

    def train():
        loss = (w * 3).pow(2).mean()
        loss.backward()
        return loss

    line = line_of(train, "loss.backward()")
    job = Job(train, breakpoints=[{"source": line.rsplit("/", 1)[-1]}])
    job.start()
    before = job.wait_paused()
    assert (before["phase"], name_of(before), before["reason"]) == (
        "before",
        "Tensor.backward",
        "breakpoint 1",
    )
    assert before["event"]["source"] == line and before["event"]["kind"] == "op"
    (shown,) = before["event"]["inputs"]  # the loss as the op that made it recorded it
    assert shown["shape"] == [] and shown["stats"]["mean"] == pytest.approx(
        (w.detach() * 3).pow(2).mean().item()
    )
    loss = job.stepper.inspect("inputs", 0)["values"]  # what the backward starts from
    assert loss == pytest.approx([(w.detach() * 3).pow(2).mean().item()])
    job.stepper.request_step()  # into the backward: its first node, run
    job.wait_running(before)
    first = job.wait_paused()
    assert (first["phase"], name_of(first), first["reason"]) == ("after", "MeanBackward0", "step")
    job.stepper.request_continue()
    job.finish()
    assert w.grad is not None and torch.allclose(w.grad, 18 * w.detach() / 4)


def test_pause_request_and_next_step():
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    go = threading.Event()
    at_step_1 = threading.Event()

    def train():
        for step in range(3):
            if step == 1:
                at_step_1.set()
                go.wait(60)
            (w * 2).sum().backward()
            opt.step()

    job = Job(train, stepping=True)
    job.start()
    assert at_step_1.wait(60), "the job never reached step 1"
    job.stepper.request_pause()
    go.set()
    point = job.wait_paused()
    assert point["reason"] == "paused" and point["event"]["step"] == 1
    job.stepper.request_next(job.tracer.step_index)
    job.wait_running(point)
    nxt = job.wait_paused()
    assert nxt["reason"] == "next step" and nxt["event"]["step"] == 2 and nxt["phase"] == "before"
    job.stepper.request_continue()
    job.finish()


def _paused_where_a_pause_lands_mid_backward(ranks_meet: bool) -> dict:
    """Where a UI's pause asked for halfway through a backward stops."""
    w = torch.ones(4, requires_grad=True)
    holder: list[Job] = []

    class AskPause(torch.autograd.Function):  # the UI's p, pressed while the backward runs
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            holder[0].stepper.request_pause()
            return g

    def train():
        (AskPause.apply(w * 2) * 3).sum().backward()
        return torch.add(w.detach(), 1)

    job = Job(train, stepping=True)
    holder.append(job)
    job.tracer.gate(ranks_meet, "")  # a single process: there is nobody to meet
    job.start()
    point = job.wait_paused()
    job.stepper.request_continue()
    job.finish()
    return point


def test_a_pause_asked_during_the_backward_of_ranks_that_meet_waits_until_it_ends():
    # Alone, the pause stops at once: after the node it was asked in.
    alone = _paused_where_a_pause_lands_mid_backward(ranks_meet=False)
    assert alone["event"]["kind"] == "grad" and name_of(alone) == "AskPauseBackward"
    # Ranks that meet before every backward: another rank may already wait in this backward's
    # all-reduce, in C++, for this one, so the pause stops at the first op after it.
    ranks = _paused_where_a_pause_lands_mid_backward(ranks_meet=True)
    assert (ranks["phase"], name_of(ranks)) == ("before", "Tensor.detach"), ranks["event"]


def test_lease_resumes_a_job_nobody_attends(capfd):
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": "relu"}], lease=0.5)
    t0 = time.monotonic()
    job.start()
    job.finish()
    assert 0.4 < time.monotonic() - t0 < 10
    resumes = [e for e in job.tracer.events if e.kind == "resume"]
    assert [e.by for e in resumes] == ["lease"]
    assert "resumed by itself after 0.5 s: no UI is attached" in capfd.readouterr().err


def test_wait_blocks_before_the_first_op_until_a_ui_arrives(monkeypatch):
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), wait=True, lease=0.5)
    clock = StepperClock(job, monkeypatch)
    job.start()
    point = job.wait_paused()
    assert point["phase"] == "before" and point["reason"] == "waiting for a UI"
    clock.pass_time(1.0)  # longer than the lease: --wait is not subject to it before a UI comes
    assert job.stepper.paused is not None
    job.stepper.contact()
    job.stepper.request_continue()
    job.finish()


# -- over the wire: a real job, a real control channel ----------------------------------------
NAN_JOB = """
import torch
torch.manual_seed(0)
x = torch.randn(4, 3, requires_grad=True)
for step in range(3):
    y = torch.log(x - 10.0)  # NaN origin
    y.sum().backward()
print("finished", flush=True)
"""

UI_THAT_DIES = """
import sys, time
from torchscope.protocol.client import SessionClient
deadline = time.monotonic() + 120  # the job may not have registered yet (torch loading)
while True:
    c = SessionClient()
    try:
        c.connect(sys.argv[1])
        break
    except Exception:
        c.close()
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
def paused_at_a_breakpoint():  # not at --wait's pause before the first op, which this ends
    paused = c.request("state", timeout=30)["state"]["paused"]
    return paused is not None and paused["reason"] != "waiting for a UI"
while not paused_at_a_breakpoint():
    time.sleep(0.05)
print("paused", flush=True)
time.sleep(60)  # killed while the job waits on us
"""


def _job(tmp_path, *args: str):
    import subprocess
    import sys

    script = tmp_path / "nanjob.py"
    script.write_text(NAN_JOB)
    return subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", *args, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_paused(client, timeout: float = 30.0, after: dict | None = None) -> dict:
    """The job's state once it is paused (at a pause other than ``after``'s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.request("state", timeout=10)["state"]
        paused = state["paused"]
        if paused is not None and (after is None or paused["since"] != after["paused"]["since"]):
            return state
        time.sleep(0.05)
    raise AssertionError("the job did not pause")


def _connect(pid: int, timeout: float = 120.0):
    """A client of the job ``pid``, once it has registered (loading torch on a loaded machine
    has taken over 30 s)."""
    from torchscope.protocol.client import SessionClient, SessionUnreachable
    from torchscope.protocol.runtime import EndpointError

    deadline = time.monotonic() + timeout
    while True:
        client = SessionClient()
        try:
            client.connect(str(pid))
            return client
        except (SessionUnreachable, EndpointError):
            client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_break_on_nan_over_the_wire_step_continue_and_bad_messages(tmp_path):
    import zmq

    from torchscope.protocol.client import SessionRefused
    from torchscope.protocol.codec import pack

    job = _job(tmp_path, "--break-on", "nan", "--lease", "30")
    client = _connect(job.pid)
    try:
        state = _wait_paused(client)
        point = state["paused"]
        assert point["event"]["name"] == "torch.log" and point["phase"] == "after"
        assert point["event"]["source"].endswith("nanjob.py:6")
        assert point["stack"][0][0].endswith("nanjob.py") and point["stack"][0][1] == 6
        got = client.request("inspect", group="outputs", index=0, count=3)
        assert got["numel"] == 12 and len(got["values"]) == 3

        # malformed and refused messages: an error each, and nothing changes
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(client.control_endpoint)
        for junk in (b"", b"\xff\xfe", b"\x93\x01\x02\x03", b"\x81\xa1v\xc0" * 10, b"x" * 70000):
            raw.send(junk)
        replies = []
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        while len(replies) < 4 and poller.poll(2000):
            replies.append(raw.recv())
        raw.close()
        assert len(replies) >= 4
        for bad in (
            {"cmd": "break_add", "op": "("},
            {"cmd": "break_enable", "bp": 99, "enabled": True},
            {"cmd": "inspect", "group": "nothing", "index": 0},
        ):
            cmd = bad.pop("cmd")
            with pytest.raises(SessionRefused):
                client.request(cmd, **bad)

        def unchanged(st: dict) -> bytes:  # NaN-safe equality; only the pause's age moves on
            return pack({k: v for k, v in st.items() if k != "paused_s"})

        assert unchanged(client.request("state")["state"]) == unchanged(state)

        client.request("step")
        nxt = _wait_paused(client, after=state)  # the op after torch.log, complete
        assert nxt["paused"]["event"]["name"] == "Tensor.sum"
        client.request("detach")
        out, _err = job.communicate(timeout=60)
        assert job.returncode == 0 and "finished" in out
    finally:
        client.close()
        job.kill()


def test_killed_ui_while_paused_lets_the_job_finish(tmp_path):
    import signal
    import subprocess
    import sys

    # --wait: the job waits for the UI before its first op, so that its NaN pause comes with
    # the UI attached (without it, a loaded machine could start the UI after the unattended
    # pause's 2 s lease had run out, and the UI would never see the job paused).
    job = _job(tmp_path, "--wait", "--break-on", "nan", "--lease", "2")
    ui_script = tmp_path / "ui.py"
    ui_script.write_text(UI_THAT_DIES)
    ui = subprocess.Popen(
        [sys.executable, str(ui_script), str(job.pid)], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line:
            line = ui.stdout.readline().strip()
        assert line == "paused"
        ui.send_signal(signal.SIGKILL)
        ui.wait(10)
        t0 = time.monotonic()
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0 and "finished" in out
        assert time.monotonic() - t0 < 30
        assert "resumed by itself after 2 s" in err
    finally:
        ui.kill()
        job.kill()


def test_breakpoint_list_enable_disable_delete_change_what_stops():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), stepping=True)
    st = job.stepper
    relu = st.add_breakpoint({"op": "relu"})
    div = st.add_breakpoint({"op": "^Tensor.div$"})
    assert [b["id"] for b in st.state()["breakpoints"]] == [relu["id"], div["id"]]
    st.set_enabled(relu["id"], False)
    st.delete_breakpoint(div["id"])
    with pytest.raises(BreakpointError, match="no breakpoint"):
        st.delete_breakpoint(div["id"])
    assert not st.active  # only a disabled breakpoint left: no stepping work at all
    st.set_enabled(relu["id"], True)
    job.start()
    point = job.wait_paused()
    assert name_of(point) == "torch.relu"
    assert st.state()["breakpoints"] == [{"op": "relu", "enabled": True, "id": 1, "hits": 1}]
    st.request_continue()
    job.finish()


def test_an_aten_breakpoint_stops_before_the_call_and_a_step_shows_its_outputs():
    """With the aten level on, ``aten:REGEX`` stops before the call inside its op (forward)
    or node (backward); `s` from there runs it; op breakpoints and pauses keep to ops."""
    x, w = make_inputs()
    job = Job(
        lambda: two_layer(x, w),
        breakpoints=[parse_break_spec(r"aten:^aten\.(relu|threshold_backward)")],
        aten=True,
    )
    job.start()
    before = job.wait_paused()
    event = before["event"]
    assert (before["phase"], event["kind"], event["name"], before["reason"]) == (
        "before",
        "aten",
        "aten.relu.default",
        "breakpoint 1",
    )
    job.stepper.request_step()  # the call runs: its outputs
    job.wait_running(before)
    after = job.wait_paused()
    assert (after["phase"], after["event"]["name"], after["reason"]) == (
        "after",
        "aten.relu.default",
        "step",
    )
    assert after["event"]["outputs"][0]["shape"] == [3, 5]
    out = job.stepper.inspect("outputs", 0, count=100)
    assert min(out["values"]) >= 0.0
    job.stepper.request_continue()
    job.wait_running(after)
    backward = job.wait_paused()
    assert (backward["phase"], backward["event"]["name"], backward["event"]["node"]) == (
        "before",
        "aten.threshold_backward.default",
        "ReluBackward0",
    )
    job.stepper.request_continue()
    result = job.finish()
    assert torch.equal(result, (torch.relu(x @ w) / 2).sum().detach())
    assert parse_break_spec("aten:mm") == {"aten": "mm"}


def run_to_end(job: Job) -> list[dict]:
    """Let the job run on, continuing every pause; the pauses it made on the way."""
    pauses = []
    while True:
        point = job.stepper.paused
        if point is not None:
            pauses.append(point.describe())
            job.stepper.request_continue()
            job.wait_running(pauses[-1])
        elif not job.is_alive():
            return pauses
        time.sleep(0.005)


def test_a_nan_breakpoint_stops_once_at_the_aten_call_that_made_the_value():
    """With the aten level on, ``nan``/``inf`` stop after the aten call where the value first
    appears (log_softmax inside cross_entropy; div inside SqrtBackward0), and not again at the
    op or node it ran for."""
    import torch.nn.functional as F

    logits = torch.zeros(2, 5, requires_grad=True)
    mask = torch.tensor([[True] * 5, [False] * 5])
    target = torch.tensor([1, 3])
    x = torch.tensor([0.0, 1.0], requires_grad=True)

    def body():
        F.cross_entropy(logits.masked_fill(mask, float("-inf")), target)  # NaN, forward
        x.sqrt().sum().backward()  # Inf, backward: 1 / (2 * sqrt(0))
        return x.grad

    job = Job(body, breakpoints=[parse_break_spec("nan"), parse_break_spec("inf")], aten=True)
    job.start()
    forward = job.wait_paused()
    ev = forward["event"]
    assert (forward["phase"], ev["kind"], ev["name"], ev["op"], forward["reason"]) == (
        "after",
        "aten",
        "aten._log_softmax.default",
        "torch.nn.functional.cross_entropy",
        "breakpoint 1",
    )
    assert ev["outputs"][0]["stats"]["nan"] == 5
    job.stepper.request_continue()
    job.wait_running(forward)
    rest = run_to_end(job)
    assert [(p["event"]["name"], p["event"].get("node"), p["reason"]) for p in rest] == [
        ("aten.div.Tensor", "SqrtBackward0", "breakpoint 2")
    ]
    assert torch.isinf(job.finish()).any()
    hits = [bp["hits"] for bp in job.stepper.state()["breakpoints"]]
    assert hits == [1, 1]
