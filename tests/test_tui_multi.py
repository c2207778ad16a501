"""Several sources in one UI (issue 11 item 5, issue 14's side by side, issue 12's compare):
the ranks of a job or two recordings, a selector that keeps the step and the op, the compare
view (aligned as ``torchscope diff`` aligns, the outlier marked), two steps of one recording,
stepping commands sent to every rank, and bad input among several targets."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tui_pilot import shows, sync, until

from torchscope.protocol.events import OP
from torchscope.protocol.tracefile import TraceWriter
from torchscope.session.align import row_key
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.lanes import lane_labels
from torchscope.tui.screens.compare import CompareScreen
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.live import LiveSource
from torchscope.tui.sources.open import expand_targets, open_sources
from torchscope.tui.widgets.source_bar import SourceBar

NORM = "torch.nn.functional.layer_norm"
MODULE = "blocks.1.norm"


def rank_trace(rank: int, world: int, *, shift: int = 0, scale: float | None = None, **kw):
    """A recording of rank ``rank``: the synthetic MLP with its seqs shifted by ``shift`` (so
    alignment cannot be by seq) and, with ``scale``, the output norm of step 1's layer_norm
    in blocks.1 multiplied by it."""
    events = [copy.deepcopy(dict(e)) for e in make_trace(3, 2, **kw)]
    for ev in events:
        if ev["kind"] == "session":
            ev.update(rank=rank, world_size=world, job="job-7" if world > 1 else None)
            continue
        for key in ("seq", "op_seq", "event_seq"):
            if type(ev.get(key)) is int:
                ev[key] += shift
        at = ev["kind"] == OP and ev["step"] == 1 and (ev["name"], ev["module"]) == (NORM, MODULE)
        if scale and at:
            ev["outputs"][0]["stats"]["norm"] *= scale
    return events


def write(path: Path, events) -> Path:
    with TraceWriter(path) as w:
        w.write(events)
    return path


def files(app: TorchscopeApp) -> list[FileSource]:
    return [lane.source for lane in app.lanes]


def bar(app: TorchscopeApp) -> str:
    return app.main.query_one(SourceBar).text


def seq_of(events, step: int, name: str = NORM, module: str = MODULE) -> int:
    return next(
        e["seq"]
        for e in events
        if e["kind"] == OP and e["step"] == step and e["name"] == name and e["module"] == module
    )


async def show(pilot, app: TorchscopeApp, step: int, seq: int) -> None:
    """Go to ``step`` (``:N``) and put the cursor on event ``seq``."""
    if app.main.current_step != step:
        assert app.main.run_command(f":{step}") is None
    await until(pilot, lambda: app.main.current_step == step, what=f"step {step}")
    await until(pilot, lambda: app.store.data(step) is not None, what=f"step {step} loaded")
    app.main.select_in_timeline(OP, seq)
    app.main.show_detail()
    await until(
        pilot,
        lambda: (r := app.main.timeline.current_row()) is not None and r.seq == seq,
        what=f"event #{seq}",
    )


def rank_files(
    tmp_path: Path, n: int = 2, options: dict | None = None
) -> tuple[list[Path], list[list[dict]]]:
    """``n`` ranks' files, seqs shifted by 100 per rank; ``options``: rank -> rank_trace's."""
    traces = [rank_trace(r, n, shift=100 * r, **(options or {}).get(r, {})) for r in range(n)]
    paths = [write(tmp_path / f"t.rank{r}.tsc", t) for r, t in enumerate(traces)]
    return paths, traces


def open_files(paths) -> TorchscopeApp:
    return TorchscopeApp([FileSource(p, count_pass=None) for p in paths])


# -- a selector over the ranks ------------------------------------------------------------------


@sync
async def test_two_rank_files_open_with_a_selector_and_switching_keeps_the_step_and_op(
    tmp_path: Path,
):
    paths, traces = rank_files(tmp_path)
    app = open_files(paths)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0, what="first step")
        await until(pilot, lambda: "2 rank 1" in bar(app), what="the ranks in the bar")
        assert "1 rank 0" in bar(app)
        await show(pilot, app, 1, seq_of(traces[0], 1))
        await pilot.press("2")
        assert app.current == 1
        await until(
            pilot,
            lambda: (
                (r := app.main.timeline.current_row()) is not None and r.seq == seq_of(traces[1], 1)
            ),
            what="the same op on rank 1",
        )
        row = app.main.timeline.current_row()
        assert (app.main.current_step, row.name, row.module) == (1, NORM, MODULE)
        assert app.status.get("rank") == 1 and app.store is app.lanes[1].store
        text = await shows(pilot, "1 rank 0", "2 rank 1")
        assert "1 rank 0" in text and "2 rank 1" in text  # the bar, at 80x24
        assert "1-2 source" in app.main.key_bar.text
        # r cycles back; the op stays
        await pilot.press("r")
        assert app.current == 0
        await until(
            pilot,
            lambda: (
                (r := app.main.timeline.current_row()) is not None and r.seq == seq_of(traces[0], 1)
            ),
            what="back on rank 0",
        )
        await pilot.press("3")  # no third source: said, nothing changes
        assert app.current == 0


def test_labels_globs_and_rank_order(tmp_path: Path):
    for r in (0, 1, 2, 10):
        write(tmp_path / f"t.rank{r}.tsc", rank_trace(r, 11))
    found = expand_targets([str(tmp_path / "t.rank*.tsc")])
    assert [Path(p).name for p in found] == [f"t.rank{r}.tsc" for r in (0, 1, 2, 10)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write(tmp_path / "a" / "run.tsc", make_trace(1, 1))
    b = write(tmp_path / "b" / "run.tsc", make_trace(1, 1))
    app = TorchscopeApp([FileSource(a, count_pass=None), FileSource(b, count_pass=None)])
    assert lane_labels(app.lanes) == ["a/run.tsc", "b/run.tsc"]


# -- compare -----------------------------------------------------------------------------------


@sync
async def test_compare_view_aligns_the_op_across_ranks_and_marks_the_outlier(tmp_path: Path):
    paths, traces = rank_files(tmp_path, 3, {2: {"scale": 10.0}})
    app = open_files(paths)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0, what="first step")
        await show(pilot, app, 1, seq_of(traces[0], 1))
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, CompareScreen), what="compare")
        screen = app.screen
        await until(
            pilot, lambda: screen.table is not None and screen.table.aligned, what="aligned"
        )
        table = screen.table
        assert [c.label for c in table.columns] == ["rank 0", "rank 1", "rank 2"]
        assert [c.event["seq"] for c in table.columns] == [seq_of(t, 1) for t in traces]
        assert {(c.event["name"], c.event["module"], c.step) for c in table.columns} == {
            (NORM, MODULE, 1)
        }
        assert table.outlier == 2
        assert table.why.startswith("outlier: rank 2: outputs[0] norm")
        norms = next(cells for label, cells in table.rows if label == "  norm")  # outputs[0]
        assert [c.outlier for c in norms] == [False, False, True]
        text = await shows(pilot, "◆ rank 2", "outlier: rank 2")
        assert "◆ rank 2" in text and "outlier: rank 2" in text
        await pilot.press("escape")
        assert app.screen is app.main


@sync
async def test_two_recordings_side_by_side_the_one_with_a_nan_is_the_outlier(tmp_path: Path):
    a = write(tmp_path / "A.tsc", make_trace(3, 2))
    b_events = make_trace(3, 2, nan_step=1)
    b = write(tmp_path / "B.tsc", b_events)
    alert = next(e for e in b_events if e["kind"] == "alert")
    origin = next(e for e in b_events if e["seq"] == alert["event_seq"])
    app = open_files([a, b])
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: "2 B.tsc" in bar(app), what="both recordings in the bar")
        assert "1 A.tsc" in bar(app)
        await pilot.press("2")
        await show(pilot, app, 1, origin["seq"])
        await pilot.press("1")  # A at the same op
        await until(
            pilot,
            lambda: (
                (r := app.main.timeline.current_row()) is not None
                and r.name == origin["name"]
                and r.module == origin["module"]
            ),
            what="A at the op where B's NaN appears",
        )
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, CompareScreen))
        screen = app.screen
        await until(pilot, lambda: screen.table is not None and screen.table.aligned)
        assert [c.label for c in screen.table.columns] == ["A.tsc", "B.tsc"]
        assert screen.table.outlier == 1
        assert "NaN/Inf" in screen.table.why


@sync
async def test_compare_the_same_op_in_two_steps_of_one_recording(tmp_path: Path):
    events = make_trace(3, 2)
    app = TorchscopeApp(FileSource(write(tmp_path / "t.tsc", events), count_pass=None))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.main.timeline.row_count() > 0)
        await pilot.press("x")  # nothing to compare with yet: said
        assert app.screen is app.main
        await show(pilot, app, 0, seq_of(events, 0))
        await pilot.press("X")
        assert app.mark is not None and app.mark[1] == 0
        assert "x compare with mark" in app.main.key_bar.text
        await show(pilot, app, 2, seq_of(events, 2))
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, CompareScreen))
        table = app.screen.table
        assert [c.label for c in table.columns] == ["marked: step 0", "step 2"]
        assert [c.event["seq"] for c in table.columns] == [seq_of(events, 0), seq_of(events, 2)]
        await pilot.press("escape")
        # another op selected: its column, and the marked op in this step beside it
        other = seq_of(events, 2, "torch.nn.functional.gelu", "blocks.0.act")
        await show(pilot, app, 2, other)
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, CompareScreen))
        table = app.screen.table
        assert [c.label for c in table.columns] == [
            "marked: step 0",
            "step 2",
            "step 2: the marked op",
        ]
        assert [c.event["seq"] for c in table.columns] == [
            seq_of(events, 0),
            other,
            seq_of(events, 2),
        ]


# -- live ranks: commands go to every rank --------------------------------------------------------


def fake_rank(rank: int, session: dict | None = None, **kw) -> FakeJob:
    events = rank_trace(rank, 2)
    events[0].update(session or {})
    return FakeJob(events, **kw)


def first_seq(events, name: str, step: int = 0) -> int:
    return next(e["seq"] for e in events if e["step"] == step and e.get("name") == name)


GELU = "torch.nn.functional.gelu"


@sync
async def test_c_s_n_go_to_every_rank_and_o_narrows_them_to_the_shown_one():
    trace = rank_trace(0, 2)
    timeout = {"pg_timeout_s": 1800.0}  # when the session event says it (a real job: state)
    jobs = [fake_rank(r, timeout, pause_at=first_seq(trace, GELU)) for r in (0, 1)]
    app = TorchscopeApp(jobs)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: all(lane.paused for lane in app.lanes), what="both paused")
        await until(pilot, lambda: re.search(r"2/2 paused 0:0\d of 30:00 pg timeout", bar(app)))
        assert "c s n → all 2" in bar(app)
        for key, cmd in (("s", "step"), ("n", "next")):
            await pilot.press(key)
            await until(pilot, lambda c=cmd: all(c in [x for x, _ in j.received] for j in jobs))
        await until(pilot, lambda: all(lane.paused for lane in app.lanes), what="next step")
        await pilot.press("o")
        assert app.scope == "one"
        await until(pilot, lambda: "rank 0 only" in bar(app))
        await pilot.press("s")
        await until(pilot, lambda: [c for c, _ in jobs[0].received][-1] == "step")
        await pilot.press("o")
        await pilot.press("c")
        await until(pilot, lambda: all(j.received[-1][0] == "continue" for j in jobs))
        assert [c for c, _ in jobs[0].received] == ["step", "next", "step", "continue"]
        assert [c for c, _ in jobs[1].received] == ["step", "next", "continue"]
        assert [c for c, _ in app.lanes[1].sent] == ["step", "next", "continue"]


@sync
async def test_another_ranks_pause_is_said_with_its_reason_but_never_paused_paused():
    at = first_seq(rank_trace(0, 2), GELU)
    for reason, toast in (("paused", "rank 1 paused (2)"), ("step", "rank 1 paused: step (2)")):
        jobs = [fake_rank(r, pause_at=at, reason=why) for r, why in ((0, "paused"), (1, reason))]
        app = TorchscopeApp(jobs)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda a=app: all(lane.paused for lane in a.lanes), what="paused")
            # rank 0 is shown, its pause in the status bar; rank 1's is said, with its key
            await until(pilot, lambda a=app, t=toast: [n.message for n in a._notifications] == [t])


@sync
async def test_a_rank_stopping_at_a_breakpoint_pauses_the_others():
    trace = rank_trace(0, 2)
    start = next(i for i, e in enumerate(trace) if e.get("seq") == first_seq(trace, GELU))
    jobs = [
        fake_rank(0, start=start),
        fake_rank(1, start=start, breakpoints=[{"op": "^torch.nn.functional.layer_norm$"}]),
    ]
    app = TorchscopeApp(jobs)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: all(lane.status.get("connected") for lane in app.lanes))
        await pilot.press("c")
        await until(pilot, lambda: app.lanes[1].paused is not None, what="rank 1 at its break")
        await until(pilot, lambda: [c for c, _ in jobs[0].received] == ["continue", "pause"])
        assert [c for c, _ in jobs[1].received] == ["continue"]


# -- opening ------------------------------------------------------------------------------------


def test_a_pid_of_a_torchrun_rank_opens_every_rank_of_its_job(monkeypatch):
    from torchscope.protocol import endpoints as ep

    records = [
        ep.SessionRecord(
            pid=1000 + r, rank=r, world_size=2, job="j1", host="h", control=f"ipc:///x/{r}"
        )
        for r in (1, 0)
    ] + [ep.SessionRecord(pid=2000, rank=None, world_size=None, host="h", control="ipc:///y")]
    monkeypatch.setattr(ep, "list_sessions", lambda: list(records))
    sources, first = open_sources(["1001"])
    assert [type(s) for s in sources] == [LiveSource, LiveSource]
    assert [s.target for s in sources] == ["ipc:///x/0", "ipc:///x/1"] and first == 1
    sources, first = open_sources(["2000"])  # a single process: one source
    assert len(sources) == 1 and sources[0].target == "2000"
    monkeypatch.setattr(ep, "list_sessions", lambda: list(records[:2]))
    sources, first = open_sources([])  # the one running job: all its ranks
    assert [s.target for s in sources] == ["ipc:///x/0", "ipc:///x/1"] and first == 0


@pytest.mark.parametrize("bad", ["missing", "corrupt", "not a trace"])
def test_bad_input_among_several_is_one_line_and_exit_2_before_the_screen(tmp_path, bad):
    good = write(tmp_path / "t.rank0.tsc", rank_trace(0, 2))
    other = tmp_path / "t.rank1.tsc"
    if bad == "corrupt":
        data = write(other, rank_trace(1, 2)).read_bytes()
        other.write_bytes(data[:40] + b"\xff" * 64 + data[104:])
    elif bad == "not a trace":
        other.write_text("hello\n")
    proc = subprocess.run(
        [sys.executable, "-m", "torchscope", "tui", str(good), str(other)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and str(other) in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_row_keys_follow_diffs_alignment(tmp_path: Path):
    from torchscope.analysis.align import group_by_step
    from torchscope.session.store import EventStore

    events = rank_trace(0, 2)
    store = EventStore()
    store.ingest(events)
    data = store.data(1)
    by_key = group_by_step(events)[1]
    for t in data.rows[:40]:
        row = data.view(t)
        assert by_key[row_key(store, data, row)]["seq"] == row.seq


# -- end to end: one UI over both ranks of a real torchrun job -----------------------------------


@sync
async def test_one_ui_over_both_ranks_of_a_real_torchrun_job(tmp_path: Path):
    """Rank 1 stops at its NaN (step 3); the UI, opened on rank 1's pid, holds both ranks of
    the job, pauses rank 0 too, and ``c`` lets both go on: the job ends with exit 0."""
    pytest.importorskip("torch")
    import time

    from ranks import NAN_JOB, ended_well, torchrun

    from torchscope.protocol import endpoints as ep

    job = torchrun(
        "-m", "torchscope", "run", "--break-on", "nan,step:3", "--lease", "5", str(NAN_JOB),
        cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        ranks: list = []
        while len(ranks) < 2:
            assert time.monotonic() < deadline and job.poll() is None, "no sessions"
            mine = [r for r in ep.list_sessions() if r.job is not None and r.pid != job.pid]
            rank1 = next((r for r in mine if r.rank == 1), None)
            ranks = ep.job_sessions(rank1) if rank1 is not None else []
            time.sleep(0.1)
        # A UI given one rank's endpoint (as through a tunnel to another host) finds the
        # others through the job: every rank registers in its c10d store at a step boundary.
        from torchscope.protocol.client import SessionClient, SessionRefused

        with SessionClient() as probe:
            probe.connect(ranks[1], timeout=30)
            while True:
                try:
                    probe.request("ranks")
                    break
                except SessionRefused:
                    assert time.monotonic() < deadline, "the ranks never registered"
                    time.sleep(0.05)
        by_endpoint, first = open_sources([ranks[1].control])
        assert [s.target for s in by_endpoint] == [r.control for r in ranks] and first == 1
        for source in by_endpoint:
            source.close()
        sources, first = open_sources([str(ranks[1].pid)])
        assert len(sources) == 2 and first == 1
        app = TorchscopeApp(sources, first=first)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.lanes[1].paused is not None, 60, "rank 1's NaN")
            # the labels come with each rank's session event, which may follow the pause
            labelled = lambda: "1 rank 0" in bar(app) and "2 rank 1" in bar(app)  # noqa: E731
            await until(pilot, labelled, 60, "both ranks labelled")
            assert app.lanes[1].paused["reason"] == "breakpoint 1"
            await until(pilot, lambda: ("pause", {}) in app.lanes[0].sent, 60, "rank 0 paused")
            await until(pilot, lambda: "paused" in bar(app), 60, "the bar says so")
            # ... against the process group's timeout (5 s), as the ranks' steppers report it
            await until(pilot, lambda: "of 0:05 pg timeout" in bar(app), 60, "the pg timeout")
            await pilot.press("c")
            await until(pilot, lambda: all(("continue", {}) in lane.sent for lane in app.lanes))
            await until(pilot, lambda: app.lanes[1].paused is None, 30, "rank 1 goes on")
            await pilot.press("q")
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert ended_well(job, err), err[-3000:]  # or gloo's abort at exit
    assert len([line for line in out.splitlines() if line.startswith("rank ")]) == 12  # 2 x 6


@sync
async def test_ranks_that_start_after_the_ui_join_it(monkeypatch):
    """``torchscope tui`` before every rank of a torchrun job has registered: the others are
    added as they come (rank 1 here)."""
    from torchscope.protocol import endpoints as ep

    records = [
        ep.SessionRecord(pid=10 + r, rank=r, world_size=2, job="job-7", control=f"ipc:///j/{r}")
        for r in (0, 1)
    ]
    monkeypatch.setattr(ep, "list_sessions", lambda: list(records))
    app = TorchscopeApp(fake_rank(0), follow_job=True)
    app.JOB_POLL_SECONDS = 0.1
    joined: list = []
    app.source_for = lambda record: joined.append(record.rank) or fake_rank(record.rank)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(app.lanes) == 2, what="rank 1 joined")
        await until(pilot, lambda: "2 rank 1" in bar(app), what="in the bar")
        # the next poll finds every rank here and stops following the job (no more joins)
        await until(pilot, lambda: not app.follow_job, what="the job's ranks all here")
        assert joined == [1] and not app.follow_job


def test_compare_table_two_columns_says_what_diff_would_and_a_lone_nan_is_the_outlier():
    from torchscope.session.compare import Column, build_table

    events = make_trace(2, 1, nan_step=1)
    node = next(e for e in events if e["kind"] == "grad" and e["step"] == 0)
    other = copy.deepcopy(dict(node))
    other["grad_inputs"][0]["stats"]["norm"] *= 2
    table = build_table([Column("A", 0, dict(node)), Column("B", 0, other)])
    assert table.outlier is None and table.why.startswith("they differ: grad_inputs[0] norm")
    assert build_table([Column("A", 0, dict(node)), Column("B", 0, dict(node))]).why == (
        "the same within the tolerance"
    )
    bad = copy.deepcopy(dict(node))
    bad["grad_inputs"][0]["stats"].update(nan=3, norm=float("nan"))
    table = build_table([Column("A", 0, dict(node)), Column("B", 0, bad), Column("C", 0, None)])
    assert table.outlier == 1 and "NaN/Inf" in table.why
    assert table.columns[2].event is None and not table.aligned


def test_the_bar_says_which_rank_waits_for_a_paused_one():
    """A rank held in a meeting of the ranks by a paused one (its heartbeats carry
    ``waiting``) is named in the source bar with the rank it waits for."""
    from types import SimpleNamespace

    from torchscope.tui.widgets.source_bar import waiting_text

    wait = {"before": "DistributedDataParallel.forward", "step": 7, "here": 1, "of": 2}
    held = SimpleNamespace(live=True, status={"waiting": {**wait, "paused": {"1": "torch.randn"}}})
    assert waiting_text(held, "rank 0") == "rank 0 waits for rank 1"
    unknown = SimpleNamespace(live=True, status={"waiting": wait})
    assert waiting_text(unknown, "rank 0") == "rank 0 waits for the other ranks"
    running = SimpleNamespace(live=True, status={"waiting": None})
    assert waiting_text(running, "rank 0") == ""
