"""End to end, in real terminals (tmux): ``torchscope run`` in one window, ``torchscope tui``
in another; keys in, screen out, exit codes. Skipped without tmux (or torch).

The tmux server is private to each test (its own socket) and killed afterwards; every
process gets its environment on its command line (a tmux server does not pass ours on), with
TORCHSCOPE_RUNTIME_DIR from the environment tests/conftest.py set up.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tmux_server import TmuxServer

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 200, 50
TIMEOUT = 60.0  # CI: two slow cores, torch imported twice at once


class Terminal:
    """A private tmux server: window 0 runs the job, window 1 the UI."""

    def __init__(self, cwd: Path) -> None:
        self.tmux = TmuxServer("tse2e")
        self.cwd = cwd
        self.windows = 0

    def command(self, argv: list[str], name: str) -> str:
        """A shell line that runs ``argv`` in our environment and leaves ``name.rc``."""
        env = {"PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
        for key in ("TORCHSCOPE_RUNTIME_DIR", "TORCHSCOPE_KEYS_DIR", "PATH", "HOME"):
            if os.environ.get(key):
                env[key] = os.environ[key]
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        run = " ".join(shlex.quote(a) for a in argv)
        # COLUMNS/LINES (set by pytest plugins) would override the terminal's real size.
        return (
            f"cd {shlex.quote(str(self.cwd))} && env -u COLUMNS -u LINES {assigns} {run}"
            f" ; echo $? > {name}.rc"
        )

    def start(self, argv: list[str], name: str, *, log: bool = False) -> int:
        """Run ``argv`` in a new window; returns the window index."""
        line = self.command(argv, name)
        if log:  # the job's output to files (the UI's window shows the UI)
            line = line.replace(" ; echo", f" > {name}.out 2> {name}.err ; echo", 1)
        line = f"cd {shlex.quote(str(self.cwd))} && echo $$ > {name}.shpid; {line}"
        if self.windows == 0:
            self.tmux.new_session("e2e", (WIDTH, HEIGHT), line)
            self.tmux("set-option", "-t", "e2e", "remain-on-exit", "on")
        else:
            self.tmux("new-window", "-t", "e2e", line)
        self.windows += 1
        return self.windows - 1

    def screen(self, window: int) -> str:
        return self.tmux.screen(f"e2e:{window}")

    def keys(self, window: int, *keys: str) -> None:
        self.tmux.keys(f"e2e:{window}", *keys)

    def wait(self, window: int, cond: Callable[[str], object], what: str) -> str:
        return self.tmux.wait(
            f"e2e:{window}",
            cond,
            what=f"{what} (window {window})",
            timeout=TIMEOUT,
            explain=self.logs,
        )

    def rc(self, name: str) -> str | None:
        path = self.cwd / f"{name}.rc"
        return path.read_text().strip() if path.exists() else None

    def wait_rc(self, name: str) -> str:
        deadline = time.monotonic() + TIMEOUT
        while (rc := self.rc(name)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not exit\n{self.logs()}")
            time.sleep(0.1)
        return rc

    def logs(self) -> str:
        out = []
        for path in sorted(self.cwd.glob("*.out")) + sorted(self.cwd.glob("*.err")):
            out.append(f"--- {path.name}\n{path.read_text()[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        # The shells' children (a job still running after a failure) go with their group.
        for pidfile in self.cwd.glob("*.shpid"):
            with contextlib.suppress(OSError, ValueError):
                os.killpg(int(pidfile.read_text().strip()), signal.SIGKILL)
        self.tmux.close()


@pytest.fixture
def term(tmp_path: Path):
    pytest.importorskip("torch")
    t = Terminal(tmp_path)
    try:
        yield t
    finally:
        t.close()


def torchscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchscope", *args]


# -- issue 3: watch a running job ---------------------------------------------------------------

TRAIN = """\
import os, sys, time
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)
step = 0
while not os.path.exists(sys.argv[1]) and step < 3000:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    time.sleep(0.05)
print(f"trained {step} steps", flush=True)
"""

ADDMM = re.compile(r"◂ AddmmBackward0 .*?\bnorm=([0-9][0-9.e+-]*)(?=\s)")


def test_watch_a_training_job_then_quit_and_the_job_goes_on(term: Terminal):
    from torchscope.analysis.render import compact_stat

    (term.cwd / "train.py").write_text(TRAIN)
    stop = term.cwd / "stop"
    term.start(torchscope("run", "--record", "rec.tsc", "train.py", str(stop)), "job", log=True)
    ui = term.start(torchscope("tui"), "ui")

    def both(out: str) -> bool:
        return "F.linear" in out and ADDMM.search(out) is not None and "● LIVE" in out

    term.wait(ui, both, "ops and a backward node with its gradient norm")
    term.keys(ui, "Up")  # stop following: the view stays on this step
    # (a step that had just begun fills in: its events keep coming)
    out = term.wait(ui, lambda o: "following off" in o and ADDMM.search(o), "following off")
    step = int(re.search(r"Step (\d+) ·", out).group(1))
    shown = ADDMM.findall(out)
    assert shown, out
    assert "ReluBackward0" in out and "F.relu" in out and "F.mse_loss" in out

    term.keys(ui, "q")
    assert term.wait_rc("ui") == "0"
    from torchscope.protocol.client import SessionClient

    with SessionClient() as probe:  # the job trains on: its step count still grows
        first = probe.connect(None, timeout=30).get("step") or 0
        deadline = time.monotonic() + TIMEOUT
        while (probe.hello().get("step") or 0) < first + 3:
            assert term.rc("job") is None, "the job stopped when the UI quit"
            assert time.monotonic() < deadline, "the job stopped training when the UI quit"
            time.sleep(0.1)
    assert term.rc("job") is None, "the job stopped when the UI quit"
    stop.write_text("")
    assert term.wait_rc("job") == "0", term.logs()
    assert "trained" in (term.cwd / "job.out").read_text()

    # The numbers on the screen are the run's own: the recording of that step says so.
    import torchscope as ts

    trace = ts.load(term.cwd / "rec.tsc")
    expected = {
        compact_stat(e["grad_outputs"][0])
        for e in trace.grads
        if e.get("node") == "AddmmBackward0" and e.get("step") == step
    }
    assert len(expected) == 2, expected  # one node per Linear layer
    assert {f"norm={n}" for n in shown} <= expected, (shown, expected, step)


# -- issue 4: stop at a NaN, step, continue -----------------------------------------------------

NAN_JOB = """\
import torch
torch.manual_seed(0)
x = torch.randn(4, 3, requires_grad=True)
for step in range(3):
    y = torch.log(x - 10.0)
    y.sum().backward()
print("finished")
"""

PAUSED_ROW = re.compile(r"(\d+) ⏸ ")


def test_break_on_nan_step_and_continue_in_a_real_terminal(term: Terminal):
    (term.cwd / "nanjob.py").write_text(NAN_JOB)
    # --lease: the job may pause before the UI is up; on slow machines that can take a while
    run = torchscope("run", "--break-on", "nan", "--lease", "60", "nanjob.py")
    term.start(run, "job", log=True)
    ui = term.start(torchscope("tui"), "ui")

    def at_log(out: str) -> bool:
        return (
            "⏸ NaN first appears: torch.log" in out
            and "nanjob.py:5" in out
            and "y = torch.log(x - 10.0)" in out
            and PAUSED_ROW.search(out) is not None
        )

    out = term.wait(ui, at_log, "paused at torch.log, nanjob.py:5")
    assert "call stack" in out
    term.keys(ui, "s")
    out = term.wait(ui, lambda o: "⏸ stepped: Tensor.sum" in o, "the next op")
    assert re.search(r"\d+ ⏸ Tensor\.sum", out)
    # c: the NaN appears again on each of the three iterations; continue until the job ends
    for _ in range(5):
        seq = PAUSED_ROW.search(out).group(1)
        term.keys(ui, "c")

        # the paused row and the status line are drawn in separate frames: wait for both
        def moved(o: str, seq: str = seq) -> bool:
            m = PAUSED_ROW.search(o)
            return term.rc("job") is not None or (
                m is not None and m.group(1) != seq and "⏸ NaN first appears: torch.log" in o
            )

        out = term.wait(ui, moved, "the next pause at the NaN, or the job's end")
        if term.rc("job") is not None:
            break
    assert term.wait_rc("job") == "0", term.logs()
    assert "finished" in (term.cwd / "job.out").read_text()
    term.wait(ui, lambda o: "session ended" in o and "⏸" not in o, "the end of the job")
    term.keys(ui, "q")
    assert term.wait_rc("ui") == "0"
