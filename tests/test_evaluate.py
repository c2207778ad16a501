"""Ask and change at a pause: expressions over the paused event's tensors, edits of an op's
output and of a node's gradients, logpoints and edits at every hit (``--log``/``--edit``).

In-process tests run the traced body on a worker thread (the one that pauses) and send the
control commands from the test thread, as the publisher's thread does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from test_stepping import Job, _connect, make_inputs, name_of, two_layer

from torchscope.protocol.breakpoints import BreakpointError, action_spec, parse_break_spec
from torchscope.protocol.expressions import (
    ExpressionError,
    answer_text,
    evaluate_kept,
    split_edit,
)
from torchscope.tracer.stepper import stepping_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(ROOT, "examples", "seed_grads.py")


def commands(job: Job) -> dict:
    return stepping_commands(job.stepper, lambda: 0)


def ask(job: Job, cmd: str, **args):
    base = {"group": None, "index": None, "count": 16, "poll": None}
    if cmd == "edit":
        base.pop("count")
    return commands(job)[cmd]({**base, **args}, None)


# -- the seed's own case, from the command line ------------------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--no-live", *args, SEED],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_seed_edit_of_div_backward_makes_the_gradient_3():
    done = _run("--edit", "node:^DivBackward0$", "grad_inputs[0] * 2")
    assert done.returncode == 0, done.stderr
    assert "d out/dx = 3\n" in done.stdout  # Mul's 2 + Div's 0.5 doubled
    assert "this run's numbers are changed by hand" in done.stderr


def test_seed_log_of_mul_backward_prints_2_and_changes_nothing():
    done = _run("--log", "node:^MulBackward0$", "grad_inputs[0]")
    assert done.returncode == 0, done.stderr
    assert "d out/dx = 2.5\n" in done.stdout
    logs = [line for line in done.stderr.splitlines() if " log " in line]
    assert logs == ["torchscope: log MulBackward0 (step 0): grad_inputs[0] = 2"]


def test_log_and_edit_options_refuse_bad_input_in_one_line():
    for args, why in (
        (["--log", "node:^Mul", "grad_inputs[0"], "syntax error"),
        (["--edit", "nope", "x"], "bad breakpoint condition"),
        (["--edit", "op:relu", "args[0] = x"], "cannot edit"),
    ):
        done = _run(*args)
        assert done.returncode == 2 and why in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_specs_with_an_action_and_node_condition():
    assert parse_break_spec("node:^MulBackward0$") == {"node": "^MulBackward0$"}
    assert parse_break_spec("op:relu,log:x[0, :8]") == {"op": "relu", "log": "x[0, :8]"}
    assert action_spec("edit", "node:Div", "grad_inputs[0] * 2") == {
        "node": "Div",
        "edit": "grad_inputs[0] * 2",
    }
    with pytest.raises(BreakpointError, match="at least one condition"):
        parse_break_spec("log:x")
    assert split_edit("grad_inputs[1] = grad_inputs[1] * 0") == (
        "grad_inputs[1]",
        "grad_inputs[1] * 0",
    )
    assert split_edit("x == 0") == (None, "x == 0")


# -- at a pause, in process --------------------------------------------------------------------
def test_evaluate_at_an_op_pause_answers_summaries_values_reprs_and_errors():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": r"^torch\.relu$"}])
    job.start()
    before = job.wait_paused()
    job.stepper.request_step()
    job.wait_running(before)
    after = job.wait_paused()
    assert (after["phase"], name_of(after)) == ("after", "torch.relu")
    want = torch.relu(x @ w)
    got = ask(job, "evaluate", expr="x[0, :3]")
    assert got["values"] == pytest.approx(want[0, :3].tolist())
    assert got["summary"]["shape"] == [3]
    got = ask(job, "evaluate", expr="(x == 0).float().mean()")
    assert got["values"] == pytest.approx([(want == 0).float().mean().item()])
    got = ask(job, "evaluate", expr="out.shape")
    assert got["repr"] == "torch.Size([3, 5])"
    got = ask(job, "evaluate", expr="args[0].sum()")  # the op's own arguments
    assert got["values"] == pytest.approx([(x @ w).sum().item()])
    got = ask(job, "evaluate", expr="x.nope()")
    assert got["error"].startswith("AttributeError") and "\n" not in got["error"]
    assert answer_text(got).startswith("error: AttributeError")
    got = ask(job, "evaluate", expr="1/0")
    assert got["error"] == "ZeroDivisionError: division by zero"
    with pytest.raises(BreakpointError, match="syntax error"):
        ask(job, "evaluate", expr="x[")
    with pytest.raises(BreakpointError, match=r"no 'nothing'|no nothing"):
        ask(job, "evaluate", expr="x", group="nothing", index=0)
    got = ask(job, "evaluate", expr="x.requires_grad")  # under no_grad: nothing recorded
    assert got["repr"] in ("True", "False")
    job.stepper.request_continue()
    result = job.finish()
    assert torch.equal(result, (torch.relu(x @ w) / 2).sum().detach())  # untouched


def test_edit_of_an_op_output_changes_the_later_values():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": r"^torch\.relu$"}])
    job.start()
    before = job.wait_paused()
    with pytest.raises(BreakpointError, match="an op's output can be edited, once it has run"):
        ask(job, "edit", expr="x * 0")
    job.stepper.request_step()
    job.wait_running(before)
    job.wait_paused()
    with pytest.raises(BreakpointError, match=r"shape \[2\] is not outputs\[0\]'s \[3, 5\]"):
        ask(job, "edit", expr="x[0, :2]")
    with pytest.raises(BreakpointError, match="dtype float64 is not"):
        ask(job, "edit", expr="x.double()")
    done = ask(job, "edit", expr="x.clamp(max=0.5)")
    assert "->" in done["text"] and done["edit"]["target"] == "outputs[0]"
    got = ask(job, "evaluate", expr="out.max()")  # the pause sees the edited value
    assert got["values"] == pytest.approx([min(0.5, torch.relu(x @ w).max().item())])
    job.stepper.request_continue()
    result = job.finish()
    assert torch.allclose(result, (torch.relu(x @ w).clamp(max=0.5) / 2).sum())
    edits = [e for e in job.tracer.events if e.kind == "edit"]
    assert len(edits) == 1 and edits[0]["expr"] == "x.clamp(max=0.5)"
    assert edits[0]["before"][0]["shape"] == [3, 5] and edits[0]["by"] == "a UI"
    # the op that read the edited output saw its new summary
    div = next(e for e in job.tracer.events if e.kind == "op" and e["name"] == "Tensor.div")
    assert div["inputs"][0]["stats"]["max"] == pytest.approx(0.5)


def grads_body(x: torch.Tensor, y: torch.Tensor):
    def body():
        out = x * y + x / y
        return torch.autograd.grad(out, x)[0]

    return body


def test_edit_of_a_node_gradient_changes_what_flows_on():
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(4.0, requires_grad=True)
    job = Job(grads_body(x, y), breakpoints=[{"node": "^DivBackward0$"}])
    job.start()
    before = job.wait_paused()
    assert before["phase"] == "before"
    with pytest.raises(BreakpointError, match="before a node runs, its grad_outputs"):
        ask(job, "edit", expr="grad_inputs[0] = grad_outputs[0]")
    job.stepper.request_step()
    job.wait_running(before)
    after = job.wait_paused()
    assert (after["phase"], name_of(after)) == ("after", "DivBackward0")
    assert ask(job, "evaluate", expr="grad_inputs[0]")["values"] == [0.25]  # 1/y
    with pytest.raises(BreakpointError, match="grad_inputs\\[1\\] is None"):
        ask(job, "edit", expr="grad_inputs[1] = grad_outputs[0]")
    ask(job, "edit", expr="grad_inputs[0] * 10")
    job.stepper.request_continue()
    gx = job.finish()
    assert gx.item() == pytest.approx(4.0 + 2.5)  # d(x*y)/dx = y = 4, plus Div's 0.25 * 10


def test_edit_of_grad_outputs_before_a_node_runs():
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(4.0, requires_grad=True)
    job = Job(grads_body(x, y), breakpoints=[{"node": "^MulBackward0$"}])
    job.start()
    job.wait_paused()
    ask(job, "edit", expr="grad_outputs[0] = grad_outputs[0] * 3")
    job.stepper.request_continue()
    gx = job.finish()
    assert gx.item() == pytest.approx(4.0 * 3 + 0.25)


def test_a_slow_expression_answers_pending_and_keeps_the_pause():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": r"^torch\.relu$"}], lease=4)
    job.start()
    job.wait_paused()
    job.stepper.contact("ui")  # a UI attached: its lease counts
    handler = stepping_commands(job.stepper, lambda: 0)["evaluate"]
    args = {"expr": "__import__('time').sleep(5) or 7", "group": None, "index": None}
    first = handler({**args, "count": 16, "poll": None}, "ui")
    assert first["pending"] and "still running" in first["text"]
    deadline = time.monotonic() + 30
    while True:
        job.stepper.contact("ui")
        got = handler({"expr": None, "count": 16, "poll": first["pending"]}, "ui")
        if not got.get("pending"):
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert got["repr"] == "7"
    assert job.stepper.paused is not None  # the lease did not end the pause meanwhile
    assert job.stepper.auto_resumed == 0
    job.stepper.request_continue()
    job.finish()


def test_a_client_without_a_hold_or_without_a_pause_is_refused():
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": r"^torch\.relu$"}])
    with pytest.raises(BreakpointError, match="not paused"):
        ask(job, "evaluate", expr="1")
    job.start()
    job.wait_paused()
    handler = stepping_commands(job.stepper, lambda: 0)["evaluate"]
    with pytest.raises(BreakpointError, match="only for a UI attached"):
        handler({"expr": "1", "count": 16, "poll": None}, b"stranger")
    job.stepper.request_continue()
    job.finish()


def test_logpoint_on_every_node_of_an_mlp_leaves_losses_bit_identical(capfd):
    from torchscope.tracer.armed.session import Tracer

    def losses(**tracer_args) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(32, 8)
        target = torch.randn(32, 4)
        out = []
        with Tracer(live=False, **tracer_args):
            for _ in range(3):
                loss = torch.nn.functional.mse_loss(model(data), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach().clone())
        return out

    plain = losses()
    logged = losses(breakpoints=[{"node": ".", "log": "grad_outputs[0].norm()"}])
    assert all(torch.equal(a, b) for a, b in zip(plain, logged, strict=True))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if " log " in line]
    assert len(lines) >= 3 * 7 and any("AddmmBackward0" in line for line in lines)


# -- a recording: what its summaries can answer, without torch ---------------------------------
def test_a_recording_answers_from_kept_summaries_and_says_what_it_cannot():
    ev = {
        "kind": "grad",
        "node": "MulBackward0",
        "grad_inputs": [{"shape": [], "dtype": "float32", "values": [2.0], "stats": {"min": 2.0}}],
        "grad_outputs": [
            {"shape": [3, 4], "dtype": "float32", "stats": {"mean": 0.5, "norm": 3.0}}
        ],
    }
    assert answer_text(evaluate_kept("grad_inputs[0]", ev)) == "2"
    assert evaluate_kept("grad_outputs[0].norm()", ev)["repr"] == "3"
    assert evaluate_kept("grad_outputs[0].shape", ev)["repr"] == "torch.Size([3, 4])"
    assert "tensor[3, 4] float32" in answer_text(evaluate_kept("grad_outputs[0]", ev))
    with pytest.raises(ExpressionError, match="a recording keeps each tensor's summary"):
        evaluate_kept("grad_outputs[0].abs().argmax()", ev)


# -- over the wire: a UI that holds the job, a client that does not ----------------------------
JOB = """
import os, time, torch
torch.manual_seed(0)
w = torch.randn(4, 4, requires_grad=True)
while not os.path.exists(STOP):  # trains until the test lets it end (not a fixed time)
    y = torch.relu(torch.randn(2, 4) @ w)
    y.sum().backward()
    w.grad = None
    time.sleep(0.02)
print("finished", flush=True)
"""


def test_over_the_wire_only_a_holder_evaluates_and_edits(tmp_path):
    from torchscope.protocol.client import SessionRefused

    script = tmp_path / "job.py"
    stop = tmp_path / "stop"
    script.write_text(JOB.replace("STOP", repr(str(stop))))
    job = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", "--lease", "30", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ui = stranger = None
    try:
        ui = _connect(job.pid)
        stranger = _connect(job.pid)
        ui.request("arm")
        ui.request("break_add", op=r"^torch\.relu$")
        deadline = time.monotonic() + 60
        while ui.request("state")["state"]["paused"] is None:
            assert time.monotonic() < deadline, "no pause"
            time.sleep(0.05)
        with pytest.raises(SessionRefused, match="only for a client that holds this job"):
            stranger.request("evaluate", expr="x.sum()")
        with pytest.raises(SessionRefused, match="only for a client that holds this job"):
            stranger.request("break_add", op="relu", log="x")
        got = ui.request("evaluate", expr="args[0].shape")
        assert got["repr"] == "torch.Size([2, 4])"
        with pytest.raises(SessionRefused, match="an op's output can be edited"):
            ui.request("edit", expr="x * 0")
        with pytest.raises(SessionRefused) as err:
            ui.request("evaluate", expr="x[")
        assert "\n" not in str(err.value)
        ui.request("detach")
        stop.touch()
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 0 and "finished" in out
    finally:
        for c in (ui, stranger):
            if c is not None:
                c.close()
        job.kill()


def test_record_pid_with_a_logpoint_and_an_edit(tmp_path):
    """``record PID --log/--edit``: the recorder's own breakpoints with an action, in the
    steps it records; the file carries the log and edit events, and they go with it."""
    from torchscope.protocol.tracefile import TraceReader

    script = tmp_path / "job.py"
    script.write_text(JOB.replace("STOP", repr(str(tmp_path / "stop"))))  # killed below
    job = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _connect(job.pid).close()  # served: it takes recorders now
        out = tmp_path / "rec.tsc"
        done = subprocess.run(
            [
                *(sys.executable, "-m", "torchscope", "record", str(job.pid), "-o", str(out)),
                *("--next", "2", "--quiet", "--log", r"op:^torch\.relu$", "x.min()"),
                *("--edit", r"op:^torch\.relu$", "x * 0"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        with TraceReader(str(out)) as reader:
            events = list(reader.iter_events())
        logs = [e for e in events if e["kind"] == "log"]
        edits = [e for e in events if e["kind"] == "edit"]
        assert len(logs) == 2 and len(edits) == 2  # one each per recorded step
        assert all(e["after"][0]["stats"]["max"] == 0 for e in edits)
    finally:
        job.kill()
        job.wait(30)


SERVED = """
import torch
import torchscope

torchscope.serve(
    log=("node:^MulBackward0$", "grad_inputs[0]"),
    edit=[("node:^DivBackward0$", "grad_inputs[0] * 2")],
)
x = torch.tensor(2.0, requires_grad=True)
y = torch.tensor(2.0, requires_grad=True)
out = x * y + x / y
out.backward()
print("dx", x.grad.item(), flush=True)
"""


def test_serve_takes_log_and_edit(tmp_path):
    script = tmp_path / "served.py"
    script.write_text(SERVED)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "dx 3.0" in done.stdout  # Mul's 2 + Div's 0.5 doubled
    assert "log MulBackward0 (step 0): grad_inputs[0] = 2" in done.stderr
    with pytest.raises(ValueError, match="pairs"):
        from torchscope.tracer.options import Options

        Options.for_serve(log=["just one string"])
