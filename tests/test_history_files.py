"""The run's history in recordings made by the job itself: ``torchscope run --record`` and
``serve(record=...)`` write every step's loss as ``history`` events (the steps before a later
``--steps`` window too), and a replay (``FileSource``) hands them to the UI from its count pass,
before any step is loaded: the step list and ``H`` show the whole run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_attach import recorded, torchscope
from tui_pilot import sync, until

from torchscope.protocol.events import HISTORY
from torchscope.protocol.tracefile import TraceReader
from torchscope.session.inbox import Inbox
from torchscope.session.items import (
    Counts,
    ErrorMessage,
    HistoryBatch,
    InboxItem,
    Progress,
    StepPart,
    WholeStep,
)
from torchscope.session.store import EventStore
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.screens.history import HistoryScreen
from torchscope.tui.sources.file import FileSource

STEPS = 70  # more than two of the agent's batches (32 points): several history events
WINDOW = (50, 51, 52)  # the --steps window of the later recording

# A small MLP; it prints each step's loss as Python writes the float (bit for bit). With
# "serve" / "serve-off" it serves itself, recording to argv[2] (with / without history).
JOB = """
import sys
import torch

mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode.startswith("serve"):
    import torchscope

    torchscope.serve(record=sys.argv[2], history=mode == "serve", quiet=True)
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for i in range(STEPS):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {i} {loss.item()!r}", flush=True)
"""


def said(stdout: str) -> dict[int, float]:
    """step -> the loss the job printed."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("step "):
            _, step, loss = line.split()
            out[int(step)] = float(loss)
    return out


def run(tmp_path: Path, *args: str) -> dict[int, float]:
    script = tmp_path / "job.py"
    script.write_text(JOB.replace("STEPS", str(STEPS)))
    argv = [sys.executable, *args, str(script)] if args else [sys.executable, str(script)]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = said(res.stdout)
    assert sorted(losses) == list(range(STEPS))
    return losses


def serve_run(tmp_path: Path, mode: str, out: Path) -> dict[int, float]:
    script = tmp_path / "job.py"
    script.write_text(JOB.replace("STEPS", str(STEPS)))
    res = subprocess.run(
        [sys.executable, str(script), mode, str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return said(res.stdout)


def history_points(events: list[dict]) -> list[dict]:
    return [p for e in events if e["kind"] == HISTORY for p in e["points"]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return run(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def window(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """A recording of steps 50-52 only (dormant before and after), and what the job printed."""
    tmp = tmp_path_factory.mktemp("window")
    out = tmp / "window.tsc"
    steps = f"{WINDOW[0]}-{WINDOW[-1]}"
    losses = run(tmp, "-m", "torchscope", "run", "--record", str(out), "--steps", steps)
    return out, losses


def test_run_record_writes_every_steps_loss_as_history_events(tmp_path: Path, plain):
    out = tmp_path / "f.tsc"
    losses = run(tmp_path, "-m", "torchscope", "run", "--record", str(out))
    assert losses == plain  # the job's numbers are untouched
    events = recorded(out)
    history = [e for e in events if e["kind"] == HISTORY]
    points = history_points(events)
    # Every step once, in order, each the value the job printed (bit for bit).
    assert [p["step"] for p in points] == list(range(STEPS))
    assert {p["step"]: p["loss"] for p in points} == losses
    assert all(p.get("traced") for p in points)  # --record alone traces every step
    # Batched as the live events are (the collector's 32 points, or a second), in seq order
    # with the traced events, and naming no step of their own (a dormant step is no row).
    assert len(history) >= 3 and all(len(e["points"]) <= 32 for e in history)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs)
    assert all(e["step"] is None for e in history)
    # Nothing else about the recording changed: every step traced, no empty step after the
    # loop (the last history event goes out after the armed period's last events).
    assert sorted({e["step"] for e in events if e["kind"] == "step"}) == list(range(STEPS))
    dump = torchscope("dump", str(out), "--kind", "history")
    assert dump.returncode == 0, dump.stderr
    # one line per step (the table `history PID` prints), not one per batch
    rows = dump.stdout.splitlines()[1:]
    assert [int(x.split()[0]) for x in rows] == list(range(STEPS))
    assert rows[-1].split()[1] == f"{losses[STEPS - 1]:.6g}"
    every = torchscope("dump", str(out)).stdout  # among the other events: one per batch
    assert len([x for x in every.splitlines() if " history " in x]) == len(history)


def test_a_later_steps_window_still_carries_the_earlier_steps(window, plain):
    out, losses = window
    assert losses == plain
    events = recorded(out)
    points = history_points(events)
    assert {p["step"]: p["loss"] for p in points} == losses  # steps 0..49 and 53..69 too
    assert [p["step"] for p in points if p.get("traced")] == list(WINDOW)
    assert sorted({e["step"] for e in events if e["kind"] == "op"}) == list(WINDOW)
    # The chunk index names only steps that recorded something: the history events, which
    # name no step, add none (a replay lists the dormant steps as history rows only).
    with TraceReader(out) as reader:
        named = {s for c in reader.chunks for s in (c.first_step, c.last_step)}
    assert named <= {-1, 0, *WINDOW, WINDOW[-1] + 1}


def drive(source: FileSource, within: float = 120.0) -> list[InboxItem]:
    """Run ``source`` on its own thread, as the app does, until its count pass has gone
    through the whole file; asks for no step. Returns every inbox item."""
    inbox, stop = Inbox(), threading.Event()
    worker = threading.Thread(target=source.run, args=(inbox, stop), daemon=True)
    worker.start()
    items: list[InboxItem] = []

    def counted() -> bool:
        return any(
            isinstance(i, Progress) and i.label == "counting steps" and i.done >= i.total
            for i in items
        )

    deadline = time.monotonic() + within
    try:
        while not counted():
            assert time.monotonic() < deadline, f"never counted: {items}"
            assert not any(isinstance(i, ErrorMessage) for i in items), items
            items += inbox.drain()
            time.sleep(0.02)
    finally:
        stop.set()
        worker.join(timeout=30)
        source.close()
    return items + inbox.drain()


@pytest.mark.parametrize("count_pass", ["process", "thread"])
def test_a_replay_hands_over_the_history_before_any_step_is_loaded(window, count_pass):
    out, losses = window
    items = drive(FileSource(out, count_pass=count_pass))
    tags = [type(i) for i in items]
    assert WholeStep not in tags and StepPart not in tags  # nothing was loaded
    handed = [i.wire for i in items if isinstance(i, HistoryBatch)]
    assert handed and all(isinstance(w, dict) and w["kind"] == HISTORY for w in handed)
    assert {p["step"]: p["loss"] for w in handed for p in w["points"]} == losses
    last_count = max(i for i, t in enumerate(tags) if t is Counts)
    assert max(i for i, t in enumerate(tags) if t is HistoryBatch) < last_count
    store = EventStore()
    store.apply(items)
    assert [p.step for p in store.history.points] == list(range(STEPS))
    assert {p.step: p.loss for p in store.history.points} == losses
    assert [p.step for p in store.history.points if p.traced] == list(WINDOW)
    # Steps with events of their own only: no row for the stepless history events (-1) or
    # for the dormant steps their points cover.
    assert set(WINDOW) <= set(store.steps) <= {0, *WINDOW, WINDOW[-1] + 1}


@sync
async def test_the_ui_shows_a_recordings_whole_history_in_the_step_list_and_H(window):
    out, losses = window
    app = TorchscopeApp(FileSource(out), at_origin=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: len(app.store.history) == STEPS, what="the history")
        steps = app.main.steps
        want = set(range(1, STEPS)) - set(WINDOW)

        def history_rows() -> dict[int, str]:
            found = {}
            for i in range(steps.row_count()):
                point = steps.history_at(i)
                if point is not None:
                    found[point.step] = "".join(t for t, _ in steps.render_row(i, 40))
            return found

        # The step list takes the file's steps and its history in turns: wait for both.
        await until(pilot, lambda: set(history_rows()) == want, what="a row per step")
        rows = history_rows()
        # Every dormant step is a history row with its loss; the window's are traced rows
        # (and step 0, which the file's session event names: a row of its own, as in any
        # recording).
        assert set(rows) == set(range(1, STEPS)) - set(WINDOW)
        for step in (1, 10, WINDOW[0] - 1, WINDOW[-1] + 1, STEPS - 1):
            assert "not traced" in rows[step]
            assert float(rows[step].split()[1]) == pytest.approx(losses[step], abs=1e-3)
        await pilot.press("H")
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen), what="H")
        screen = app.screen
        await until(pilot, lambda: screen.plot.view == (0, STEPS), what="the whole run")


def test_serve_keeps_the_history_by_default_and_none_with_history_false(tmp_path: Path, plain):
    on, off = tmp_path / "on.tsc", tmp_path / "off.tsc"
    assert serve_run(tmp_path, "serve", on) == plain
    assert serve_run(tmp_path, "serve-off", off) == plain
    assert {p["step"]: p["loss"] for p in history_points(recorded(on))} == plain
    events = recorded(off)
    assert not history_points(events) and not [e for e in events if e["kind"] == HISTORY]
    assert {e["step"] for e in events if e["kind"] == "op"} == set(range(STEPS))  # traced still


def test_dump_jsonl_of_history_events_is_plain_json(window):
    out, _ = window
    res = torchscope("dump", str(out), "--kind", "history", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    events = [json.loads(x) for x in res.stdout.splitlines()]
    assert events and all(e["kind"] == HISTORY and e["points"] for e in events)
