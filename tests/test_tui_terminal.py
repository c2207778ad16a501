"""The UI in a real terminal (tmux): keys in, screen out, exit code. Skipped without tmux."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from tmux_server import TmuxServer

from torchscope.protocol.tracefile import TraceWriter
from torchscope.tui.demo.synthetic import make_trace

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
ROOT = Path(__file__).resolve().parents[1]


def wait_exit(tmux: TmuxServer, done: Path) -> str:
    """The exit code the UI left in ``done``, once it is there."""
    deadline = time.monotonic() + 60
    while not done.exists() or not done.read_text().strip():
        assert time.monotonic() < deadline, tmux.screen("ui")
        time.sleep(0.1)
    return done.read_text().strip()


def test_replay_in_a_real_terminal(tmp_path: Path, tmux: TmuxServer) -> None:
    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(make_trace(3, 3, nan_step=1))
    done = tmp_path / "rc"
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from torchscope.tui import run_tui, FileSource\n"
        f"rc = run_tui(FileSource({str(trace)!r}), at_origin=False)\n"
        f"open({str(done)!r}, 'w').write(str(rc))\n"
    )
    script = tmp_path / "ui.py"
    script.write_text(code)
    # COLUMNS/LINES (set by pytest plugins) would override the terminal's real size.
    env = f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} TERM=xterm-256color"
    tmux.new_session("ui", (150, 40), f"{env} {sys.executable} {script}")
    out = tmux.wait("ui", "F.linear")
    assert "REPLAY t.tsc" in out and "Steps" in out
    tmux.keys("ui", "]")  # next step: the one with the NaN
    tmux.wait("ui", "Step 1")
    tmux.keys("ui", "|")  # filter
    tmux.wait("ui", "filter name · module · source")
    tmux.keys("ui", "gelu", "Enter")
    # the box closed (the filter shows as it is typed: enter may not have reached it yet)
    tmux.wait("ui", "filter name · module · source", gone=True)
    out = tmux.wait("ui", "/gelu/")
    assert "GeluBackward0" in out and "F.layer_norm" not in out
    tmux.keys("ui", "?")
    tmux.wait("ui", "torchscope — keys")
    tmux.keys("ui", "Escape")
    tmux.wait("ui", "torchscope — keys", gone=True)
    tmux.keys("ui", "q")
    assert wait_exit(tmux, done) == "0"
    assert os.path.exists(trace)


def test_a_recording_opens_at_its_origin_and_steps_both_ways_in_a_real_terminal(
    tmp_path: Path, tmux: TmuxServer
) -> None:
    """What a user types: ``torchscope tui FILE`` opens paused at the NaN's origin; ``S``
    steps back; a ``nan`` breakpoint made in ``B``, then ``c``, lands on the origin again."""
    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(make_trace(3, 3, nan_step=1))
    env = f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} TERM=xterm-256color"
    done = tmp_path / "rc"
    command = f"{env} {sys.executable} -m torchscope tui {trace}; echo $? > {done}"
    tmux.new_session("ui", (120, 40), f"sh -c '{command}'")
    tmux.wait("ui", "⏸ NaN first appears: F.linear · blocks.1.fc")
    tmux.keys("ui", "S")
    tmux.wait("ui", "⏸ step back: F.layer_norm · blocks.0.norm")
    tmux.keys("ui", "B")
    tmux.wait("ui", "Breakpoints")
    tmux.keys("ui", "nan", "Enter")
    tmux.wait("ui", "1 breakpoint")
    tmux.keys("ui", "Escape")
    # the breakpoint screen closes before c reaches the main screen
    tmux.wait("ui", "Breakpoints", gone=True)
    tmux.keys("ui", "c")
    tmux.wait("ui", "⏸ NaN first appears: F.linear · blocks.1.fc")
    tmux.keys("ui", "q")
    assert wait_exit(tmux, done) == "0"
