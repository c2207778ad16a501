"""SIGTERM and SIGINT, as schedulers, ``timeout`` and Ctrl-C send them: nothing is lost or left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

JOB = """\
import time, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100000):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} {__file__}", flush=True)
    time.sleep(0.02)
"""


def _default_sigint() -> None:
    # A suite started in the background (`nohup pytest &`) runs with SIGINT ignored, and
    # children inherit that: Python then installs no KeyboardInterrupt handler. A terminal's
    # Ctrl-C reaches a job with the default disposition, so give it that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    (tmp_path / "job.py").write_text(JOB)
    return subprocess.Popen(
        [sys.executable, "-m", "torchscope", *args, "job.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=_default_sigint,
    )


def until_step(job: subprocess.Popen, n: int) -> str:
    assert job.stdout is not None
    while True:
        line = job.stdout.readline()
        assert line, job.stderr.read() if job.stderr else "job ended"
        if int(line.split()[1]) >= n:
            return line


def torchscope(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def test_sigterm_leaves_a_complete_trace_and_nothing_registered(tmp_path: Path) -> None:
    job = start(tmp_path, "run", "--record", "t.tsc")
    try:
        line = until_step(job, 5)
        assert line.split()[2] == str(tmp_path / "job.py")  # __file__ absolute, as in python
        job.send_signal(signal.SIGTERM)
        assert job.wait(30) == -signal.SIGTERM  # it still dies of the signal, as untraced
    finally:
        job.kill()
    dump = torchscope("dump", "t.tsc", cwd=tmp_path)
    assert dump.returncode == 0 and "cut short" not in dump.stderr, dump.stderr
    assert " grad " in dump.stdout
    runtime = Path(os.environ["TORCHSCOPE_RUNTIME_DIR"])
    assert not [p for p in runtime.rglob(f"{job.pid}*")]  # no record, socket or key file
    assert str(job.pid) not in torchscope("ls", cwd=tmp_path).stdout


def test_record_killed_by_sigterm_keeps_what_it_recorded(tmp_path: Path) -> None:
    job = start(tmp_path, "run")
    try:
        until_step(job, 2)
        rec = subprocess.Popen(
            [sys.executable, "-m", "torchscope", "record", str(job.pid), "-o", "r.tsc"],
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        until_step(job, 15)
        # the recorder holds the job traced, then 25 of its steps go by (into the recording)
        from torchscope.protocol.client import SessionClient

        with SessionClient() as probe:
            probe.connect(str(job.pid), timeout=30)
            deadline = time.monotonic() + 60
            while probe.hello()["tracing"] != "traced":
                assert time.monotonic() < deadline and rec.poll() is None, "never recorded"
                time.sleep(0.05)
        until_step(job, int(until_step(job, 0).split()[1]) + 25)
        rec.send_signal(signal.SIGTERM)
        assert rec.wait(30) == 0
        assert "traced steps written to r.tsc" in (rec.stderr.read() if rec.stderr else "")
    finally:
        job.kill()
    dump = torchscope("dump", "r.tsc", "--kind", "step", cwd=tmp_path)
    assert dump.returncode == 0 and "cut short" not in dump.stderr
    assert dump.stdout.count("---- step") >= 3


@pytest.mark.parametrize("suite", ["foreground", "background"])
def test_ctrl_c_prints_the_traceback_as_python_does(tmp_path: Path, suite: str) -> None:
    # "background": the suite itself ignores SIGINT, as under `nohup ... &`
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if suite == "background" else None
    try:
        job = start(tmp_path, "run")
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
    try:
        until_step(job, 3)
        job.send_signal(signal.SIGINT)
        assert job.wait(30) == -signal.SIGINT  # as python: killed by SIGINT, shells say 130
        err = job.stderr.read() if job.stderr else ""
    finally:
        job.kill()
    assert "KeyboardInterrupt" in err and "job.py" in err
    assert "torchscope/cli/" not in err  # only the script's own frames
