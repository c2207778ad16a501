"""A loss spike the watch caught, on every surface: recorded (its alert with its figures, the
history's marks), the UI's alert list and history plot, ``torchscope history``, the MCP tools
``alerts`` and ``history``, and ``torchscope diff`` of a run that skipped it against one
that applied it. Two real recordings of one job with a bad batch at step 80."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_watch_spike import BAD, JOB
from tui_pilot import sync, until

import torchscope
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.screens.history import HistoryScreen
from torchscope.tui.sources.file import FileSource
from torchscope.tui.widgets.alert_list import AlertList
from torchscope.tui.widgets.history_plot import GUTTER, LEGEND, SPIKE_SKIPPED


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """skip.tsc: ``--watch nan,spike --on-spike skip``, every step traced; plain.tsc: the
    same job without the watch (its step 80 update applied)."""
    where = tmp_path_factory.mktemp("spikes")
    (where / "train.py").write_text(JOB.replace("BAD", str(BAD)))
    watched = ["--watch", "nan,spike", "--on-spike", "skip", "--steps", "all"]
    res = cli("run", *watched, "--record", "skip.tsc", "train.py", cwd=where)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"skipped the update of step {BAD}" in res.stderr
    res = cli("run", "--record", "plain.tsc", "train.py", cwd=where)
    assert res.returncode == 0, res.stderr[-3000:]
    return where


def spike_alerts(path: Path) -> list[dict]:
    return [a for a in torchscope.load(str(path)).alerts if a.get("what") == "spike"]


def test_the_recording_holds_the_spike_alert_with_its_figures_and_the_history_marks(runs):
    (alert,) = spike_alerts(runs / "skip.tsc")
    assert alert["step"] == BAD and alert["message"].startswith(f"loss spike at step {BAD}: ")
    figures = alert["spike"]
    assert figures["lead"] == "loss" and figures["on_spike"] == "skip"
    assert figures["loss"] > 10 * figures["loss_median"] > 0
    assert figures["grad_norm"] > 20 * figures["grad_median"] > 0
    res = cli("history", "skip.tsc", "--format", "jsonl", cwd=runs)
    assert res.returncode == 0, res.stderr
    points = {p["step"]: p for p in map(json.loads, res.stdout.splitlines())}
    assert set(points) == set(range(120))
    assert [s for s, p in points.items() if p.get("spike")] == [BAD]
    assert [s for s, p in points.items() if p.get("skipped")] == [BAD]
    assert points[BAD]["line"] == alert["message"]


def test_history_prints_the_spike_in_its_row_and_its_line_under_the_table(runs):
    res = cli("history", "skip.tsc", cwd=runs)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines() if line[:12].strip()}
    assert rows[str(BAD)].split()[3] == "spk,skip"
    assert "UPDATE" in rows["STEP"] and len(rows[str(BAD - 1)].split()) < len(
        rows[str(BAD)].split()
    )
    tail = res.stdout.split("spikes the watch caught:\n", 1)[1].strip()
    assert tail.startswith(f"loss spike at step {BAD}: loss ")
    assert tail.endswith("(its update skipped)")


def test_diff_names_the_skipped_step_before_the_numbers_that_follow_it(runs):
    res = cli("diff", "skip.tsc", "plain.tsc", cwd=runs)
    assert res.returncode == 1, res.stderr
    out = res.stdout
    assert f"step {BAD} skipped (loss spike) in A; applied in B" in out
    assert f"losses (history) agree before step {BAD + 1}" in out
    assert f"first divergence (numeric), step {BAD + 1}: " in out
    assert f"(after step {BAD}, whose update was skipped (loss spike) in A" in out
    assert out.index("skipped (loss spike) in A") < out.index("first divergence")
    back = cli("diff", "plain.tsc", "skip.tsc", cwd=runs)
    assert f"step {BAD} applied in A; skipped (loss spike) in B" in back.stdout
    same = cli("diff", "skip.tsc", "skip.tsc", cwd=runs)
    assert same.returncode == 0 and "same: no divergence" in same.stdout


def test_the_mcp_tools_return_the_spike_with_its_fields(runs):
    pytest.importorskip("mcp")
    import anyio
    from mcp import Client

    from torchscope.mcp.server import build_server

    path = str(runs / "skip.tsc")

    async def go() -> None:
        async with Client(build_server(), mode="legacy") as client:
            res = await client.call_tool("alerts", {"target": path})
            assert not res.is_error, res.content[0].text
            (spike,) = res.structured_content["alerts"]
            assert spike["what"] == "spike" and spike["step"] == BAD and not spike["origin"]
            assert spike["message"].startswith(f"loss spike at step {BAD}: ")
            assert spike["spike"]["on_spike"] == "skip" and spike["spike"]["lead"] == "loss"
            assert spike["spike"]["loss"] > spike["spike"]["loss_median"]
            res = await client.call_tool("history", {"job": path, "last": 500})
            assert not res.is_error, res.content[0].text
            points = {p["step"]: p for p in res.structured_content["points"]}
            assert len(points) == 120 and points[BAD]["spike"] and points[BAD]["skipped"]
            assert points[BAD]["line"] == spike["message"]
            assert "line" not in points[BAD - 1] and "spike" not in points[BAD - 1]
            res = await client.call_tool("diff", {"a": path, "b": str(runs / "plain.tsc")})
            report = res.structured_content["report"]
            assert f"  step {BAD} skipped (loss spike) in A; applied in B" in report

    anyio.run(go)


@sync
async def test_the_ui_lists_the_spike_and_marks_it_on_the_history_plot(runs):
    app = TorchscopeApp(FileSource(runs / "skip.tsc"), at_origin=False)
    async with app.run_test(size=(140, 44)) as pilot:
        alerts = app.main.query_one(AlertList)
        await until(pilot, lambda: len(alerts.rows) == 1, what="the spike in the alert list")
        label = alerts.rows[0].label
        assert label.startswith(f"{BAD:>4} SPIKE loss ") and label.endswith(" · update skipped")
        assert "over the last" in label and alerts.border_subtitle == "1 spike"
        await until(pilot, lambda: len(app.store.history) == 120, what="the history")
        alerts.focus()
        alerts.highlighted = 0
        await pilot.press("enter")  # a spike names no event: its step on the history plot
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen), what="H")
        screen = app.screen
        plot = screen.plot
        await until(pilot, lambda: plot.cursor == BAD, what="the cursor on the spike")
        assert plot.border_subtitle == LEGEND
        text = [plot.render_line(y).text for y in range(plot.size.height)]
        assert "spike, update skipped" in text[0]
        (marks,) = [t for t in text if t[:GUTTER].strip() == "marks│"]
        cells = marks[GUTTER:]
        assert cells.strip() == SPIKE_SKIPPED and cells.index(SPIKE_SKIPPED) == plot.x_of_step(BAD)
        note = screen.query_one("#history-note")
        assert note.display and f"loss spike at step {BAD}" in str(note.render())
        await pilot.press("left")
        await until(pilot, lambda: plot.cursor is not None and plot.cursor < BAD)
        await until(pilot, lambda: not note.display, what="the note gone off the spike")


# -- --on-spike pause through torchscope run, a client continues it ----------------------------
SPIKE_JOB = Path(__file__).parent / "jobs" / "spike_batch.py"
SPIKE_BAD = 40


def step_losses(stdout: str) -> list[str]:
    return [line.split()[2] for line in stdout.splitlines() if line.startswith("step ")]


def test_run_on_spike_pause_holds_at_the_module_that_jumped_and_a_client_continues_it(tmp_path):
    """``torchscope run --watch spike --on-spike pause --hold``: at the bad batch the job says
    at once on stderr where the spike comes from and that it is paused, in the replay, before
    the first module whose output jumped; a client sees the pause there and continues it; the
    job ends with exit 0 and the losses of the same run under ``--on-spike continue``."""
    from torchscope.protocol.client import SessionClient

    job = [str(SPIKE_JOB), "--bad", str(SPIKE_BAD)]
    run = [sys.executable, "-m", "torchscope", "run", "--watch", "spike"]
    proc = subprocess.Popen(
        [*run, "--on-spike", "pause", "--hold", *job],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        said: list[str] = []
        while not (said and said[-1].startswith("torchscope: paused at ")):
            line = proc.stderr.readline()  # the job holds there (--hold): this line comes
            assert line, "the job ended before it paused: " + "".join(said)
            said.append(line.rstrip("\n"))
        assert said[0].startswith(
            f"torchscope: running {SPIKE_JOB} dormant, watching every step (spike, then "
            "continue; on a spike: pause)"
        ), said[0]
        assert said[-4].startswith(f"torchscope: loss spike at step {SPIKE_BAD}: loss ")
        assert said[-2].startswith(
            "torchscope: the first module whose output jumped: model.0 (Linear), norm "
        )
        (at,) = [i for i, s in enumerate(SPIKE_JOB.read_text().splitlines(), 1) if "model(x)" in s]
        model_call = f"{SPIKE_JOB}:{at}"
        assert said[-1].startswith(
            f"torchscope: paused at torch.nn.functional.linear (before) at {model_call} by "
            f"breakpoint 1; attach: torchscope tui {proc.pid}; waits for a UI (--hold)"
        ), said[-1]
        with SessionClient() as client:
            client.connect(str(proc.pid))
            paused = client.request("state", timeout=30)["state"]["paused"]
            assert paused is not None, "the client does not see the pause"
            event = paused["event"]
            assert (event["step"], event["module"], event["name"]) == (
                SPIKE_BAD, "0", "torch.nn.functional.linear"
            ), paused  # fmt: skip
            client.request("continue", timeout=30)
        out = proc.stdout.read()
        err = proc.stderr.read()
        assert proc.wait(timeout=300) == 0, err[-3000:]
    finally:
        proc.kill()
    assert "Traceback" not in err
    went_on = cli("run", "--watch", "spike", "--on-spike", "continue", *job, cwd=tmp_path)
    assert went_on.returncode == 0, went_on.stderr[-3000:]
    assert f"loss spike at step {SPIKE_BAD}" in went_on.stderr
    losses = step_losses(out)
    assert len(losses) == 50 and losses == step_losses(went_on.stdout)
