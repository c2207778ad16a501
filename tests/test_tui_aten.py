"""The aten level in the UI: an op's or node's aten calls kept under it (bounded like the
rows), unfolded in the timeline with → / l and folded with ← / h, and shown in the detail."""

from __future__ import annotations

from tui_pilot import SIZE, sync, until

from torchscope.protocol.events import ATEN, GRAD, OP
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.sources import ScriptedSource
from torchscope.tui.store import AtenRow, EventStore
from torchscope.tui.synthetic import make_trace


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
    from torchscope.tui.screens.help import ATEN_KEYS, KEYS, keys_for

    store = EventStore()
    assert keys_for(store) is KEYS
    store.ingest(aten_trace())
    keys = keys_for(store)
    assert len(keys) == len(KEYS) + 1 and ATEN_KEYS[0] in keys
    assert keys.index(ATEN_KEYS[0]) == [k for k, _ in KEYS].index("→ ←") + 1
