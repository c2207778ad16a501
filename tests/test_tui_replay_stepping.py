"""Stepping through a recording (torchscope.session.replay_cursor): s/S, n/N, c/C and breakpoints
move a paused cursor through real recordings, loading steps from the file on request."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import models
import pytest
import torch

import torchscope
from torchscope.protocol.breakpoints import BreakpointError
from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.session.inbox import Inbox
from torchscope.session.replay_cursor import (
    KEYS,
    Landed,
    NeedStep,
    Position,
    ReplayBreakpoints,
    ReplayCursor,
    Stay,
    first_origin,
)
from torchscope.session.rows import FLAG_NAN_OUT, FLAGS, KIND, NAME, SEQ
from torchscope.session.stepper_view import StepperView
from torchscope.session.steps import ON_DISK
from torchscope.session.store import EventStore
from torchscope.tui.sources.file import FileSource

STEPS = 4
NAN_STEP = 2


def record(path: Path, *, steps: int = STEPS, nan_step: int = NAN_STEP, **options) -> Path:
    """A small MLP trained ``steps`` steps; at ``nan_step`` a ``torch.sqrt`` of negative
    numbers makes NaN, which every later op and node of that step carries (and the next
    step's parameters, through the optimizer)."""
    torch.manual_seed(0)
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchscope.trace(path, **options):
        for step in range(steps):
            opt.zero_grad()
            h = model(torch.randn(4, 8))
            if step == nan_step:
                h = torch.sqrt(h - 100.0)
            (h * h).mean().backward()
            opt.step()
    return path


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("replay") / "run.tsc")


@pytest.fixture(scope="module")
def aten_recording(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("replay") / "aten.tsc", steps=3, aten=True)


class Replay:
    """A FileSource on its thread feeding a store, as the app runs it; steps are loaded only
    when asked (``load``) or when a move answers NeedStep (``drive``)."""

    def __init__(self, path: Path) -> None:
        self.source = FileSource(path, count_pass="thread")
        self.store = EventStore(reloadable=True)
        self.inbox = Inbox()
        self.stop_event = threading.Event()
        self.loads: list[int] = []  # steps a move asked for
        self.thread = threading.Thread(
            target=self.source.run, args=(self.inbox, self.stop_event), daemon=True
        )
        self.thread.start()
        self.until(
            lambda: (
                self.store.order
                and all(self.store.info(s).counted for s in self.store.order)
                and self.store.complete
            ),
            "every step counted",
        )

    def until(self, cond, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.store.apply(self.inbox.drain())
            if cond():
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def load(self, step: int) -> None:
        store = self.store
        store.pin(set(store.pinned) | {step})
        store.mark_loading(step)
        self.source.request_step(step)
        self.until(lambda: store.is_resident(step), f"step {step} loaded")

    def load_all(self) -> Replay:
        for step in self.store.order:
            self.load(step)
        return self

    def drive(self, cursor: ReplayCursor, key: str) -> Landed | Stay:
        """Make the move, loading what it asks for and asking again, as main.py does."""
        for _ in range(len(self.store.order) + 2):
            result = cursor.move(key)
            if not isinstance(result, NeedStep):
                return result
            assert not self.store.is_resident(result.step)
            self.loads.append(result.step)
            self.load(result.step)
        raise AssertionError("a move kept asking for steps")

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(10)


@pytest.fixture
def replay(recording):
    r = Replay(recording)
    yield r
    r.close()


def rows(store: EventStore) -> list[Position]:
    """Every op and node of the recording, in order (all steps resident)."""
    out = []
    for step in store.order:
        data = store.data(step)
        out += [Position(step, t[KIND], t[SEQ]) for t in data.rows]
    return out


def named(store: EventStore, name: str, step: int | None = None) -> list[Position]:
    return [
        p for p in rows(store) if (step is None or p.step == step) and rec(store, p)[NAME] == name
    ]


def rec(store: EventStore, p: Position) -> tuple:
    data = store.data(p.step)
    return data.rows[data.row_index(p.seq)]


def nan_origin(store: EventStore) -> dict:
    (alert,) = [a for a in store.alerts if a.get("where") == "forward"]
    return alert


# -- s / S -----------------------------------------------------------------------------------


def test_s_and_S_walk_every_op_and_node_one_by_one_across_steps(replay):
    store = replay.load_all().store
    everything = rows(store)
    assert {p.step for p in everything} == set(range(STEPS)) and len(everything) > 60
    cursor = ReplayCursor(store)
    forward = []
    while isinstance(result := cursor.move("s"), Landed):
        assert result.reason == "step" and result.position.phase == "after"
        forward.append(result.position)
    assert forward == everything
    assert result == Stay("at the end of the recording")
    assert cursor.position == everything[-1]  # a refused move leaves it where it was
    back = []
    while isinstance(result := cursor.move("S"), Landed):
        assert result.reason == "step back"
        back.append(result.position)
    assert back == everything[-2::-1]
    assert result == Stay("at the start of the recording")
    # Across a step boundary: the last node of step 0 and the first op of step 1.
    last0 = max(i for i, p in enumerate(everything) if p.step == 0)
    cursor.place(0, everything[last0].kind, everything[last0].seq)
    assert cursor.step().position == everything[last0 + 1]
    assert everything[last0].kind == GRAD and everything[last0 + 1] == Position(
        1, OP, everything[last0 + 1].seq
    )
    assert cursor.step_back().position == everything[last0]


# -- n / N -----------------------------------------------------------------------------------


def test_n_and_N_go_to_the_first_event_of_the_next_and_previous_step(replay):
    store = replay.load_all().store
    firsts = {s: Position(s, OP, store.data(s).rows[0][SEQ]) for s in store.order}
    middle = store.data(1).rows[10]
    cursor = ReplayCursor(store)
    cursor.place(1, middle[KIND], middle[SEQ])
    landed = cursor.move("n")
    assert landed == Landed(firsts[2], "next step")
    assert cursor.move("n").position == firsts[3]
    assert cursor.move("n") == Stay("no step after this one: this is the last")
    assert cursor.move("N") == Landed(firsts[2], "previous step")
    cursor.place(1, middle[KIND], middle[SEQ])
    assert cursor.move("N").position == firsts[0]  # the previous step's, not this one's
    assert cursor.move("N") == Stay("no step before this one: this is the first")


# -- c / C -----------------------------------------------------------------------------------


def test_c_stops_at_each_op_a_name_breakpoint_names_and_C_goes_back(replay):
    store = replay.load_all().store
    means = named(store, "Tensor.mean")
    assert [p.step for p in means] == list(range(STEPS))
    cursor = ReplayCursor(store, [{"id": 3, "op": r"^Tensor\.mean$", "enabled": True}])
    hits = []
    while (result := cursor.move("c")).reason != "end":
        assert result.reason == "breakpoint 3"
        assert result.note == r"breakpoint 3: op:^Tensor\.mean$"
        hits.append(result.position)
    assert hits == means
    assert result.position == rows(store)[-1]
    assert result.note == "no breakpoint hit after: at the end of the recording"
    assert cursor.move("c") == Stay("no breakpoint hit after: at the end of the recording")
    back = []
    while (result := cursor.move("C")).reason != "start":
        back.append(result.position)
    assert back == means[::-1] and result.position == rows(store)[0]
    # A step condition and a disabled breakpoint: only step 2's sqrt stops.
    cursor.set_breakpoints(
        [
            {"id": 1, "op": "sqrt|mean", "step": NAN_STEP},
            {"id": 2, "op": "linear", "enabled": False},
        ]
    )
    cursor.position = None
    result = cursor.move("c")
    assert result.position == named(store, "torch.sqrt")[0] and result.reason == "breakpoint 1"
    assert cursor.move("c").position == named(store, "Tensor.mean", NAN_STEP)[0]


def test_c_without_a_breakpoint_goes_to_the_end_and_says_so(replay):
    store = replay.load_all().store
    cursor = ReplayCursor(store)
    landed = cursor.move("c")
    assert landed == Landed(rows(store)[-1], "end", "no breakpoint: at the end of the recording")
    assert cursor.move("C") == Landed(
        rows(store)[0], "start", "no breakpoint: at the start of the recording"
    )


def test_c_with_nan_lands_on_the_origin_once_not_on_what_carries_the_nan(replay):
    store = replay.load_all().store
    alert = nan_origin(store)
    origin = Position(NAN_STEP, OP, alert["event_seq"])
    assert named(store, "torch.sqrt") == [origin]
    # Many events after it carry the NaN: this step's later ops and nodes, the next step's.
    carrying = [p for p in rows(store) if rec(store, p)[FLAGS] & FLAG_NAN_OUT]
    assert [p for p in carrying if p.seq > origin.seq and p.step == NAN_STEP]
    assert [p for p in carrying if p.step == NAN_STEP + 1]

    cursor = ReplayCursor(store, [{"nan": "nan"}])
    landed = cursor.move("c")
    assert landed.position == origin and landed.reason == "breakpoint 1"
    assert landed.note == alert["message"] and "NaN first appears in torch.sqrt" in landed.note
    assert landed.pause(store)["event"]["name"] == "torch.sqrt"
    nxt = cursor.move("c")
    assert nxt.reason == "end" and nxt.position == rows(store)[-1]
    assert cursor.move("C").position == origin  # and back, from the end
    assert cursor.move("C").reason == "start"
    # inf: no Inf anywhere; anynan: every event that carries it, the origin first.
    cursor.set_breakpoints([{"nan": "inf"}])
    cursor.position = None
    assert cursor.move("c").reason == "end"
    cursor.set_breakpoints([{"nan": "anynan"}])
    cursor.position = None
    hits = [cursor.move("c").position for _ in range(3)]
    assert hits == carrying[:3] and hits[0] == origin


def test_a_recording_opens_at_its_first_origin_without_loading_a_step(replay):
    store = replay.store
    assert all(not store.is_resident(s) for s in store.order)
    alert = nan_origin(store)
    want = Position(NAN_STEP, OP, alert["event_seq"])
    assert first_origin(store) == Landed(want, "origin", alert["message"])
    cursor = ReplayCursor(store)
    assert cursor.open() == Landed(want, "origin", alert["message"])
    assert cursor.position == want


# -- steps on disk ---------------------------------------------------------------------------


def test_a_step_not_in_memory_is_asked_for_and_the_move_made_once_it_came(replay):
    store = replay.store
    assert store.info(NAN_STEP).state == ON_DISK
    cursor = ReplayCursor(store)
    cursor.open()
    assert cursor.step() == NeedStep(NAN_STEP)
    assert cursor.position.step == NAN_STEP  # not moved
    replay.load(NAN_STEP)
    data = store.data(NAN_STEP)
    after = data.rows[data.row_index(cursor.position.seq) + 1]
    assert cursor.step() == Landed(Position(NAN_STEP, after[KIND], after[SEQ]), "step")
    # n needs the next step; drive() loads it as main.py would.
    assert cursor.next() == NeedStep(NAN_STEP + 1)
    assert replay.drive(cursor, "n").position.step == NAN_STEP + 1


def test_c_with_nan_loads_only_the_step_of_the_origin(replay):
    cursor = ReplayCursor(replay.store, [{"nan": "nan"}])
    landed = replay.drive(cursor, "c")
    assert replay.loads == [NAN_STEP]  # steps 0 and 1 have no origin: never loaded
    assert landed.position == first_origin(replay.store).position


def test_c_with_a_name_breakpoint_loads_step_after_step_and_resumes_where_it_was(replay):
    cursor = ReplayCursor(replay.store, [{"op": r"^torch\.sqrt$"}])
    landed = replay.drive(cursor, "c")
    assert replay.loads == [0, 1, 2]  # each once: the retry goes on from the step it needed
    assert landed.position == first_origin(replay.store).position
    replay.loads.clear()
    assert replay.drive(cursor, "c").reason == "end"
    assert replay.loads == [3]


# -- the aten level --------------------------------------------------------------------------


def test_with_the_aten_level_c_lands_on_the_call_that_made_the_nan_then_goes_on(aten_recording):
    replay = Replay(aten_recording)
    try:
        store = replay.store
        alert = nan_origin(store)
        assert alert["aten"] == "aten.sqrt.default"
        call = Position(NAN_STEP, ATEN, alert["aten_seq"])
        assert first_origin(store).position == call
        replay.load_all()
        cursor = ReplayCursor(store, [{"nan": "nan"}])
        landed = cursor.move("c")
        assert landed.position == call and landed.note == alert["message"]
        # the op it ran in is not a second stop for the same NaN
        assert cursor.move("c").reason == "end"
        # s from a call: the next call under the same op, then the op's next row
        data = store.data(NAN_STEP)
        op = data.op_by_seq[alert["event_seq"]]
        calls = [c[SEQ] for c in data.aten_of(op)]
        assert calls[0] == call.seq and len(calls) > 1
        cursor.place(NAN_STEP, ATEN, call.seq)
        assert cursor.step().position == Position(NAN_STEP, ATEN, calls[1])
        after = data.rows[data.row_index(op[SEQ]) + 1]
        assert cursor.step().position == Position(NAN_STEP, after[KIND], after[SEQ])
        assert cursor.step_back().position == Position(NAN_STEP, OP, op[SEQ])  # rows only, back
        cursor.place(NAN_STEP, ATEN, calls[1])
        assert cursor.step_back().position == call
        assert cursor.step_back().position == Position(NAN_STEP, OP, op[SEQ])
        # an aten: breakpoint stops at calls only
        cursor.set_breakpoints([{"aten": r"^aten\.sqrt"}])
        cursor.position = None
        assert cursor.move("c").position == call
    finally:
        replay.close()


# -- breakpoints as the UI holds them --------------------------------------------------------


def test_a_recordings_breakpoints_answer_the_jobs_commands():
    bps = ReplayBreakpoints()
    view = StepperView()
    view.on_state(bps.answer("break_add", {"op": "sqrt", "nan": None})["state"])
    view.on_state(bps.answer("break_add", {"nan": "nan"})["state"])
    assert [b["id"] for b in view.breakpoints] == [1, 2]
    view.on_state(bps.answer("break_enable", {"bp": 1, "enabled": False})["state"])
    assert view.breakpoint(1)["enabled"] is False
    cursor = ReplayCursor(EventStore(), view.breakpoints)
    assert [bp.id for bp in cursor.breakpoints] == [2]  # the disabled one is left out
    view.on_state(bps.answer("break_delete", {"bp": 2})["state"])
    assert [b["id"] for b in view.breakpoints] == [1]
    with pytest.raises(BreakpointError, match="no breakpoint 7"):
        bps.answer("break_delete", {"bp": 7})
    with pytest.raises(BreakpointError):
        bps.answer("break_add", {"op": "(a"})
    with pytest.raises(ValueError, match="not supported by a recording"):
        bps.answer("inspect", {})
    assert set(KEYS) == {"s", "S", "n", "N", "c", "C"}
