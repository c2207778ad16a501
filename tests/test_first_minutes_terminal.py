"""The first ten minutes, in a real terminal (tmux) at 80x24 and 120x40: what a new user
opens first shows what they came for. Skipped without tmux."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tmux_server import TmuxServer

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


def open_ui(tmux: TmuxServer, size: tuple[int, int], cwd: Path) -> None:
    """``torchscope tui t.tsc`` in ``cwd``, in a terminal of ``size``: the session "ui"."""
    # COLUMNS/LINES (set by pytest plugins) would override the terminal's real size.
    env = f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} TERM=xterm-256color"
    tmux.new_session("ui", size, f"{env} {sys.executable} -m torchscope tui t.tsc", cwd)


@pytest.fixture(scope="module")
def late_recording(tmp_path_factory) -> Path:
    """A 300-step job recorded at steps 250-251 only: the file holds every step's loss (the
    run's history), and events from step 250 on, as `record PID --next 2` makes."""
    pytest.importorskip("torch")
    where = tmp_path_factory.mktemp("late")
    (where / "job.py").write_text(JOB)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torchscope",
            "run",
            "--quiet",
            "--record",
            "t.tsc",
            "--steps",
            "250-251",
            "job.py",
        ],
        cwd=where,
        check=True,
        timeout=300,
        capture_output=True,
    )
    return where / "t.tsc"


@pytest.mark.parametrize("size", [*SIZES, (200, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_recording_opens_on_its_first_traced_step_in_view(late_recording, size, tmux):
    open_ui(tmux, size, late_recording.parent)
    out = tmux.wait("ui", lambda s: "Step 250" in s and "F.linear" in s, what="step 250's ops")
    assert "no events in this step" not in out
    if size[0] >= 100:  # the step list shows, its row for step 250 in view (the list
        # takes the file's history in turns: it may draw its first rows a frame earlier)
        tmux.wait(
            "ui", lambda s: re.search(r"│\s*250\s", s), what="step 250's row in the step list"
        )


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


def test_a_nodes_both_sides_fit_at_120x40(tmp_path: Path, tmux: TmuxServer):
    # MulBackward0 of two tensors: grad_inputs[1] shows without scrolling the detail
    pytest.importorskip("torch")
    (tmp_path / "job.py").write_text(GATED)
    subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--quiet", "--record", "t.tsc", "job.py"],
        cwd=tmp_path,
        check=True,
        timeout=300,
        capture_output=True,
    )
    open_ui(tmux, (120, 40), tmp_path)
    tmux.wait("ui", "Tensor.mul", what="the step's ops")
    tmux.keys("ui", "/")
    tmux.wait("ui", "search", what="the search box")
    tmux.keys("ui", "MulBackward0", "Enter")
    tmux.wait("ui", "grad_outputs — what arrived", what="the node's detail")
    out = tmux.wait(
        "ui",
        lambda s: "[1] [4,8] float32" in s and "SigmoidBackward0 node id" in s,
        what="grad_inputs[1]",
    )
    assert "grad_inputs — what it sends on" in out


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_tensors_norm_keeps_its_label_in_the_timeline(late_recording, size, tmux):
    # `0.1572` for a [2,8] tensor would read like a value: the stat says norm= (or n=)
    open_ui(tmux, size, late_recording.parent)
    out = tmux.wait("ui", lambda s: "Step 250" in s and "F.linear" in s, what="step 250's ops")
    rows = [line for line in out.splitlines() if re.search(r"\[\d+,\d+\]", line)]
    assert rows, out
    for row in rows:
        assert re.search(r"\b(norm|n)=", row), row
