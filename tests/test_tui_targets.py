"""``torchscope tui`` / ``replay`` targets: an unusable one is a one-line error and exit 2
before the screen opens (issue 12, item 8)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

from torchscope.protocol.tracefile import TraceWriter
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.targets import check_target


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def check(command: str, target: str | None, **kw) -> str | None:
    return check_target(command, target, stdin=Tty(), stdout=Tty(), **kw)


def test_each_kind_of_target(tmp_path: Path):
    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(make_trace(1, 1))
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    assert check("tui", str(trace)) is None and check("replay", str(trace)) is None
    assert "not a torchscope trace file (to trace a script: torchscope run" in check(
        "tui", str(script)
    )
    assert check("tui", str(tmp_path)).endswith("a directory, not a trace file")
    assert "no such trace file, endpoint or pid" in check("tui", "nope.tsc")
    assert check("replay", "12345").startswith("12345: replay takes a trace file")
    # a pid: a live process that is no torchscope job (this one) is an error; a dead one too
    assert "is not a torchscope job" in check("tui", str(os.getpid()))
    assert check("tui", str(os.getpid()), wait=True) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert check("tui", str(dead.pid)).startswith(f"no process with pid {dead.pid}")
    assert check("tui", str(dead.pid), wait=True) is None
    assert "no such socket" in check("tui", f"ipc://{tmp_path}/gone.control")
    # tcp: something must listen there (the UI opened on "disconnected" for ever)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert check("tui", f"tcp://127.0.0.1:{port}") is None
    assert "nothing listens there" in check("tui", f"tcp://127.0.0.1:{port}")
    assert check("tui", f"tcp://127.0.0.1:{port}", wait=True) is None
    assert check("tui", "tcp://127.0.0.1").endswith("expected tcp://HOST:PORT")
    assert check("tui", None) is None  # the one session: waits for it, on screen
    for msg in (check("tui", str(script)), check("replay", "12345")):
        assert "\n" not in msg


def test_not_a_terminal_is_refused(tmp_path: Path):
    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(make_trace(1, 1))
    problem = check_target("tui", str(trace), stdin=Tty(), stdout=io.StringIO())
    assert problem and "needs a terminal" in problem


def test_tui_redirected_to_a_file_exits_2_at_once(tmp_path: Path):
    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(make_trace(1, 1))
    out = tmp_path / "out"
    with open(out, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "torchscope", "tui", str(trace)],
            stdout=f,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "needs a terminal" in proc.stderr
    assert out.read_text() == ""  # no escape codes


def test_a_process_that_is_not_a_torchscope_job_is_one_line_and_exit_2(tmp_path: Path):
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torchscope", "tui", str(plain.pid)],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=60,
        )
    finally:
        plain.kill()
        plain.wait()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert f"{plain.pid} is not a torchscope job" in proc.stderr
    assert "torchscope run" in proc.stderr and "torchscope.serve()" in proc.stderr
    assert "is not a torchscope job" in check("tui", "1")  # init


def test_a_job_still_starting_under_torchscope_run_is_waited_for(tmp_path: Path):
    # `torchscope run` (argv[0] torchscope) and a child of it: not registered yet, but starting
    script = (
        "import subprocess, time; c = subprocess.Popen(['sleep', '60']); "
        "print(c.pid, flush=True); time.sleep(60)"
    )
    child = None
    job = subprocess.Popen(
        ["bash", "-c", f'exec -a torchscope {sys.executable} -c "{script}"'],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None
        child = int(job.stdout.readline())
        assert check("tui", str(job.pid)) is None
        assert check("tui", str(child)) is None
    finally:
        if child is not None:
            os.kill(child, 9)
        job.kill()
        job.wait()
