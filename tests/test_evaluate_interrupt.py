"""A runaway expression never holds the job: interrupted by its budget, by a cancel, by its
asker letting go (a UI's quit, an agent's ``release``), a logpoint over budget disabled once.
Each leaves the job going on exactly as a run never paused (bit-identical results).

Waits are on conditions (the answer, the job's output), never on fixed times."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_stepping import Job, make_inputs, two_layer

from torchscope.tracer.armed.interrupt import ExpressionInterrupted, Run, guarded
from torchscope.tracer.stepper import stepping_commands

RUNAWAY = "sum(1 for _ in iter(int, 1))"  # never ends


def handler(job: Job, cmd: str = "evaluate"):
    return stepping_commands(job.stepper, lambda: 0)[cmd]


def ask(job: Job, client: object = "ui", **args):
    base = {"expr": None, "group": None, "index": None, "count": 16, "poll": None}
    return handler(job)({**base, **args}, client)


def answer_of(job: Job, first: dict, client: object = "ui", within: float = 60.0) -> dict:
    """Poll a pending answer until it comes (the UI's way)."""
    got = first
    deadline = time.monotonic() + within
    while got.get("pending"):
        assert time.monotonic() < deadline, "no answer"
        job.stepper.contact(client)
        got = ask(job, client, poll=first["pending"])  # waits up to a second itself
    return got


def paused_at_relu() -> tuple[Job, torch.Tensor, torch.Tensor]:
    x, w = make_inputs()
    job = Job(lambda: two_layer(x, w), breakpoints=[{"op": r"^torch\.relu$"}], lease=60)
    job.start()
    job.wait_paused()
    job.stepper.contact("ui")  # a UI attached, as one that holds the job
    return job, x, w


def finish_untouched(job: Job, x: torch.Tensor, w: torch.Tensor) -> None:
    job.stepper.request_continue()
    result = job.finish()
    x2, w2 = make_inputs()
    assert torch.equal(result, two_layer(x2, w2).detach())  # as a run never paused
    assert torch.equal(w.grad, w2.grad)


def test_guarded_interrupts_a_python_loop_and_leaves_nothing_behind():
    run = Run(0.2)
    with pytest.raises(ExpressionInterrupted):
        guarded(lambda: sum(1 for _ in iter(int, 1)), run)
    assert run.text().startswith("interrupted after 0.") and "budget of 0.2 s" in run.text()

    # An expression that catches it once is interrupted again.
    def catches_once() -> None:
        try:
            while True:
                pass
        except BaseException:
            pass
        while True:
            pass

    run = Run(None)
    threading.Thread(target=lambda: (time.sleep(0.1), run.cancel())).start()
    with pytest.raises(ExpressionInterrupted):
        guarded(catches_once, run)
    assert "(cancelled)" in run.text()
    # Quick ones under tiny budgets: whatever happens, nothing lands after guarded returns.
    for i in range(2000):
        with contextlib.suppress(ExpressionInterrupted):
            guarded(lambda: sum(range(200)), Run(0.00001 * (i % 7 + 1)))
        for _ in range(200):
            pass


def test_a_runaway_expression_is_interrupted_by_its_budget():
    job, x, w = paused_at_relu()
    got = answer_of(job, ask(job, expr=RUNAWAY, budget=0.5))
    assert got["interrupted"] and got["error"].startswith("interrupted after 0.")
    assert "over its budget of 0.5 s" in got["error"]
    # the pause is as it was: it still answers
    assert ask(job, expr="args[0].shape")["repr"] == "torch.Size([3, 5])"
    # the job's own budget applies to one that names none
    job.stepper.eval_budget = 0.5
    got = answer_of(job, ask(job, expr=RUNAWAY))
    assert "over its budget of 0.5 s" in got["error"]
    finish_untouched(job, x, w)


def test_a_runaway_edit_is_not_applied():
    job, x, w = paused_at_relu()
    job.stepper.request_step()
    job.wait_running(job.wait_paused())
    job.wait_paused()
    from torchscope.protocol.breakpoints import BreakpointError

    edit = handler(job, "edit")
    args = {"expr": f"x * 0 + {RUNAWAY}", "group": None, "index": None, "poll": None}
    with pytest.raises(BreakpointError, match=r"edit not applied: interrupted after 0\."):
        got = edit({**args, "budget": 0.5}, "ui")
        deadline = time.monotonic() + 60
        while got.get("pending"):
            assert time.monotonic() < deadline
            got = edit({**args, "expr": None, "poll": got["pending"]}, "ui")
    assert ask(job, expr="out.abs().sum()")["values"][0] > 0  # not applied
    finish_untouched(job, x, w)


def test_a_runaway_expression_is_interrupted_by_a_cancel():
    job, x, w = paused_at_relu()
    first = ask(job, expr=RUNAWAY, budget=600)
    assert first["pending"]
    got = answer_of(job, ask(job, cancel=first["pending"]))
    assert got["interrupted"] and got["error"].startswith("interrupted after")
    assert "(cancelled)" in got["error"]
    assert job.stepper.paused is not None  # the pause holds
    finish_untouched(job, x, w)


def test_a_runaway_expression_is_interrupted_when_its_asker_lets_go():
    job, x, w = paused_at_relu()
    first = ask(job, expr=RUNAWAY, budget=600)
    assert first["pending"]
    job.stepper.release("ui")  # its UI quit (or its lease ran out): holders.py calls this
    task = job.stepper.task(first["pending"])
    assert task.finished.wait(60)
    assert "its asker let go" in task.answer()["error"]
    finish_untouched(job, x, w)


def mlp_losses(**tracer_args) -> list[torch.Tensor]:
    from torchscope.tracer.armed.session import Tracer

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


def test_a_logpoint_over_budget_is_disabled_once(capfd):
    plain = mlp_losses()
    capfd.readouterr()
    logged = mlp_losses(
        breakpoints=[
            {"op": "gelu", "log": RUNAWAY},
            {"node": "^AddmmBackward0$", "edit": "1/0"},
        ],
        eval_budget=0.5,
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, logged, strict=True))
    err = capfd.readouterr().err.splitlines()
    over = [line for line in err if "interrupted after" in line]
    assert len(over) == 1 and "disabled" in over[0] and "over its budget of 0.5 s" in over[0]
    failed = [line for line in err if "ZeroDivisionError" in line]
    assert len(failed) == 1 and "disabled" in failed[0]


# -- over the wire: an agent's release interrupts what it asked ---------------------------------
def test_mcp_release_interrupts_an_expression_and_the_job_runs_on(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    import anyio
    from mcp import Client
    from test_mcp import ok, until

    from torchscope.mcp.server import build_server

    job = LossJob(tmp_path)
    try:
        job.wait_losses(2)

        async def go() -> None:
            async with Client(build_server(), mode="legacy") as client:
                await ok(client, "breakpoint_set", job=job.pid, spec=r"op:^torch\.log$")
                hit = await ok(client, "continue", job=job.pid, wait=60)
                assert hit["paused"]["name"] == "torch.log", hit
                # the budget: answered, the pause as it was
                quick = await ok(client, "evaluate", job=job.pid, expr=RUNAWAY, budget_s=0.5)
                assert quick["interrupted"] and "budget of 0.5 s" in quick["text"], quick
                answers: list[dict] = []
                mark = tmp_path / "running"
                marked = f"open({str(mark)!r}, 'w').close() or {RUNAWAY}"

                async def runaway() -> None:
                    answers.append(
                        await ok(client, "evaluate", job=job.pid, expr=marked, budget_s=600)
                    )

                async def running() -> bool:
                    return mark.exists()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(runaway)
                    await until("the expression running in the job", running)
                    await ok(client, "release", job=job.pid)
                assert answers[0]["interrupted"], answers
                assert "its asker let go" in answers[0]["text"] or "no UI" in answers[0]["text"]

        anyio.run(go)
        job.wait_losses(len(job.losses) + 3)
    finally:
        job.stop()
    job.assert_as_never_paused(tmp_path)


class LossJob:
    """The dormant job of test_mcp under `torchscope run`, its printed lines kept."""

    def __init__(self, tmp_path: Path) -> None:
        from test_mcp import DORMANT

        (tmp_path / "job.py").write_text(DORMANT)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchscope", "run", "--lease", "300", "job.py"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    @property
    def losses(self) -> list[str]:
        return [line for line in self.lines if line.startswith("step ")]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def wait_losses(self, n: int, within: float = 120.0) -> None:
        deadline = time.monotonic() + within
        while len(self.losses) < n:
            assert self.proc.poll() is None, "".join(self.err)[-3000:]
            assert time.monotonic() < deadline, f"fewer than {n} steps"
            threading.Event().wait(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def assert_as_never_paused(self, tmp_path: Path) -> None:
        """Its losses so far are bit-identical to the same script never paused (nor served)."""
        from test_mcp import DORMANT

        reference = tmp_path / "plain.py"
        reference.write_text(DORMANT.replace("range(100000)", f"range({len(self.losses)})"))
        plain = subprocess.run(
            [sys.executable, str(reference)], capture_output=True, text=True, timeout=300
        )
        assert plain.returncode == 0, plain.stderr[-2000:]
        assert plain.stdout.splitlines() == self.lines[: len(self.losses)]
