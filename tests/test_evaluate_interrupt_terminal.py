"""In a real terminal (tmux): a runaway expression typed in the UI's ``p`` box at a pause is
cancelled with escape; the UI says "interrupted after N s", the job is at its pause again,
and once continued it ends (exit 0) with losses bit-identical to a run never paused.

A private tmux server (its own socket), killed afterwards; waits are on the screen's text
and on files, with deadlines generous for a loaded machine."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from test_e2e_terminal import Terminal, term, torchscope  # noqa: F401 (term: a fixture)

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")

JOB = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(4):
    h = torch.tanh(model[0](x))
    loss = torch.nn.functional.mse_loss(model[2](h), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"loss {step} {loss.item()!r}", flush=True)
"""
RUNAWAY = "sum(1 for _ in iter(int, 1))"


def losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("loss ")]


def test_a_runaway_expression_cancelled_with_escape(term: Terminal):  # noqa: F811
    (term.cwd / "job.py").write_text(JOB)
    plain = subprocess.run(
        [sys.executable, "job.py"], capture_output=True, text=True, cwd=term.cwd, timeout=300
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    # --lease: the job may pause before the UI is up
    spec = r"op:^torch\.tanh$,step:2"
    term.start(torchscope("run", "--break-on", spec, "--lease", "300", "job.py"), "job", log=True)
    ui = term.start(torchscope("tui"), "ui")

    def at_tanh(out: str) -> bool:
        return "⏸ breakpoint 1" in out and "torch.tanh · job.py:7" in out

    term.wait(ui, at_tanh, "paused at torch.tanh")
    term.keys(ui, "p")
    term.tmux("send-keys", "-t", f"e2e:{ui}", "-l", RUNAWAY)
    term.keys(ui, "Enter")
    # the job runs it (the box says so; a reply after a second says it still runs)
    term.wait(ui, lambda o: "escape interrupts it" in o, "the expression running in the job")
    term.keys(ui, "Escape")
    out = term.wait(
        ui, lambda o: re.search(r"interrupted after \d", o), "the expression interrupted"
    )
    assert "(cancelled)" in out.replace("\n", " ") or "interrupted after" in out
    # the job is at its pause again: it printed no further step
    assert losses((term.cwd / "job.out").read_text()) == losses(plain.stdout)[:2]
    assert at_tanh(term.screen(ui))  # the status line: still at the breakpoint's pause
    term.keys(ui, "c")
    assert term.wait_rc("job") == "0", term.logs()
    assert losses((term.cwd / "job.out").read_text()) == losses(plain.stdout)
    term.keys(ui, "q")
    assert term.wait_rc("ui") == "0"
