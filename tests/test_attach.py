"""Attaching to running jobs, end to end: dormant ``torchscope run``, ``serve()`` in a plain
``python`` job, the ``attach`` payload, ``ls``/``record --next``, and a UI arming and leaving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from tui_pilot import SIZE, sync, until

from torchscope.cli.attach import AttachError, attach
from torchscope.protocol.client import SessionClient

# Prints its own step numbers and losses; slow enough to be caught mid-run.
JOB = """\
import sys, time
import torch
PRELUDE
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(1)
for step in range(STEPS):
    loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
    time.sleep(SLEEP)
print("done", flush=True)
"""

SIGNAL_PRELUDE = """\
import os, signal
def _run_payload(signum, frame):  # what sys.remote_exec does on 3.14: a file, between bytecodes
    path = open(os.environ["PAYLOAD_HANDSHAKE"]).read()
    exec(compile(open(path).read(), path, "exec"), {"__name__": "__torchscope_attach__"})
signal.signal(signal.SIGUSR1, _run_payload)
"""


def write_job(tmp_path: Path, prelude: str = "", steps: int = 60, sleep: float = 0.05) -> Path:
    script = tmp_path / "job.py"
    script.write_text(
        JOB.replace("PRELUDE", prelude).replace("STEPS", str(steps)).replace("SLEEP", str(sleep))
    )
    return script


def start(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )


def read_until_step(job: subprocess.Popen, at_least: int, lines: list[str]) -> int:
    assert job.stdout is not None
    while True:
        line = job.stdout.readline()
        assert line, "the job ended early: " + (job.stderr.read() if job.stderr else "")
        lines.append(line)
        if line.startswith("step ") and int(line.split()[1]) >= at_least:
            return int(line.split()[1])


def torchscope(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def ls_rows() -> list[list[str]]:
    return [line.split() for line in torchscope("ls").stdout.splitlines()]


def ls_row(pid: int, within: float = 60.0) -> list[str]:
    """The job's row in `torchscope ls`. A job too busy to answer `ls` in time (a loaded
    machine) is left out of that listing: asked again until it answers."""
    deadline = time.monotonic() + within
    while True:
        rows = [row for row in ls_rows() if row[:1] == [str(pid)]]
        answered = rows and rows[0][2] != "?"  # "?": it did not answer within ls's timeout
        if answered or time.monotonic() > deadline:
            (row,) = rows
            return row
        time.sleep(0.2)


def recorded(path: Path) -> list[dict]:
    res = torchscope("dump", str(path), "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def losses(lines: list[str]) -> list[str]:
    return [line.split()[2] for line in lines if line.startswith("step ")]


def finish(job: subprocess.Popen, lines: list[str]) -> str:
    # Not communicate(): it reads the raw pipe and would skip what readline() buffered.
    assert job.stdout is not None and job.stderr is not None
    lines.extend(job.stdout)
    err = job.stderr.read()
    assert job.wait(timeout=120) == 0, err[-3000:]
    return err


def plain_losses(script: Path, tmp_path: Path) -> list[str]:
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return losses(res.stdout.splitlines())


def check_next_3(pid: int, tmp_path: Path, asked_in: int) -> list[dict]:
    out = tmp_path / "next3.tsc"
    rec = torchscope("record", str(pid), "-o", str(out), "--next", "3", "--quiet")
    assert rec.returncode == 0, rec.stderr
    assert "3 traced steps" in rec.stderr
    events = recorded(out)
    steps = sorted({e["step"] for e in events if e["kind"] in ("op", "grad")})
    assert len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3))
    assert steps[0] > asked_in  # armed at a later step boundary, numbered as the job counts
    assert {e["step"] for e in events if e["kind"] == "step"} == set(steps)
    tracing = [(e["state"], e["step"]) for e in events if e["kind"] == "tracing"]
    assert tracing == [("traced", steps[0]), ("dormant", steps[0] + 3)]
    return events


def test_dormant_run_is_listed_and_record_next_3_arms_it_at_step_20(tmp_path: Path) -> None:
    script = write_job(tmp_path)
    job = start([sys.executable, "-m", "torchscope", "run", str(script)], tmp_path)
    lines: list[str] = []
    try:
        read_until_step(job, 20, lines)
        row = ls_row(job.pid)
        assert row[3] == "dormant" and int(row[2]) >= 20
        asked_in = read_until_step(job, 0, lines)
        events = check_next_3(job.pid, tmp_path, asked_in)
        grads = [e for e in events if e["kind"] == "grad" and e["node"] == "AccumulateGrad"]
        assert {g["param"] for g in grads} == {"0.weight", "0.bias", "2.weight", "2.bias"}
        # Dormant again at the next boundary (the recording's tracing events say so too):
        # `ls` shows it, unless the job has run to its end meanwhile (a loaded machine).
        deadline = time.monotonic() + 60
        while job.poll() is None:
            rows = [r for r in ls_rows() if r[:1] == [str(job.pid)]]
            if rows and rows[0][3] == "dormant":
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        err = finish(job, lines)
    finally:
        job.kill()
    assert "60 step(s) seen, 3 traced" in err  # one per optimizer step, none after the loop
    assert losses(lines) == plain_losses(script, tmp_path)  # bit-identical, armed or not


def test_serve_in_a_script_run_by_plain_python(tmp_path: Path) -> None:
    script = write_job(tmp_path, prelude="import torchscope\ntorchscope.serve()\n")
    job = start([sys.executable, str(script)], tmp_path)
    lines: list[str] = []
    try:
        asked_in = read_until_step(job, 5, lines)
        assert ls_row(job.pid)[3] == "dormant"
        check_next_3(job.pid, tmp_path, asked_in)
        finish(job, lines)
    finally:
        job.kill()
    assert len(losses(lines)) == 60


def test_attach_payload_started_in_a_job_that_never_imported_torchscope(tmp_path: Path) -> None:
    script = write_job(tmp_path, prelude=SIGNAL_PRELUDE)
    handshake = tmp_path / "handshake"
    job = start([sys.executable, str(script)], tmp_path, env={"PAYLOAD_HANDSHAKE": str(handshake)})
    lines: list[str] = []

    def inject(pid: int, path: str) -> None:  # sys.remote_exec(pid, path), as 3.14 would
        handshake.write_text(path)
        os.kill(pid, signal.SIGUSR1)

    try:
        read_until_step(job, 10, lines)
        assert not any(r for r in torchscope("ls").stdout.splitlines() if str(job.pid) in r)
        control = attach(job.pid, inject=inject, timeout=30)
        assert control.startswith("ipc://")
        assert attach(job.pid, inject=inject) == control  # already served: nothing to do
        # Adam counts its updates: the attached job's steps carry the job's own numbers.
        asked_in = read_until_step(job, 0, lines)
        events = check_next_3(job.pid, tmp_path, asked_in)
        first = min(e["step"] for e in events if e["kind"] == "op")
        finish(job, lines)
    finally:
        job.kill()
    numbered = [line for line in lines if line.startswith(f"step {first} ")]
    assert numbered, "the traced step numbers are the job's own"
    assert losses(lines) == plain_losses(script, tmp_path)


def test_attach_refuses_with_one_line(tmp_path: Path) -> None:
    res = torchscope("attach", str(os.getpid()))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "Python 3.14" in res.stderr or "sys.remote_exec" in res.stderr
    with pytest.raises(AttachError, match="no process"):
        attach(2**22 + 12345, inject=lambda pid, path: None)

    def fails(pid: int, path: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    job = start([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path)
    try:
        with pytest.raises(AttachError, match="not allowed"):
            attach(job.pid, inject=fails)
    finally:
        job.kill()


@sync
async def test_a_ui_arms_a_dormant_job_pauses_steps_and_quits_leaving_it_dormant(tmp_path):
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.sources.live import LiveSource

    script = write_job(tmp_path, steps=400, sleep=0.02)
    job = start([sys.executable, "-m", "torchscope", "run", str(script)], tmp_path)
    lines: list[str] = []
    try:
        read_until_step(job, 3, lines)
        app = TorchscopeApp(LiveSource(str(job.pid), recv_timeout_ms=20, retry_seconds=0.2))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.status.get("tracing") == "traced", 30, "armed")
            assert "traced" in app.screen_text()
            await pilot.press("space")
            stepper = app.store.stepper
            await until(pilot, lambda: stepper.paused is not None, 30, "paused")
            first = stepper.paused
            await pilot.press("s")
            await until(pilot, lambda: stepper.paused not in (None, first), 30, "stepped")
            assert stepper.paused["reason"] == "step"
            await pilot.press("q")
        with SessionClient() as client:
            client.connect(str(job.pid))
            deadline = time.monotonic() + 20
            while client.hello()["tracing"] != "dormant":  # no pause, no hold left
                assert time.monotonic() < deadline, "the job stayed armed after the UI quit"
                time.sleep(0.1)
            assert client.request("state")["state"]["paused"] is None
        finish(job, lines)
    finally:
        job.kill()


def test_a_ui_whose_hold_lapsed_arms_the_job_again(tmp_path):
    """A UI that stalls past the lease (stopped, swapped out) loses its hold and the job goes
    dormant; once the UI talks again it holds the job again (it showed 'connected' with no
    events for good, and a pause never came)."""
    import threading

    from torchscope.session.inbox import Inbox
    from torchscope.tui.sources.live import LiveSource

    script = write_job(tmp_path, steps=2000, sleep=0.02)
    job = start([sys.executable, "-m", "torchscope", "run", "--lease", "1", str(script)], tmp_path)
    lines: list[str] = []
    source = LiveSource(str(job.pid), recv_timeout_ms=20, retry_seconds=0.2, ping_seconds=0.2)
    stop = threading.Event()
    ui = threading.Thread(target=source.run, args=(Inbox(), stop), daemon=True)
    try:
        read_until_step(job, 3, lines)
        ui.start()

        def tracing_becomes(state: str) -> None:
            deadline = time.monotonic() + 30
            while getattr(source.client, "tracing", None) != state:
                assert time.monotonic() < deadline, f"never {state}"
                time.sleep(0.05)

        tracing_becomes("traced")
        source.ping_seconds = 1e9  # the UI stalls: no request reaches the job
        tracing_becomes("dormant")  # its hold lapsed after the 1 s lease
        source.ping_seconds = 0.2  # it wakes up
        tracing_becomes("traced")
    finally:
        stop.set()
        ui.join(10)
        job.kill()
