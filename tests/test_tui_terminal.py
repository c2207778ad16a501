"""The UI in a real terminal (tmux): keys in, screen out, exit code. Skipped without tmux."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from torchscope.protocol.tracefile import TraceWriter
from torchscope.tui.demo.synthetic import make_trace

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
ROOT = Path(__file__).resolve().parents[1]


def tmux(*args: str) -> str:
    return subprocess.run(
        ["tmux", *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_for(session: str, text: str, timeout: float = 60.0, gone: bool = False) -> str:
    """Poll the terminal until it shows ``text`` (with ``gone``: until it no longer does)."""
    deadline = time.monotonic() + timeout
    while True:
        out = screen(session)
        if (text in out) != gone:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never {'went' if gone else 'appeared'}; screen:\n{out}")
        time.sleep(0.1)


def test_replay_in_a_real_terminal(tmp_path: Path) -> None:
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
    session = f"tstui-{uuid.uuid4().hex[:8]}"
    # COLUMNS/LINES (set by pytest plugins) would override the terminal's real size.
    env = f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} TERM=xterm-256color"
    tmux(
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        "150",
        "-y",
        "40",
        f"{env} {sys.executable} {script}",
    )
    try:
        out = wait_for(session, "F.linear")
        assert "REPLAY t.tsc" in out and "Steps" in out
        tmux("send-keys", "-t", session, "]")  # next step: the one with the NaN
        wait_for(session, "Step 1")
        tmux("send-keys", "-t", session, "|")  # filter
        wait_for(session, "filter name · module · source")
        tmux("send-keys", "-t", session, "gelu", "Enter")
        # the box closed (the filter shows as it is typed: enter may not have reached it yet)
        wait_for(session, "filter name · module · source", gone=True)
        out = wait_for(session, "/gelu/")
        assert "GeluBackward0" in out and "F.layer_norm" not in out
        tmux("send-keys", "-t", session, "?")
        wait_for(session, "torchscope — keys")
        tmux("send-keys", "-t", session, "Escape")
        wait_for(session, "torchscope — keys", gone=True)
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, screen(session)
            time.sleep(0.1)
        assert done.read_text() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert os.path.exists(trace)


def test_a_recording_opens_at_its_origin_and_steps_both_ways_in_a_real_terminal(
    tmp_path: Path,
) -> None:
    """What a user types: ``torchscope tui FILE`` opens paused at the NaN's origin; ``S``
    steps back; a ``nan`` breakpoint made in ``B``, then ``c``, lands on the origin again."""
    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(make_trace(3, 3, nan_step=1))
    session = f"tstui-{uuid.uuid4().hex[:8]}"
    env = f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} TERM=xterm-256color"
    done = tmp_path / "rc"
    command = f"{env} {sys.executable} -m torchscope tui {trace}; echo $? > {done}"
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", f"sh -c '{command}'")
    keys = ("send-keys", "-t", session)
    try:
        wait_for(session, "⏸ NaN first appears: F.linear · blocks.1.fc", timeout=60)
        tmux(*keys, "S")
        wait_for(session, "⏸ step back: F.layer_norm · blocks.0.norm", timeout=60)
        tmux(*keys, "B")
        wait_for(session, "Breakpoints", timeout=60)
        tmux(*keys, "nan", "Enter")
        wait_for(session, "1 breakpoint", timeout=60)
        tmux(*keys, "Escape")
        # the breakpoint screen closes before c reaches the main screen
        wait_for(session, "Breakpoints", timeout=60, gone=True)
        tmux(*keys, "c")
        wait_for(session, "⏸ NaN first appears: F.linear · blocks.1.fc", timeout=60)
        tmux(*keys, "q")
        deadline = time.monotonic() + 30
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, screen(session)
            time.sleep(0.1)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
