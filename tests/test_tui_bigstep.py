"""A huge step opens progressively: the first rows at once, the rest streaming in."""

from __future__ import annotations

import threading

import pytest
from tui_pilot import SIZE, shows, sync, until

from torchscope.protocol.tracefile import TraceWriter
from torchscope.session.inbox import Inbox
from torchscope.session.items import StepAbort, StepIndex, StepPart
from torchscope.session.rows import prepare
from torchscope.session.steps import LOADING, ON_DISK, RESIDENT
from torchscope.session.store import EventStore
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import iter_trace, make_trace
from torchscope.tui.sources.file import FileSource


@pytest.fixture(scope="module")
def huge_step(tmp_path_factory):
    """One step of ~11k events in ~11 chunks, then a small step."""
    path = tmp_path_factory.mktemp("bigstep") / "huge.tsc"
    events = list(iter_trace(1, 1000))
    small = make_trace(2, 2)[-1000:]
    seq = events[-1]["seq"] + 1
    tail = []
    for e in small:
        if e.get("kind") == "session":
            continue
        e = dict(e, step=1, seq=seq)
        seq += 1
        tail.append(e)
    with TraceWriter(path, chunk_events=1024) as w:
        w.write(events)
        w.write(tail)
    n0 = sum(1 for e in events if e.get("step") == 0 and e.get("kind") in ("op", "grad"))
    return path, n0


class GatedSource(FileSource):
    """Decodes the first two chunks at once, the others only once ``gate`` is set."""

    def __init__(self, path, **kw):
        super().__init__(path, count_pass=None, **kw)
        self.gate = threading.Event()
        self.decoded: list[int] = []

    def _chunk(self, reader, i, keep=True):
        if i >= 2:
            self.gate.wait(10)
        self.decoded.append(i)
        return super()._chunk(reader, i, keep)


@sync
async def test_first_rows_show_before_the_step_is_decoded(huge_step):
    path, rows0 = huge_step
    source = GatedSource(path)
    app = TorchscopeApp(source)
    async with app.run_test(size=SIZE) as pilot:
        timeline = app.main.timeline
        await until(pilot, lambda: timeline.row_count() > 0, what="first rows")
        n_chunks = len(source.reader.chunks)
        assert n_chunks > 8
        # The first rows are on screen while most of the step's chunks are not decoded.
        assert max(source.decoded) < 2
        assert 0 < timeline.row_count() < rows0
        assert app.store.info(0).state == LOADING
        assert 0 in app.store.loading
        text = await shows(pilot, "loading step 0", "loading…")
        assert "loading step 0" in text
        assert "loading…" in text  # the timeline's title
        # The UI answers keys meanwhile.
        timeline.focus()
        before = timeline.cursor
        await pilot.press("down")
        assert timeline.cursor == before + 1
        source.gate.set()
        await until(pilot, lambda: 0 not in app.store.loading, what="the whole step")
        await until(pilot, lambda: timeline.row_count() == rows0, what="every row")
        assert app.store.info(0).state == RESIDENT
        assert len(app.store.data(0).rows) == rows0
        assert timeline.row_count() == rows0
        assert timeline.cursor == before + 1  # the cursor stayed where the user put it
        # the progress line goes at the next redraw, not with the store
        text = await shows(pilot, f"{app.store.info(0).n_ops:,} ops", gone=("loading step 0",))
        assert "loading step 0" not in text


def test_store_streams_parts_and_drops_an_aborted_load():
    events = [e for e in make_trace(1, 20) if e.get("kind") != "session"]
    items = prepare(events)
    half = len(items) // 2
    store = EventStore(reloadable=True)
    store.apply([StepIndex([(0, False)])])
    store.mark_loading(0)
    ch = store.apply([StepPart(0, items[:half], True, False, 1, 2)])
    assert ch.started == {0} and not ch.loaded
    assert store.info(0).state == LOADING and store.is_resident(0)
    assert store.loading[0] == (1, 2, half)
    assert store.resident_events == half
    ch = store.apply([StepPart(0, items[half:], False, True, 2, 2)])
    assert ch.loaded == {0} and 0 not in store.loading
    info = store.info(0)
    assert info.state == RESIDENT and info.counted and info.n_events == len(items)
    assert store.resident_events == len(items)
    # Loading it again, then giving up: the part goes, the step is on disk again.
    ch = store.apply([StepPart(0, items[:half], True, False, 1, 2), StepAbort(0)])
    assert not store.is_resident(0) and store.info(0).state == ON_DISK
    assert store.resident_events == 0 and 0 in ch.evicted
    # A late part of the abandoned load changes nothing.
    store.apply([StepPart(0, items[half:], False, True, 2, 2)])
    assert not store.is_resident(0) and store.info(0).state == ON_DISK


def test_inbox_counts_step_parts():
    inbox = Inbox()
    inbox.put_step_part(0, [1] * 30, True, False, 1, 3)
    inbox.put_step_part(0, [1] * 30, False, False, 2, 3)
    assert inbox.pending_events == 60
    assert len(inbox.drain(max_events=10)) == 1
    assert inbox.pending_events == 30


def test_loading_gives_way_to_another_step(huge_step):
    path, _ = huge_step
    source = FileSource(path, count_pass=None)
    inbox = Inbox()
    stop = threading.Event()
    from torchscope.protocol.tracefile import TraceReader

    with TraceReader(path) as reader:
        source.request_step(1)  # asked while step 0 streams in
        source._load(reader, 0, inbox, stop)
    tags = [type(item) for item in inbox.drain()]
    assert tags[0] is StepPart and tags[-1] is StepAbort
    assert source._take_requests() == [1]


# -- the steps overview: loss and gradient norm per step, from the count pass ----------------


def test_count_pass_finds_loss_and_gradient_norm():
    import math

    from torchscope.session.countpass import Counter

    events = make_trace(3, 4, nan_step=2)
    counter = Counter()
    counter.add(events)
    counts, _ = counter.take()
    losses = counter.take_losses()
    for step in (0, 1, 2):
        loss_op = next(
            e for e in events if e.get("step") == step and e.get("name", "").endswith("mse_loss")
        )
        want = loss_op["outputs"][0]["values"][0]
        value, rank = losses[step]
        assert rank == 2  # the op at the root of the step's backward
        assert value == want or (math.isnan(want) and math.isnan(value))
        norms = [
            e["grad_outputs"][0]["stats"]["norm"]
            for e in events
            if e.get("step") == step and e.get("node") == "AccumulateGrad"
        ]
        assert counts[step][6] == len(norms) > 0
        if step == 2:
            assert math.isnan(counts[step][5])
        else:
            assert counts[step][5] == pytest.approx(sum(n * n for n in norms))
    # A step with no backward: its last one-value op; a "loss" hint wins over both.
    counter = Counter()
    counter.add(
        [
            {"kind": "op", "seq": 1, "step": 7, "outputs": [{"shape": [], "values": [2.5]}]},
            {"kind": "op", "seq": 2, "step": 7, "outputs": [{"shape": [3], "values": [1, 2, 3]}]},
            {"kind": "op", "seq": 3, "step": 8, "outputs": [{"shape": [1], "stats": {"mean": 4}}]},
            {"kind": "step", "seq": 4, "step": 8, "loss": 0.5},
            {"kind": "op", "seq": 5, "step": 8, "outputs": [{"shape": [], "values": [9.0]}]},
        ]
    )
    assert counter.take_losses() == {7: [2.5, 1], 8: [0.5, 3]}


@sync
async def test_steps_panel_shows_loss_gradient_norm_and_a_sparkline(tmp_path):
    import math

    path = tmp_path / "six.tsc"
    with TraceWriter(path, chunk_events=256) as w:
        w.write(make_trace(6, 4, nan_step=3))
    app = TorchscopeApp(FileSource(path, count_pass="thread"))
    async with app.run_test(size=SIZE) as pilot:
        store = app.store
        await until(
            pilot,
            lambda: len(store.order) == 6 and all(store.steps[s].counted for s in store.order),
            timeout=10,
            what="the count pass",
        )
        infos = [store.steps[s] for s in store.order]
        await until(
            pilot,
            lambda: all(i.loss is not None and i.grad_norm is not None for i in infos),
            what="every step's loss and |g|",
        )
        assert math.isnan(infos[3].grad_norm) and math.isfinite(infos[4].grad_norm)
        lines = (await shows(pilot, f"{infos[4].grad_norm:.4f}"[:5], "|g|")).splitlines()
        assert any("loss" in line and "|g|" in line for line in lines)
        row3 = next(line for line in lines if line.startswith("│    3 "))
        assert "nan" in row3 and "!" in row3 and "⚠" in row3
        row4 = next(line for line in lines if line.startswith("│    4 "))
        assert f"{infos[4].grad_norm:.4f}"[:5] in row4
        # The sparkline across steps, under the steps panel: the NaN step stands out.
        spark = app.main.steps.border_subtitle
        assert spark.startswith("|g| ") and spark[4:].count("!") == 1 and len(spark) == 4 + 6


def test_overview_sparkline_keeps_a_spike_among_thousands():
    from torchscope.tui.widgets.step_list import spark_across

    values = [1.0] * 5000
    values[2345] = 100.0
    line = spark_across(values, 20)
    assert len(line) == 20 and line.count("█") == 1 and set(line) == {"▁", "█"}
    assert spark_across([1.0, None, float("nan")], 10) == "█ !"
