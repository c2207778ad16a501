"""The alerts of a multi-rank job in the UI (issue 23): each NaN/Inf origin once in the whole
job, in the same words on every rank's lane, with its consequences counted across ranks and
steps; the rank it reached lists its arrival under it, linked to it; ``a`` then enter on it
shows the origin's event in the lane of the rank that made it."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
from ranks import ONE_NAN_JOB, bad_line, ended_well, finish, kill, rank_alerts, torchrun
from tui_pilot import sync, until

from torchscope.analysis.render import job_origin_text
from torchscope.analysis.trace import job_origins
from torchscope.protocol.tracefile import TraceWriter
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.file import FileSource
from torchscope.tui.widgets.alert_list import AlertList

SIZE = (120, 40)  # the stacked layout: the alerts list is 22 columns wide


@pytest.fixture(scope="module")
def one_inf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[dict]]]:
    """ONE_NAN_JOB recorded once on 2 gloo ranks with JOB_BAD=batch_inf: rank 1 writes an
    Inf into its batch at step 4; DDP's all-reduce brings the NaN it makes to rank 0. Run as
    ``job.py`` in its own folder, so that the paths the UI shortens are ``job.py:N``."""
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("one_inf")
    shutil.copy(ONE_NAN_JOB, tmp / "job.py")
    job = torchrun(
        "-m", "torchscope", "run", "--quiet", "--record", "r.tsc", "job.py",
        cwd=tmp, env={"JOB_BAD": "batch_inf"},
    )  # fmt: skip
    try:
        ((_, err),) = finish(job, timeout=80)
    finally:
        kill(job)
    assert ended_well(job, err), err[-3000:]
    return tmp, rank_alerts(lambda r: tmp / f"r.rank{r}.tsc")


def open_ranks(tmp: Path, at_origin: bool = False) -> TorchscopeApp:
    """Both ranks' files; from rank 0's first step unless ``at_origin`` (a user's default).
    The count pass on the sources' threads: every step's alerts, without child processes."""
    sources = [FileSource(tmp / f"r.rank{r}.tsc", count_pass="thread") for r in (0, 1)]
    return TorchscopeApp(sources, at_origin=at_origin)


def detail_text(app: TorchscopeApp) -> str:
    """The detail panel's text, unwrapped."""
    return str(app.main.detail.body.render())


def shown(app: TorchscopeApp) -> list[str]:
    """The lines of the alerts list, as it renders them."""
    alerts = app.main.query_one(AlertList)
    return [str(alerts.get_option_at_index(i).prompt) for i in range(alerts.option_count)]


# The origin's line, alike on both lanes: rank 1's words, the ranks it reached, and its
# consequences across the job: on rank 1 the 4 parameters the optimizer wrote NaN at step 5;
# on rank 0 the arrival at step 4 and its own 4 parameters at step 5.
ORIGIN = (
    "   4 Inf first appears in Tensor.__setitem__ (forward) at job.py:{line} · rank 1 · "
    "reached ranks 0, 1 · +9 consequences over steps 4-5"
)
ARRIVAL = (
    "   4 ↳ NaN arrived here via torch.distributed.ddp_gradient_sync · from rank 1's origin "
    "above, counted there"
)


@sync
async def test_each_rank_lists_the_job_origin_once_alike_and_enter_shows_it_on_rank_1(
    one_inf: tuple[Path, dict[int, list[dict]]],
) -> None:
    tmp, alerts = one_inf
    (origin,) = job_origins(alerts)
    assert origin["job_consequences"] == 9 and origin["job_consequence_steps"] == [4, 5]
    line = ORIGIN.format(line=bad_line("batch_inf"))
    app = open_ranks(tmp)
    async with app.run_test(size=SIZE) as pilot:
        listed = app.main.query_one(AlertList)
        # Rank 0 (shown first) made nothing: the job's one origin, rank 1's, then the
        # arrival here under it.
        await until(pilot, lambda: shown(app) == [line, ARRIVAL], what="rank 0's job view")
        assert listed.border_subtitle == "job: 1 origin · 10"  # the origin and its 9
        await pilot.press("2")
        await until(pilot, lambda: shown(app) == [line], what="rank 1's job view")
        assert listed.border_subtitle == "job: 1 origin · 10"
        # The detail says the same, and counts the consequences by rank.
        await pilot.press("a")
        await until(pilot, lambda: "rank 0: arrival" in detail_text(app), what="the detail")
        lines = detail_text(app).splitlines()
        assert lines[0] == "⚠ " + line.strip()[2:]  # the line's words, without its step
        assert lines[-4:] == [
            "9 knock-on alerts (NaN/Inf coming in from it, not new causes)",
            "  step 4 · 1x rank 0: arrival through torch.distributed.ddp_gradient_sync",
            "  step 5 · 4x rank 1: parameters",
            "  step 5 · 4x rank 0: parameters",
        ]
        # From rank 0's lane, enter on the origin shows rank 1's lane at the origin's event.
        await pilot.press("1")
        await until(pilot, lambda: shown(app) == [line, ARRIVAL], what="back on rank 0")
        assert app.main.current_step != 4  # it has to go there
        await pilot.press("a")
        assert listed.has_focus and listed.highlighted == 0
        await pilot.press("enter")
        await until(
            pilot,
            lambda: (
                app.current == 1
                and app.main.current_step == 4
                and (r := app.main.timeline.current_row()) is not None
                and r.seq == origin["event_seq"]
            ),
            what="the origin's event in rank 1's lane",
        )
        assert app.main.timeline.current_row().name == "Tensor.__setitem__"
        assert shown(app) == [line]


@sync
async def test_the_ranks_of_a_job_open_paused_at_the_origin_on_the_rank_that_made_it(
    one_inf: tuple[Path, dict[int, list[dict]]],
) -> None:
    """Rank 0's recording holds only the arrival: the job opens on rank 1's lane, paused at
    the origin, the status bar telling its story."""
    tmp, alerts = one_inf
    (origin,) = job_origins(alerts)
    app = open_ranks(tmp, at_origin=True)
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: app.current == 1 and app.store.stepper.paused is not None,
            what="rank 1's lane, paused",
        )
        paused = app.store.stepper.paused
        assert paused["event"]["seq"] == origin["event_seq"] and paused["reason"] == "origin"
        await until(
            pilot,
            lambda: "⏸ Inf first appears: Tensor.__setitem__" in app.screen_text(),
            what="the story",
        )
        assert app.main.current_step == 4


@sync
async def test_from_the_arrival_up_to_the_origin_lands_on_it_not_on_the_aligned_op(
    one_inf: tuple[Path, dict[int, list[dict]]],
) -> None:
    """On rank 0's arrival (step 4, the gradient sync), enter on the origin above: rank 1's
    lane keeps step 4, not read yet, and switching lanes lands on the op aligned with the one
    left once it is read; the jump goes to the origin all the same."""
    tmp, alerts = one_inf
    (origin,) = job_origins(alerts)
    (arrival,) = [a for a in alerts[0] if a.get("arrived")]
    app = open_ranks(tmp)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(shown(app)) == 2, what="rank 0's job view")
        await pilot.press("a", "j", "enter")
        await until(
            pilot,
            lambda: (
                app.main.current_step == 4
                and (r := app.main.timeline.current_row()) is not None
                and r.seq == arrival["event_seq"]
            ),
            what="the arrival's event on rank 0",
        )
        assert not app.lanes[1].store.is_resident(4)
        await pilot.press("a", "k", "enter")
        await until(
            pilot,
            lambda: (
                app.current == 1
                and app.store.is_resident(4)
                and (r := app.main.timeline.current_row()) is not None
                and r.seq == origin["event_seq"]
            ),
            what="the origin's event in rank 1's lane",
        )
        # and it stays there (the aligned op does not take its place afterwards): once the
        # step is read whole, what the source had queued applied and its messages handled
        await until(pilot, lambda: 4 not in app.store.loading, what="step 4 read whole")
        app.tick()
        await pilot.pause()
        assert app.main.timeline.current_row().seq == origin["event_seq"]


# -- crafted: the alerts exactly as the tracer writes them (see the recording above) ----------

WORDS = "NaN first appears in Tensor.__setitem__ (forward) at /job/train.py:27"


def rank1_alerts() -> list[dict]:
    return [
        {"kind": "alert", "seq": 9, "step": 1, "what": "nan", "where": "forward",
         "origin": "1:9", "event_seq": 8, "name": "Tensor.__setitem__",
         "source": "/job/train.py:27", "message": WORDS},
        {"kind": "alert", "seq": 20, "step": 2, "what": "nan", "where": "consequences",
         "origin": "1:9", "consequences": 4, "consequence_steps": [2, 2],
         "first_consequences": [], "message": "4 consequences"},
    ]  # fmt: skip


def rank0_alerts() -> list[dict]:
    return [
        {"kind": "alert", "seq": 7, "step": 1, "what": "nan", "where": "arrival",
         "arrival": "0:7", "arrived": True, "event_seq": 6,
         "name": "torch.distributed.ddp_gradient_sync from another rank",
         "message": "NaN arrives through torch.distributed.ddp_gradient_sync from another rank"},
        {"kind": "alert", "seq": 8, "step": 1, "what": "nan", "where": "arrival",
         "event_seq": None, "name": "rank 1", "arrival": "0:7", "from_rank": 1,
         "linked_origin": "1:9", "origin_step": 1, "message": f"NaN arrived from rank 1: {WORDS}"},
        {"kind": "alert", "seq": 21, "step": 2, "what": "nan", "where": "consequences",
         "arrival": "0:7", "consequences": 3, "consequence_steps": [2, 2],
         "first_consequences": [], "message": "3 consequences"},
    ]  # fmt: skip


def with_alerts(events: list[dict], alerts: list[dict]) -> list[dict]:
    """``events`` with each alert after the last event of its step, where the tracer
    writes it."""
    out = list(events)
    for alert in alerts:
        at = max(i for i, e in enumerate(out) if e.get("step") == alert["step"])
        out.insert(at + 1, alert)
    return out


def rank_file(tmp: Path, rank: int, alerts: list[dict]) -> Path:
    """A 3-step recording of rank ``rank`` of a 2-rank job run in /job, with ``alerts``."""
    events = [copy.deepcopy(dict(e)) for e in make_trace(3, 2)]
    for ev in events:
        if ev["kind"] == "session":
            ev.update(rank=rank, world_size=2, job="job-23", cwd="/job")
    path = tmp / f"c.rank{rank}.tsc"
    with TraceWriter(path) as w:
        w.write(with_alerts(events, alerts))
    return path


def test_the_origin_line_is_the_origins_words_its_rank_and_its_count_across_the_job() -> None:
    (origin,) = job_origins({0: rank0_alerts(), 1: rank1_alerts()})
    # its own 4, and on rank 0 the arrival (step 1) and 3 more (step 2)
    assert (origin["job_consequences"], origin["job_consequence_steps"]) == (8, [1, 2])
    assert [(c["rank"], c["step"], c.get("where")) for c in origin["job_first_consequences"]] == [
        (0, 1, "arrival")
    ]
    assert job_origin_text(origin, "/job") == (
        "NaN first appears in Tensor.__setitem__ (forward) at train.py:27 · rank 1 · "
        "reached ranks 0, 1 · +8 consequences over steps 1-2"
    )
    alone = job_origins({1: rank1_alerts()})[0]
    assert job_origin_text(alone, "/elsewhere") == f"{WORDS} · rank 1 · +4 consequences at step 2"


@sync
async def test_the_shown_lane_takes_the_origin_another_rank_names_later(tmp_path: Path) -> None:
    """Rank 0's arrival is listed on its own until rank 1's origin comes (a live rank, or
    its file's count pass after rank 0's): then rank 0's list, shown all along, becomes the
    job's origin with the arrival under it, without the user going anywhere."""
    paths = [rank_file(tmp_path, 0, rank0_alerts()), rank_file(tmp_path, 1, [])]
    # (from the first step: opening at the origin would show rank 1's lane once it comes)
    app = TorchscopeApp([FileSource(p, count_pass="thread") for p in paths], at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        listed = app.main.query_one(AlertList)
        # (once both ranks' sessions are read: the job view)
        await until(
            pilot, lambda: listed.border_subtitle == "job: 1 arrival · 4", what="the arrival"
        )  # it and its 3 consequences
        (arrival,) = shown(app)
        assert "NaN arr" in arrival and "(from rank 1)" in arrival
        app.lanes[1].inbox.put_events(rank1_alerts())
        line = (
            "   1 NaN first appears in Tensor.__setitem__ (forward) at train.py:27 · rank 1 · "
            "reached ranks 0, 1 · +8 consequences over steps 1-2"
        )
        await until(pilot, lambda: shown(app)[0] == line, what="rank 1's origin on rank 0")
        assert shown(app)[1].startswith("   1 ↳ NaN arrived here via torch.distributed.ddp_")
        assert listed.border_subtitle == "job: 1 origin · 9"
        assert app.current == 0


@sync
async def test_recordings_side_by_side_keep_their_own_alerts(tmp_path: Path) -> None:
    """Two recordings that are not ranks of one job (each a 1-rank run): each lane lists
    its own alerts, as one recording does; no job view."""
    events = [copy.deepcopy(dict(e)) for e in make_trace(3, 2)]
    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.tsc"
        with TraceWriter(path) as w:
            w.write(with_alerts(events, rank1_alerts()))
        paths.append(path)
    app = TorchscopeApp([FileSource(p, count_pass="thread") for p in paths])
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(shown(app)) == 1, what="a's alerts")
        assert shown(app)[0].startswith("   1 NaN fwd Tensor.__setitem__")
        assert "+4 knock-on" in shown(app)[0] and "rank" not in shown(app)[0]
        assert app.main.query_one(AlertList).border_subtitle == "1 origin · 5"
