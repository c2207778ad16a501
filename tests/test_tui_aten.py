"""The aten level in the UI: an op's or node's aten calls kept under it (bounded like the
rows), unfolded in the timeline with → / l and folded with ← / h, and shown in the detail."""

from __future__ import annotations

from tui_pilot import SIZE, notes_of, sync, until

from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.session.rows import AtenRow
from torchscope.session.store import EventStore
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource


def _t(value: float) -> dict:
    stats = {"min": value, "max": value, "mean": value, "std": 0.0, "norm": abs(value)}
    stats.update(nan=0, inf=0)
    return {"shape": [2], "dtype": "float32", "device": "cpu", "stats": stats}


def _aten(seq: int, name: str, out: float, step: int = 0, **parent) -> dict:
    ev = {"kind": ATEN, "seq": seq, "step": step, "name": name, "module": "", "source": SRC}
    ev.update(op_seq=None, node_id=None, node=None, thread="MainThread", duration_us=3.0)
    ev.update(parent)
    ev.update(inputs=[_t(1.0), _t(2.0)], outputs=[_t(out)])
    return ev


SRC = "/work/job/train.py:20"


def aten_trace(steps: int = 1) -> list[dict]:
    """Per step: linear (2 aten calls) and relu (none), then AddmmBackward0 (1 call, and
    the engine's sum after it, ``accumulate``) and ReluBackward0 (none)."""
    out: list[dict] = [{"kind": "session", "seq": 0, "step": 0, "pid": 1, "steps": "all"}]
    for step in range(steps):
        b = 1 + step * 20
        op = {"kind": OP, "step": step, "source": SRC, "function": "forward"}
        grad = {"kind": GRAD, "step": step, "source": SRC, "backward": step + 1, "param": None}
        out += [
            {"kind": "step", "seq": b, "step": step},
            _aten(b + 1, "aten.mm.default", 3.0, step, op_seq=b + 3),
            _aten(b + 2, "aten.add.Tensor", 4.0, step, op_seq=b + 3),
            {**op, "seq": b + 3, "name": "torch.nn.functional.linear", "module": "fc"}
            | {"inputs": [_t(1.0)], "outputs": [_t(4.0)], "nodes": [{"id": 11 + step * 10}]},
            {**op, "seq": b + 4, "name": "torch.relu", "module": "act"}
            | {"inputs": [_t(4.0)], "outputs": [_t(4.0)], "nodes": [{"id": 12 + step * 10}]},
            {**grad, "seq": b + 5, "node": "ReluBackward0", "node_id": 12 + step * 10}
            | {"op_seq": b + 4, "grad_outputs": [_t(1.0)], "grad_inputs": [_t(1.0)]},
            _aten(b + 6, "aten.mm.default", 0.5, step, node_id=11 + step * 10)
            | {"node": "AddmmBackward0"},
            {**grad, "seq": b + 7, "node": "AddmmBackward0", "node_id": 11 + step * 10}
            | {"op_seq": b + 3, "grad_outputs": [_t(1.0)], "grad_inputs": [_t(0.5)]},
            _aten(b + 8, "aten.add.Tensor", 2.5, step, node_id=11 + step * 10)
            | {"node": "AddmmBackward0", "accumulate": True},
        ]
    return out


# -- the store ----------------------------------------------------------------------------------
def test_store_keeps_aten_calls_under_their_op_or_node_not_as_rows():
    store = EventStore()
    store.ingest(aten_trace())
    data = store.data(0)
    assert [r[3] for r in data.rows] == [
        "torch.nn.functional.linear",
        "torch.relu",
        "ReluBackward0",
        "AddmmBackward0",
    ]
    info = store.info(0)
    assert (info.n_ops, info.n_grads) == (2, 2)  # aten calls are neither
    assert store.has_aten and len(data.aten) == 4
    assert store.resident_events == len(data) == 4 + 4 + 1  # rows, calls, the step marker
    linear, relu, relu_bw, addmm_bw = (data.row(i) for i in range(4))
    assert [t[3] for t in data.aten_of(linear)] == ["aten.mm.default", "aten.add.Tensor"]
    assert data.aten_of(relu) == () and data.aten_of(relu_bw) == ()
    calls = [AtenRow(t, addmm_bw) for t in data.aten_of(addmm_bw)]
    assert [(c.name, c.accumulate) for c in calls] == [
        ("aten.mm.default", False),
        ("aten.add.Tensor", True),
    ]
    assert calls[0].module == "fc"  # the node's module: its op's
    assert data.aten_parent(calls[1].t) == addmm_bw.t
    assert store.event(calls[1]).get("accumulate") is True


def test_aten_calls_count_against_the_memory_bound():
    store = EventStore(max_events=12)  # one step (9 events) fits, two do not
    store.ingest(aten_trace(steps=3))
    assert store.evictions == 2 and not store.is_resident(0) and store.is_resident(2)
    assert store.resident_events == len(store.data(2)) == 9


def test_a_trace_without_aten_calls_has_nothing_to_unfold():
    store = EventStore()
    store.ingest(make_trace(1, 1))
    data = store.data(0)
    assert not store.has_aten and not data.aten
    assert all(data.aten_of(data.row(i)) == () for i in range(len(data.rows)))


# -- the timeline and the detail ----------------------------------------------------------------
async def _shown(pilot, app: TorchscopeApp) -> None:
    await until(
        pilot,
        lambda: app.main.current_step == 0 and app.main.timeline.row_count() >= 4,
        what="step 0 shown",
    )


def _line(tl, index: int) -> str:
    return "".join(text for text, _ in tl.render_row(index, 120))


@sync
async def test_unfold_an_op_into_its_aten_calls_select_one_and_fold_back():
    app = TorchscopeApp(ScriptedSource(aten_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        assert tl.cursor == 0 and tl.row_count() == 4
        assert "▸+" in _line(tl, 0)  # linear has calls
        assert "▸ " in _line(tl, 1) and "+" not in _line(tl, 1)[:8]  # relu has none
        await pilot.press("right")
        await until(pilot, lambda: tl.row_count() == 6, what="linear unfolded")
        assert "▸-" in _line(tl, 0)
        kids = [tl.row(1), tl.row(2)]
        assert all(isinstance(k, AtenRow) for k in kids)
        assert [k.name for k in kids] == ["aten.mm.default", "aten.add.Tensor"]
        assert kids[0].module == "fc" and "  aten.mm.default" in _line(tl, 1)
        assert tl.row(3).name == "torch.relu"  # the rows after it moved down
        assert tl.cursor == 0
        await pilot.press("l")  # unfolded: l goes to its first call
        await pilot.press("j")
        assert tl.cursor == 2
        await until(
            pilot, lambda: main.detail.event is not None and main.detail.event.get("seq") == 3
        )
        text = str(main.detail.body.render())
        assert "aten.add.Tensor" in text and "aten call" in text
        assert "inputs" in text and "outputs" in text and "norm 4" in text
        assert main.detail.link_texts() == ["in F.linear (op, event #4)"]
        assert tl.index_of(ATEN, 3) == 2 and tl.index_of(OP, 5) == 3
        await pilot.press("h")  # on a call: back to its op
        assert tl.cursor == 0 and tl.row_count() == 6
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 4)
        await pilot.press("left")  # on the op: fold
        assert tl.row_count() == 4 and tl.cursor == 0 and "▸+" in _line(tl, 0)
        await pilot.press("j", "right")  # relu: nothing to unfold
        assert tl.row_count() == 4 and tl.cursor == 1


@sync
async def test_a_node_shows_its_aten_calls_and_the_engines_sum_after_it():
    app = TorchscopeApp(ScriptedSource(aten_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        await pilot.press("end")
        assert tl.row(tl.cursor).name == "AddmmBackward0" and "◂+" in _line(tl, 3)
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 8)
        text = str(main.detail.body.render())
        assert "aten calls" in text and "aten.mm.default #7" in text
        assert "Σ aten.add.Tensor #9" in text
        await pilot.press("l")
        await until(pilot, lambda: tl.row_count() == 6, what="node unfolded")
        assert [tl.row(i).seq for i in range(6)] == [4, 5, 6, 8, 7, 9]
        assert "Σ aten.add.Tensor" in _line(tl, 5)
        await pilot.press("end")
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 9)
        text = str(main.detail.body.render())
        assert "sum after" in text and "AddmmBackward0 node id 11" in text
        await pilot.press("enter")  # an aten call: enter goes to its op or node
        await until(pilot, lambda: tl.cursor == 3)
        await pilot.press("h")
        assert tl.row_count() == 4


@sync
async def test_help_names_the_aten_keys_only_when_the_trace_has_aten_calls():
    from torchscope.tui.keys import TIMELINE, help_sections

    def timeline_keys(aten: bool) -> list[str]:
        sections = dict(help_sections(None, live=False, aten=aten, sources=False))
        return [k for k, _ in sections[TIMELINE]]

    assert "A" not in timeline_keys(False) and "→ ← l h" not in timeline_keys(False)
    with_aten = timeline_keys(True)
    assert "A" in with_aten and "→ ← l h" in with_aten
    assert len(with_aten) == len(timeline_keys(False)) + 2


# -- search, filter, go to ----------------------------------------------------------------------
@sync
async def test_search_finds_an_aten_call_unfolding_its_row_and_ctrl_n_goes_to_the_next():
    app = TorchscopeApp(ScriptedSource(aten_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        await pilot.press("slash", *"aten.mm")
        # the first call, under F.linear (folded until now): its row unfolds, the cursor on it
        await until(pilot, lambda: tl.row_count() == 6, what="linear unfolded by the search")
        row = tl.current_row()
        assert isinstance(row, AtenRow) and (row.seq, row.parent.seq) == (2, 4)
        await pilot.press("enter")  # closes the prompt, the cursor stays
        assert "search /aten.mm/ 1/2" in tl.border_subtitle
        await pilot.press("ctrl+n")  # the second: under AddmmBackward0, unfolded in its turn
        await until(pilot, lambda: (tl.current_row() or tl).seq == 7, what="the node's call")
        assert isinstance(tl.current_row(), AtenRow) and tl.row_count() == 8
        assert "search /aten.mm/ 2/2" in tl.border_subtitle
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 7)
        await pilot.press("ctrl+n")  # wraps to the first
        assert tl.current_row().seq == 2
        # a search for a module finds the row, not each of its calls again (they have its module)
        await pilot.press("escape", "slash", *"fc")
        await until(pilot, lambda: main.search is not None and main.search.pattern == "fc")
        assert main.matches() == [(0, -1), (3, -1)]  # F.linear, AddmmBackward0 (its op's)


@sync
async def test_the_filter_keeps_matching_aten_calls_under_their_rows():
    app = TorchscopeApp(ScriptedSource(aten_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await _shown(pilot, app)
        await pilot.press("vertical_line", *r"add\.Tensor", "enter")
        await until(pilot, lambda: tl.pattern is not None, what="the filter")
        # F.linear and AddmmBackward0 stay for their aten.add calls; relu and its node go
        shown = [(tl.row(i).name, isinstance(tl.row(i), AtenRow)) for i in range(tl.row_count())]
        assert shown == [
            ("torch.nn.functional.linear", False),
            ("aten.add.Tensor", True),
            ("AddmmBackward0", False),
            ("aten.add.Tensor", True),
        ]
        assert "Σ aten.add.Tensor" in _line(tl, 3)
        assert tl._kept_for_calls(tl.row(0)) and "4 shown" in tl.border_subtitle
        # a row that matches itself is not dimmed; unfolding one shows all its calls
        await pilot.press("vertical_line", "ctrl+u", *"linear|aten.add", "enter")
        await until(pilot, lambda: tl.pattern.pattern == "linear|aten.add")
        assert not tl._kept_for_calls(tl.row(0)) and tl.row_count() == 4
        await pilot.press("home", "right")
        await until(pilot, lambda: tl.row_count() == 5, what="linear unfolded under the filter")
        assert [tl.row(i).name for i in (1, 2)] == ["aten.mm.default", "aten.add.Tensor"]
        await pilot.press("vertical_line", "ctrl+u", *"nothing such", "enter")
        assert tl.row_count() == 0


@sync
async def test_go_to_an_aten_calls_seq_unfolds_its_row():
    app = TorchscopeApp(ScriptedSource(aten_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await _shown(pilot, app)
        await pilot.press("colon", *"#9", "enter")
        await until(pilot, lambda: (tl.current_row() or tl).seq == 9, what="the engine's sum")
        assert tl.current_row().accumulate and tl.row_count() == 6


# -- the step list ------------------------------------------------------------------------------
@sync
async def test_the_step_list_and_the_title_count_aten_calls():
    trace = aten_trace(steps=2)
    app = TorchscopeApp(ScriptedSource(trace, mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _shown(pilot, app)
        assert main.has_class("-aten") and "4 aten calls" in main.timeline.border_title
        steps = main.steps
        width = steps.content_region.width
        head = "".join(t for t, _ in steps.render_header(width))
        assert head.split() == ["step", "ops", "nodes", "aten"]
        row = "".join(t for t, _ in steps.render_row(0, width))
        assert row.split()[:4] == ["0", "2", "2", "4"]
    async with TorchscopeApp(ScriptedSource(make_trace(1, 1), mode="replay")).run_test(
        size=SIZE
    ) as pilot:  # no aten level: no column, the usual width
        main = pilot.app.main
        await until(pilot, lambda: main.current_step == 0)
        assert not main.has_class("-aten")
        assert "aten" not in "".join(t for t, _ in main.steps.render_header(40))


# -- paused at an aten call ---------------------------------------------------------------------
def _pause(seq: int, event: dict, phase: str) -> dict:
    return {"kind": "pause", "seq": seq, "step": 0, "phase": phase, "event": event}


@sync
async def test_paused_after_an_aten_call_unfolds_its_row_and_marks_the_call():
    trace = aten_trace()
    call = next(e for e in trace if e.get("seq") == 7)  # aten.mm under AddmmBackward0
    pause = _pause(30, call, "after") | {"reason": "step", "since": 1.0, "stack": []}
    app = TorchscopeApp(ScriptedSource([*trace, pause]))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await until(pilot, lambda: tl.paused_key == (ATEN, 7), what="the paused call marked")
        await until(pilot, lambda: (tl.current_row() or tl).seq == 7, what="cursor on it")
        assert isinstance(tl.current_row(), AtenRow) and tl.row_count() == 6
        assert "⏸" in _line(tl, tl.cursor)
        await until(pilot, lambda: "after this aten call ran" in str(main.detail.body.render()))
        assert "⏸ stepped: aten.mm.default" in app.screen_text()


@sync
async def test_paused_before_an_aten_call_shows_it_pending_where_its_op_will_come():
    trace = aten_trace()
    stub = {"kind": ATEN, "seq": None, "step": 0, "name": "aten.relu.default", "module": "act"}
    pause = _pause(30, stub | {"inputs": [_t(4.0)]}, "before")
    app = TorchscopeApp(ScriptedSource([*trace, pause | {"reason": "breakpoint 1", "since": 1.0}]))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await until(pilot, lambda: tl.pending is not None, what="the pending call")
        assert tl.pending.kind == ATEN and tl.cursor == tl.row_count() - 1
        line = _line(tl, tl.cursor)
        assert "⏸" in line and "  aten.relu.default" in line and "not run yet" in line
        await until(pilot, lambda: "before this aten call runs" in str(main.detail.body.render()))
        text = str(main.detail.body.render())
        assert "aten call (not run yet)" in text and "the op running now" in text
        assert "not computed yet: paused before the call runs" in text


# -- copy and compare -----------------------------------------------------------------------------
def test_copy_and_break_here_of_an_aten_call_name_the_call():
    from torchscope.session.stepper_view import spec_from_event, spec_text
    from torchscope.tui.screens.copy import copy_choices

    call = next(e for e in aten_trace() if e.get("seq") == 2)
    choices = {key: text for key, _, text in copy_choices(call, module="fc")}
    assert choices["n"] == "aten.mm.default" and choices["b"] == r"aten:^aten\.mm\.default$"
    assert choices["s"] == SRC and '"kind":"aten"' in choices["j"].replace(" ", "")
    assert spec_text(spec_from_event(call, "op", nan=True)) == r"nan,aten:^aten\.mm\.default$"


@sync
async def test_y_on_an_aten_row_copies_the_call():
    app = TorchscopeApp(ScriptedSource(aten_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        await _shown(pilot, app)
        await pilot.press("right", "l", "y")
        await until(pilot, lambda: app.screen is not app.main, what="the copy menu")
        assert "Copy · aten.mm.default" in app.screen_text()
        copied = []
        app.copy_to_clipboard = copied.append
        await pilot.press("n")
        await until(pilot, lambda: copied == ["aten.mm.default"], what="copied")


@sync
async def test_x_compares_an_aten_call_across_sources_or_says_why_not():
    from torchscope.tui.screens.compare import CompareScreen

    other = aten_trace()
    bad = _t(float("nan"))
    bad["stats"]["nan"] = 2
    next(e for e in other if e.get("seq") == 7)["outputs"] = [bad]
    sources = [ScriptedSource(aten_trace(), mode="replay"), ScriptedSource(other, mode="replay")]
    app = TorchscopeApp(sources)
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await _shown(pilot, app)
        await pilot.press("end", "right", "l")  # AddmmBackward0's aten.mm
        assert tl.current_row().seq == 7
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, CompareScreen), what="compare")
        screen = app.screen
        await until(pilot, lambda: screen.table is not None and screen.table.aligned)
        assert [c.event["seq"] for c in screen.table.columns] == [7, 7]
        assert screen.table.outlier == 1 and "has NaN/Inf" in screen.table.why
        assert screen.table.title.startswith("aten.mm.default in ")
        await pilot.press("escape")
    plain = [e for e in aten_trace() if e.get("kind") != ATEN]
    app = TorchscopeApp([ScriptedSource(aten_trace(), mode="replay"), ScriptedSource(plain)])
    async with app.run_test(size=SIZE) as pilot:
        await _shown(pilot, app)
        await pilot.press("right", "l", "x")
        await until(pilot, lambda: isinstance(app.screen, CompareScreen), what="compare")
        screen = app.screen
        await until(pilot, lambda: screen.table is not None and len(screen.table.columns) == 2)
        await until(pilot, lambda: screen.table.columns[1].missing is not None)
        assert screen.table.columns[1].missing == "no aten calls recorded (record with --aten)"


# -- A: every row's aten calls at once ------------------------------------------------------------
def _shown_calls(tl) -> list[tuple[str, int]]:
    """(name of the op or node, seq of the call) of every aten call row shown."""
    rows = [tl.row(i) for i in range(tl.row_count())]
    return [(r.parent.name, r.seq) for r in rows if isinstance(r, AtenRow)]


@sync
async def test_A_unfolds_every_rows_calls_in_every_step_and_folds_them_back():
    app = TorchscopeApp(ScriptedSource(aten_trace(steps=2), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        assert "all aten calls" not in tl.border_subtitle
        await pilot.press("A")
        await until(pilot, lambda: tl.row_count() == 8, what="every row unfolded")
        linear, addmm = "torch.nn.functional.linear", "AddmmBackward0"
        assert _shown_calls(tl) == [(linear, 2), (linear, 3), (addmm, 7), (addmm, 9)]
        assert "▸-" in _line(tl, 0) and "◂-" in _line(tl, 5)
        assert "all aten calls shown (A)" in tl.border_subtitle
        assert tl.cursor == 0  # on the row it was on
        # one row still folds (and unfolds) by hand against it
        await pilot.press("left")
        await until(pilot, lambda: tl.row_count() == 6, what="linear folded by hand")
        assert _shown_calls(tl) == [(addmm, 7), (addmm, 9)] and "▸+" in _line(tl, 0)
        await pilot.press("right")
        await until(pilot, lambda: tl.row_count() == 8, what="linear unfolded again")
        # the next step comes unfolded too
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: main.current_step == 1 and tl.row_count() == 8)
        assert [seq for _, seq in _shown_calls(tl)] == [22, 23, 27, 29]
        # off: everything folds; the cursor on a call goes to its row
        await pilot.press("end")
        assert tl.current_row().seq == 29
        await pilot.press("A")
        await until(pilot, lambda: tl.row_count() == 4, what="every row folded")
        assert _shown_calls(tl) == [] and tl.current_row().name == addmm
        assert "all aten calls" not in tl.border_subtitle


@sync
async def test_A_shows_the_calls_of_rows_that_come_live_and_says_so_without_aten_calls():
    trace = aten_trace()
    forward = [e for e in trace if e["seq"] <= 5]  # up to relu: linear's calls in
    source = ScriptedSource(forward)
    app = TorchscopeApp(source)
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: tl.row_count() == 2, what="the forward ops")
        await pilot.press("A")
        await until(pilot, lambda: tl.row_count() == 4, what="linear unfolded")
        source.feed([e for e in trace if e["seq"] > 5])  # the backward, live
        await until(pilot, lambda: tl.row_count() == 8, what="the node arrives unfolded")
        assert _shown_calls(tl)[-2:] == [("AddmmBackward0", 7), ("AddmmBackward0", 9)]
        assert tl.cursor == tl.row_count() - 1  # still following the newest row
        await pilot.press("A")
        await until(pilot, lambda: tl.row_count() == 4, what="folded")
    app = TorchscopeApp(ScriptedSource(make_trace(1, 1), mode="replay"))
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: app.main.current_step == 0 and tl.row_count() > 0)
        rows = tl.row_count()
        await pilot.press("A")
        await until(pilot, lambda: any("no aten calls" in n for n in notes), what="the note")
        assert not tl.unfold_all and tl.row_count() == rows


# -- labels, collectives, DTensors ----------------------------------------------------------------
def _dtensor(value: float) -> dict:
    local = _t(value) | {"shape": [8, 2], "placement": "Shard(dim=0)"}
    return local | {"local_shape": [4, 2], "stats_of": "local"}


def labelled_trace() -> list[dict]:
    """aten_trace with its first call an autocast cast, the node's kernel a recompute, the
    engine's sum an all_reduce over 8 ranks whose output had not arrived, and linear's output
    a DTensor sharded on dim 0."""
    trace = aten_trace()
    by_seq = {e["seq"]: e for e in trace}
    by_seq[2]["label"] = "autocast"
    by_seq[7]["label"] = "recompute"
    pending = {"shape": [2], "dtype": "float32", "device": "cuda:0", "stats": None}
    by_seq[9].update(
        name="_c10d_functional.all_reduce.default",
        group_size=8,
        outputs=[pending | {"pending": True}],
    )
    by_seq[4]["outputs"] = [_dtensor(4.0)]
    return trace


def _body(main) -> str:
    return str(main.detail.body.render())


@sync
async def test_a_labelled_call_shows_its_tag_and_what_it_means():
    app = TorchscopeApp(ScriptedSource(labelled_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        await pilot.press("A")
        await until(pilot, lambda: tl.row_count() == 8, what="every row unfolded")
        assert "  aten.mm.default [autocast]" in _line(tl, 1)
        assert "[" not in _line(tl, 2).split("aten.add.Tensor")[1][:8]  # no label: no tag
        tag = next(c for c in tl.render_row(1, 120) if "[autocast]" in c[0])
        assert tag[1] == tl.cstyle("dim")
        await pilot.press("j")
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 2)
        assert "label autocast (a cast autocast put before the op)" in _body(main)
        await pilot.press("end", "k")
        assert tl.current_row().seq == 7 and "[recompute]" in _line(tl, tl.cursor)
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 7)
        assert "label recompute (activation checkpointing re-running" in _body(main)


@sync
async def test_tags_keep_the_columns_aligned_at_80x24():
    app = TorchscopeApp(ScriptedSource(labelled_trace(), mode="replay"))
    async with app.run_test(size=(80, 24)) as pilot:
        tl = app.main.timeline
        await _shown(pilot, app)
        await pilot.press("A")
        await until(pilot, lambda: tl.row_count() == 8, what="every row unfolded")
        width = tl.scrollable_content_region.width
        c = tl.columns(width)
        after_name = c.seq + 1 + c.dir + c.name + 1  # where the next column starts
        lines = ["".join(t for t, _ in tl.render_row(i, width)) for i in range(8)]
        assert "[autocast]" in lines[1] and "[recompute]" in lines[6]
        assert len({len(line) for line in lines}) == 1
        for line in lines:
            assert line[after_name - 1] == " " and line[after_name] != " ", line
        screen = app.screen_text()
        assert "[autocast]" in screen and "[recompute]" in screen


@sync
async def test_a_collectives_call_shows_its_group_and_that_its_output_was_not_read():
    app = TorchscopeApp(ScriptedSource(labelled_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        await pilot.press("colon", *"#9", "enter")
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 9, what="all_reduce")
        assert "pending" in _line(tl, tl.cursor)  # its stat cell
        text = _body(main)
        assert "_c10d_functional.all_reduce.default" in text and "group of 8 ranks" in text
        assert "not read: the collective had not completed" in text
        assert "metadata only" not in text


@sync
async def test_a_dtensor_summary_shows_its_placement_local_shape_and_whose_stats():
    app = TorchscopeApp(ScriptedSource(labelled_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _shown(pilot, app)
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 4, what="F.linear")
        outputs = _body(main).split("outputs", 1)[1]
        assert "[0] [8,2] float32" in outputs  # the global shape
        assert "Shard(dim=0) · local shard [4,2]" in outputs
        assert "norm 4 (of the local shard)" in outputs


def test_a_live_steps_layout_with_every_row_unfolded_grows_as_a_full_one_would():
    """Rows and calls arriving in any chunks (a node run twice, its second run taking calls
    the first one showed until then): the layout extended as they come is the full one."""
    from torchscope.tui.widgets.op_timeline import OpTimeline

    grad = {"kind": GRAD, "step": 0, "source": SRC, "backward": 2, "param": None}
    events = [e for e in aten_trace() if e.get("step") == 0]
    events += [  # AddmmBackward0 again (retain_graph): its kernel, its event, the sum
        _aten(15, "aten.mm.default", 0.7, node_id=11) | {"node": "AddmmBackward0"},
        {**grad, "seq": 16, "node": "AddmmBackward0", "node_id": 11, "op_seq": 4}
        | {"grad_outputs": [_t(1.0)], "grad_inputs": [_t(0.5)]},
        _aten(17, "aten.add.Tensor", 2.5, node_id=11)
        | {"node": "AddmmBackward0"}
        | {"accumulate": True},
    ]

    def layout(tl: OpTimeline) -> tuple:
        return (tl._fold_base, tl._fold_disp, tl._fold_before, tl._fold_calls, tl._calls_shown)

    for chunk in (1, 2, 3):
        for toggled in (set(), {(OP, 4)}):  # F.linear folded by hand, or not
            store = EventStore()
            grown, full = OpTimeline(), OpTimeline()
            for tl in (grown, full):
                tl.store, tl.unfold_all, tl._toggled = store, True, set(toggled)
            for i in range(0, len(events), chunk):
                store.ingest(events[i : i + chunk])
                grown.data = full.data = store.data(0)
                grown._update_views()
                full._laid = None  # laid out from scratch
                full._update_views()
                assert layout(grown) == layout(full), (chunk, toggled, i)
            assert grown._calls_shown == 6 - 2 * bool(toggled)
