"""The UI's data layer (no textual): store, inbox, the three sources, formatting helpers."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pytest

from torchscope.protocol.events import Event
from torchscope.protocol.tracefile import TraceReader, TraceWriter
from torchscope.session.format import range_bar, source_context, sparkline, stat_text
from torchscope.session.inbox import Inbox
from torchscope.session.items import Counts, Events, Progress, Status, StepIndex
from torchscope.session.rows import FLAG_NAN_IN, FLAG_NAN_OUT, Row, make_item, prepare
from torchscope.session.steps import EVICTED, ON_DISK, RESIDENT
from torchscope.session.store import EventStore
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.base import SourceError
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.live import LiveSource
from torchscope.tui.sources.open import open_source
from torchscope.tui.sources.scripted import ScriptedSource

# -- helpers ---------------------------------------------------------------------------------


class Harness:
    """Runs a source on a thread and applies its inbox to a store, as the app does."""

    def __init__(self, source, store: EventStore | None = None) -> None:
        self.source = source
        self.store = store or EventStore(reloadable=source.can_reload)
        self.inbox = Inbox()
        self.stop_event = threading.Event()
        self.status: dict = {}
        self.errors: list[str] = []
        self.progress: list[tuple] = []
        self.thread = threading.Thread(
            target=source.run, args=(self.inbox, self.stop_event), daemon=True
        )
        self.thread.start()

    def until(self, cond, timeout: float = 60.0) -> Harness:
        deadline = time.monotonic() + timeout
        while True:
            items = self.inbox.drain()
            self.progress += [(i.done, i.total, i.label) for i in items if isinstance(i, Progress)]
            ch = self.store.apply(items)
            self.status.update(ch.status)
            self.errors += ch.errors
            if cond(self.store, self.status):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"timed out; status={self.status} errors={self.errors}")
            time.sleep(0.01)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def op(seq, step=0, name="Tensor.mul", module="", nodes=(), nan=0, src="/x/train.py:3"):
    out = {
        "shape": [2],
        "dtype": "float32",
        "device": "cpu",
        "stats": {
            "min": 0.0,
            "max": 1.0,
            "mean": 0.5,
            "std": 0.5,
            "norm": 1.0,
            "nan": nan,
            "inf": 0,
        },
    }
    return Event(
        kind="op",
        seq=seq,
        step=step,
        name=name,
        module=module,
        source=src,
        inputs=[],
        outputs=[out],
        nodes=[{"id": i, "name": "N"} for i in nodes],
    )


def grad(seq, node_id, op_seq, step=0, node="MulBackward0", param=None):
    s = {
        "shape": [2],
        "dtype": "float32",
        "device": "cpu",
        "stats": {"min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.5, "norm": 2.5, "nan": 0, "inf": 0},
    }
    return Event(
        kind="grad",
        seq=seq,
        step=step,
        node=node,
        node_id=node_id,
        op_seq=op_seq,
        param=param,
        source="/x/train.py:3",
        grad_outputs=[s],
        grad_inputs=[s, None],
    )


def write(path: Path, events, *, close=True, chunk_events=64) -> Path:
    w = TraceWriter(path, chunk_events=chunk_events)
    w.write(events)
    if close:
        w.close()
    else:  # a killed writer: chunks, no index
        w.flush()
        w._f.close()
    return path


# -- records and the store -------------------------------------------------------------------


def test_make_item_keeps_what_lists_need_and_the_bytes():
    t = make_item(op(5, step=2, module="fc", nodes=(7, 8), nan=3))
    row = Row(t)
    assert (row.kind, row.seq, row.step, row.name, row.module) == ("op", 5, 2, "Tensor.mul", "fc")
    assert row.nodes == (7, 8) and row.flags & FLAG_NAN_OUT and not row.flags & FLAG_NAN_IN
    assert type(t) is tuple  # untracked by the cycle collector once all fields are atomic
    g = Row(make_item(grad(6, 7, 5, param="fc.weight")))
    assert (g.kind, g.node_id, g.op_seq, g.param, g.name) == (
        "grad",
        7,
        5,
        "fc.weight",
        "MulBackward0",
    )
    # Non-events are skipped, others pass through as Events.
    items = prepare([{"kind": "op"}, "junk", {"kind": "step", "seq": 1, "step": 0}])
    assert len(items) == 1 and items[0]["kind"] == "step"


def test_store_indexes_steps_ops_nodes_and_alerts():
    events = make_trace(3, 4, nan_step=1)
    store = EventStore()
    ch = store.ingest(events)
    assert ch.steps_added and store.order == [0, 1, 2]
    assert store.session is not None and store.session["pid"] == 4242
    info = store.info(1)
    assert (info.n_ops, info.n_grads, info.nodes, info.n_alerts) == (21, 25, 25, 1)
    data = store.data(1)
    assert [store.data(1).row(i).seq for i in range(3)] == sorted(t[1] for t in data.rows[:3])
    # forward ops come first (seq order), then the backward nodes
    kinds = [t[0] for t in data.rows]
    assert kinds.index("grad") > kinds.index("op") and kinds[-1] == "op"  # optimizer at the end
    linear = next(data.row(i) for i in range(len(data.rows)) if data.row(i).name.endswith("linear"))
    grads = data.grads_of_op(linear.seq)
    assert {g.name for g in grads} == {"AddmmBackward0", "TBackward0"}
    assert all(g.module == linear.module for g in grads)  # a node's module is its op's
    assert data.op(grads[0].op_seq).seq == linear.seq
    (alert,) = store.alerts
    assert alert["event_seq"] in data.alert_seqs
    # the decoded event behind a row
    assert store.event(linear)["name"] == "torch.nn.functional.linear"


def test_store_orders_late_rows_and_ignores_duplicates():
    store = EventStore()
    store.ingest([op(1), op(3), grad(4, 1, 1)])
    store.ingest([op(2), op(3)])  # 2 arrives late; 3 again (snapshot overlapping the stream)
    data = store.data(0)
    assert [t[1] for t in data.rows] == [1, 2, 3, 4] and data.reorders == 1
    assert store.info(0).n_ops == 4  # counted as received
    assert data.row_index(2) == 1 and data.row_index(99) is None


def test_store_evicts_whole_old_steps_but_never_the_newest_or_pinned():
    events = make_trace(6, 2)
    per_step = len([e for e in events if e["step"] == 1 and e["kind"] in ("op", "grad")])
    store = EventStore(max_events=int(per_step * 2.5))
    store.pin({0})
    store.ingest(events)
    assert store.is_resident(0) and store.is_resident(5)
    assert not store.is_resident(1)
    info = store.info(1)
    assert info.state == EVICTED and info.n_ops > 0  # counts survive eviction
    assert store.resident_events <= store.max_events + per_step * 2
    reload_store = EventStore(max_events=per_step, reloadable=True)
    reload_store.ingest(events)
    assert reload_store.info(1).state == ON_DISK


def test_inbox_bounds_what_waits_and_drains_in_slices():
    inbox = Inbox(max_pending=10)
    assert inbox.put_events(list(range(6)))
    assert not inbox.put_events(list(range(6)))  # would exceed: refused, counted
    assert inbox.dropped == 6
    inbox.put(Status({"a": 1}))
    assert inbox.put_events(list(range(4)))
    first = inbox.drain(max_events=5)
    assert [type(i) for i in first] == [Events] and inbox.pending_events == 4
    assert [type(i) for i in inbox.drain()] == [Status, Events]


# -- FileSource ------------------------------------------------------------------------------


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    return write(tmp_path / "t.tsc", make_trace(5, 3, nan_step=3))


def test_file_source_lists_steps_from_the_index_and_loads_one_on_demand(trace_file: Path):
    src = FileSource(trace_file, count_pass=False)
    reads: list[int] = []
    h = Harness(src).until(lambda s, st: st.get("state") == "ready")
    store, status = h.store, h.status
    try:
        orig = src.reader.read_chunk

        def spy(i):
            reads.append(i)
            return orig(i)

        src.reader.read_chunk = spy
        assert status["complete"] is True and status["pid"] == 4242
        # The index names each chunk's first and last step: the ends are there at once.
        assert {0, 4} <= set(store.order) <= {0, 1, 2, 3, 4}
        assert all(store.info(s).state == ON_DISK for s in store.order)
        src.request_step(3)
        h.until(lambda s, st: s.is_resident(3))
        src.request_step(2)
        h.until(lambda s, st: s.is_resident(2))
    finally:
        h.stop()
    chunks = TraceReader(trace_file).chunks
    wanted = {i for i, c in enumerate(chunks) if c.first_step <= 3 <= c.last_step}
    wanted |= {i for i, c in enumerate(chunks) if c.first_step <= 2 <= c.last_step}
    assert set(reads) <= wanted and len(wanted) < len(chunks)  # never the whole file
    info = store.info(3)
    assert info.state == RESIDENT and info.counted and info.n_alerts == 1
    assert store.data(3).graphs and store.alerts


@pytest.mark.parametrize("where", ["process", "thread"])
def test_file_source_background_pass_counts_every_step(trace_file: Path, where: str):
    src = FileSource(trace_file, count_pass=where)
    h = Harness(src)
    h.until(lambda s, st: len(s.order) == 5 and all(i.counted for i in s.steps.values()))
    h.stop()
    store = h.store
    assert [store.info(s).n_ops for s in store.order] == [16] * 5  # 3 blocks: 10 fwd, 6 opt
    assert len(store.alerts) == 1 and store.alerts[0]["step"] == 3
    assert store.resident_events == 0  # counting loads nothing
    assert src.counter_process is None  # the child is gone once the source stopped


def test_file_source_without_index_scans_and_reports_progress(tmp_path: Path):
    path = write(tmp_path / "cut.tsc", make_trace(3, 2), close=False, chunk_events=8)
    h = Harness(FileSource(path))
    h.until(lambda s, st: len(s.order) == 3 and all(i.counted for i in s.steps.values()))
    h.stop()
    assert h.status["complete"] is False and h.status["truncated"] is True
    labels = {label for _, _, label in h.progress}
    assert "scanning file (no index)" in labels and "counting steps" in labels


def test_file_source_reports_an_unreadable_file(tmp_path: Path):
    bad = tmp_path / "bad.tsc"
    bad.write_bytes(b"not a trace at all")
    h = Harness(FileSource(bad)).until(lambda s, st: st.get("state") == "error")
    h.stop()
    assert "not a torchscope trace file" in h.status["error"] and h.errors


# -- LiveSource (against a fake SessionClient) -----------------------------------------------


class FakeClient:
    """The SessionClient API the live source uses: connect, snapshot, recv, the counters it
    keeps (dropped, frames_lost, step, ended, alive) and close."""

    def __init__(self, *, frames=(), snapshot=()):
        self.frames = list(frames)
        self.snap = list(snapshot)
        self.alive = True
        self.ended = False
        self.dropped = self.frames_lost = 0
        self.step = None
        self.closed = False
        self.calls: list[str] = []

    def connect(self, target, timeout=2.0):
        self.calls.append("connect")
        return {
            "session": {"kind": "session", "seq": 0, "step": 0, "pid": 77, "rank": 0},
            "events_endpoint": "ipc://x",
            "pid": 77,
            "rank": 0,
            "step": 1,
            "frame": 0,
            "dropped": 0,
            "events_total": 10,
            "subscribed": True,
        }

    def snapshot(self, max_events, timeout=5.0):
        self.calls.append("snapshot")
        return {"session": {}, "step": 1, "frame": 0, "events": self.snap}

    def recv(self, timeout_ms):
        self.calls.append("recv")
        if self.frames:
            frame = self.frames.pop(0)
            # what the real client does with each frame
            self.dropped = frame.get("dropped", self.dropped)
            self.frames_lost += frame.pop("_lost", 0)
            if frame["type"] == "bye":
                self.ended = True
            if "step" in frame:
                self.step = frame["step"]
            return [frame]
        time.sleep(timeout_ms / 1000)
        return []

    def close(self):
        self.calls.append("close")
        self.closed = True


def test_live_source_applies_snapshot_then_frames_and_reports_status():
    snap = [op(1), op(2)]
    frames = [
        {"type": "events", "frame": 1, "rank": 0, "dropped": 0, "events": [op(2), op(3)]},
        {"type": "heartbeat", "frame": 2, "rank": 0, "dropped": 5, "step": 1, "paused": True},
        {
            "type": "events",
            "frame": 5,
            "rank": 0,
            "dropped": 5,
            "events": [grad(4, 9, 3)],
            "_lost": 2,
        },
        {"type": "bye", "frame": 6, "rank": 0, "dropped": 5},
    ]
    client = FakeClient(frames=frames, snapshot=snap)
    src = LiveSource("ipc://s", client_factory=lambda: client, recv_timeout_ms=5)
    h = Harness(src).until(lambda s, st: st.get("state") == "ended")
    h.stop()
    store, status = h.store, h.status
    assert [t[1] for t in store.data(0).rows] == [1, 2, 3, 4]  # op 2 not twice
    assert status["pid"] == 77 and status["paused"] is True and status["dropped"] == 5
    assert status["gaps"] == 2 and status["connected"] is False and status["step"] == 1
    assert client.closed and set(client.calls) <= {"connect", "snapshot", "recv", "close"}


def test_live_source_retries_an_unreachable_session_and_notices_silence():
    attempts = []

    class Unreachable(Exception):
        pass

    class Flaky(FakeClient):
        def connect(self, target, timeout=2.0):
            attempts.append(target)
            if len(attempts) < 3:
                raise Unreachable(f"no session at {target}")
            self.alive = False  # connected, then nothing for 3 s
            return super().connect(target, timeout)

    src = LiveSource("ipc://gone", client_factory=Flaky, retry_seconds=0.01, recv_timeout_ms=5)
    h = Harness(src).until(lambda s, st: st.get("state") == "unreachable")
    assert "no session" in h.status["error"]
    h.until(lambda s, st: len(attempts) >= 3 and st.get("state") == "disconnected")
    h.stop()
    assert h.status["connected"] is False


def test_live_source_reloads_evicted_steps_from_the_recording(tmp_path: Path):
    rec = write(tmp_path / "rec.tsc", make_trace(2, 2))
    src = LiveSource("ipc://s", client_factory=FakeClient, recording=rec, recv_timeout_ms=5)
    assert src.can_reload
    h = Harness(src).until(lambda s, st: st.get("connected"))
    src.request_step(1)
    h.until(lambda s, st: s.is_resident(1))
    h.stop()
    assert h.store.info(1).n_grads > 0
    no_rec = LiveSource("ipc://s", client_factory=FakeClient, recv_timeout_ms=5)
    h = Harness(no_rec).until(lambda s, st: st.get("connected"))
    no_rec.request_step(1)
    h.until(lambda s, st: any("evicted" in e for e in h.errors))
    h.stop()


# -- ScriptedSource --------------------------------------------------------------------------


def test_scripted_source_feeds_at_a_rate_and_later():
    events = make_trace(2, 2)
    src = ScriptedSource(events, rate=2000)
    t0 = time.monotonic()
    h = Harness(src).until(lambda s, st: s.events_applied >= len(events) - 1)
    elapsed = time.monotonic() - t0
    assert elapsed >= len(events) / 2000 * 0.5
    src.feed([op(10_000, step=7)])
    h.until(lambda s, st: 7 in s)
    h.stop()


def test_open_source_picks_by_target(trace_file: Path):
    assert isinstance(open_source(str(trace_file)), FileSource)
    assert isinstance(open_source("ipc:///tmp/x.sock"), LiveSource)
    assert isinstance(open_source("4242"), LiveSource) and open_source("4242").target == "4242"
    with pytest.raises(SourceError):
        open_source("/no/such/file.tsc")


# -- formatting ------------------------------------------------------------------------------


def test_format_helpers(tmp_path: Path):
    assert sparkline([0, 1, 2, 3]) == "▁▃▆█"
    assert sparkline([1.0, math.nan]).endswith("!")
    assert range_bar({"min": 0, "max": 10, "mean": 5, "std": 1}, 12).startswith("├")
    s = {"shape": [3], "stats": {"mean": 0.5, "std": 0.25, "norm": 1, "nan": 2, "inf": 0}}
    assert stat_text(s, "mean") == "0.5±0.25 NaN:2" and stat_text(s).startswith("norm=1")
    src = tmp_path / "m.py"
    src.write_text("".join(f"line {i}\n" for i in range(1, 11)))
    ctx = source_context(f"{src}:5")
    assert [n for n, _, _ in ctx] == [2, 3, 4, 5, 6, 7, 8] and ctx[3] == (5, "line 5", True)
    assert source_context("/elsewhere/m.py:5") is None
    # a relative path is looked up under the job's working directory
    assert source_context("m.py:2", cwd=str(tmp_path))[1][2] is True
    assert os.path.basename(str(src)) == "m.py"


def test_an_empty_trailing_step_goes_whichever_news_completes_the_verdict_last():
    # A file's steps 0-2 from its index, then the count pass (step 2: nothing in it), then the
    # file's "complete" status in a batch of its own: the empty step goes at that last news.
    empty = (0, 0, 0, 0, 1, [])
    full = (3, 2, 2, 0, 8, [])
    store = EventStore()
    store.apply([Status({"complete": False})])
    store.apply([StepIndex([(0, False), (1, False), (2, False)])])
    store.apply([Counts({0: full, 1: full, 2: empty}, [0, 1, 2])])
    assert store.order == [0, 1, 2]  # the file may still grow: step 2 may yet begin
    ch = store.apply([Status({"complete": True})])
    assert store.order == [0, 1] and ch.removed == {2}
    # the file's index comes again with a later load: the dropped step stays gone (its counts
    # were final: back, it would never be dropped again)
    store.apply([StepIndex([(1, False), (2, False)])])
    assert store.order == [0, 1] and 2 not in store
