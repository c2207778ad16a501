"""The first ten minutes, in a real terminal (tmux) at 80x24 and 120x40: what a new user
opens first shows what they came for. Skipped without tmux."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
ROOT = Path(__file__).resolve().parents[1]
SIZES = [(80, 24), (120, 40)]

JOB = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(300):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def tmux(*args: str) -> str:
    return subprocess.run(
        ["tmux", *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout


class Terminal:
    """One tmux session running one command at a fixed size."""

    def __init__(self, command: str, size: tuple[int, int], cwd: Path) -> None:
        self.name = f"tsfirst-{uuid.uuid4().hex[:8]}"
        # COLUMNS/LINES (set by pytest plugins) would override the terminal's real size.
        env = f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} TERM=xterm-256color"
        tmux(
            "new-session", "-d", "-s", self.name, "-x", str(size[0]), "-y", str(size[1]),
            "-c", str(cwd), f"{env} {command}",
        )

    def screen(self) -> str:
        return tmux("capture-pane", "-p", "-t", self.name)

    def until(self, cond, what: str, timeout: float = 90.0) -> str:
        """Wait for a condition on the screen (never for a time)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.screen()
            if cond(out):
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} never appeared; screen:\n{out}")
            time.sleep(0.1)

    def keys(self, *keys: str) -> None:
        tmux("send-keys", "-t", self.name, *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@pytest.fixture(scope="module")
def late_recording(tmp_path_factory) -> Path:
    """A 300-step job recorded at steps 250-251 only: the file holds every step's loss (the
    run's history), and events from step 250 on, as `record PID --next 2` makes."""
    pytest.importorskip("torch")
    where = tmp_path_factory.mktemp("late")
    (where / "job.py").write_text(JOB)
    subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--quiet", "--record", "t.tsc",
         "--steps", "250-251", "job.py"],
        cwd=where, check=True, timeout=300, capture_output=True,
    )
    return where / "t.tsc"


@pytest.mark.parametrize("size", [*SIZES, (200, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_recording_opens_on_its_first_traced_step_in_view(late_recording, size):
    term = Terminal(f"{sys.executable} -m torchscope tui t.tsc", size, late_recording.parent)
    try:
        out = term.until(lambda s: "Step 250" in s and "F.linear" in s, "step 250's ops")
        assert "no events in this step" not in out
        if size[0] >= 100:  # the step list shows, its row for step 250 in view (the list
            # takes the file's history in turns: it may draw its first rows a frame earlier)
            term.until(lambda s: re.search(r"│\s*250\s", s), "step 250's row in the step list")
    finally:
        term.close()


GATED = """\
import torch
torch.manual_seed(0)
lin, gate = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
opt = torch.optim.SGD([*lin.parameters(), *gate.parameters()], lr=0.01)
for step in range(2):
    x = torch.randn(4, 8)
    y = lin(x) * torch.sigmoid(gate(x))
    y.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_nodes_both_sides_fit_at_120x40(tmp_path: Path):
    # MulBackward0 of two tensors: grad_inputs[1] shows without scrolling the detail
    pytest.importorskip("torch")
    (tmp_path / "job.py").write_text(GATED)
    subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--quiet", "--record", "t.tsc", "job.py"],
        cwd=tmp_path, check=True, timeout=300, capture_output=True,
    )
    term = Terminal(f"{sys.executable} -m torchscope tui t.tsc", (120, 40), tmp_path)
    try:
        term.until(lambda s: "Tensor.mul" in s, "the step's ops")
        term.keys("/")
        term.until(lambda s: "search" in s, "the search box")
        term.keys("MulBackward0", "Enter")
        out = term.until(lambda s: "grad_outputs — what arrived" in s, "the node's detail")
        out = term.until(
            lambda s: "[1] [4,8] float32" in s and "SigmoidBackward0 node id" in s,
            "grad_inputs[1]",
        )
        assert "grad_inputs — what it sends on" in out
    finally:
        term.close()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_tensors_norm_keeps_its_label_in_the_timeline(late_recording, size):
    # `0.1572` for a [2,8] tensor would read like a value: the stat says norm= (or n=)
    term = Terminal(f"{sys.executable} -m torchscope tui t.tsc", size, late_recording.parent)
    try:
        out = term.until(lambda s: "Step 250" in s and "F.linear" in s, "step 250's ops")
        rows = [line for line in out.splitlines() if re.search(r"\[\d+,\d+\]", line)]
        assert rows, out
        for row in rows:
            assert re.search(r"\b(norm|n)=", row), row
    finally:
        term.close()
