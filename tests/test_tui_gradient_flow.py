"""Gradient flow at a glance: a backward node's row has a ``∇in → ∇out`` column (``1 → 2,
None``: how many gradients arrived, and what it sends on to each input), so what flows
through a node needs no key. The column opens where the timeline has room for it next to
every other column, and drops first where it has not."""

from __future__ import annotations

import copy

import pytest
from tui_pilot import sync, until

from torchscope.protocol.events import GRAD
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource
from torchscope.tui.widgets.op_timeline import Columns, fit_flow, flow_text

T = {"shape": [8, 32], "dtype": "float32", "device": "cpu", "stats": {"norm": 1.0}}


def test_flow_text_counts_what_arrived_and_what_goes_to_each_input():
    assert flow_text([T], [T, T, None]) == "1 → 2, None"
    assert flow_text([T], [T, None, T]) == "1 → 1, None, 1"
    assert flow_text([T], [None, None]) == "1 → None, None"
    assert flow_text([T, None], [T]) == "1 → 1"  # a None that arrived is no gradient
    assert flow_text([T], []) == "1 → -"  # AccumulateGrad: nothing sent on
    assert flow_text([T], None) == "1 →"  # paused before the node ran
    assert flow_text(None, None) == "0 →"
    # narrower: no spaces, then ∅ for None, then cut
    assert fit_flow("1 → 2, None", 11) == "1 → 2, None"
    assert fit_flow("1 → 2, None", 8) == "1→2,None"
    assert fit_flow("1 → 2, None", 6) == "1→2,∅ "
    assert fit_flow("1 → 1, None, 1, None, 3", 8) == "1→1,∅,1…"


def test_the_flow_column_drops_first():
    nat = {"seq": 4, "name": 24, "module": 18, "flow": 14, "shapes": 7, "stat": 15, "flags": 5}
    nat["source"] = 11
    for width in range(40, 200):
        c = Columns(width, nat)
        assert c.flow == 0 or c.flow >= len(Columns.HEADERS["flow"]), width
        without = Columns(width, dict(nat, flow=0))
        if c.flow:  # shown where it costs no other column
            for col in ("shapes", "source"):
                assert getattr(c, col) or not getattr(without, col), (width, col)
            assert c.name == without.name and c.module == without.module, width
        else:
            assert vars(c) == vars(without), width
        used = (
            c.seq
            + 1
            + c.dir
            + sum(
                w + 1 for w in (c.name, c.module, c.flow, c.shapes, c.stat, c.flags, c.source) if w
            )
        )
        assert used + c.spare <= width, width
    assert Columns(102, nat).flow and Columns(130, nat).flow == 14  # wide: all of it
    assert not Columns(250, dict(nat, flow=0)).flow  # no backward node: no column


def flow_trace() -> list:
    """make_trace's MLP, one AddmmBackward0 sending a gradient to two of its three inputs
    (``1 → 1, None, 1``) and one to none of them."""
    trace = copy.deepcopy(make_trace(2, 2))
    addmm = [
        e
        for e in trace
        if e.get("kind") == GRAD and e["node"] == "AddmmBackward0" and e["step"] == 1
    ]
    addmm[0]["grad_inputs"] = [T, None, T]
    addmm[1]["grad_inputs"] = [None, None, None]
    return trace


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
@sync
async def test_node_rows_show_their_gradient_flow(size):
    trace = flow_trace()
    app = TorchscopeApp(ScriptedSource(trace, mode="replay"))
    async with app.run_test(size=size) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: app.main.current_step is not None, what="a step")
        app.main.show_step(1)
        await until(pilot, lambda: tl.step == 1 and tl.row_count() > 0, what="step 1")
        await until(pilot, lambda: tl.scrollable_content_region.width > 0, what="a layout")
        width = tl.scrollable_content_region.width
        c = tl.columns(width)
        assert tl.natural["flow"] == len("1 → None, None, None")
        if size == (200, 50):
            assert c.flow, "the flow shows where every column fits"
        if not c.flow:  # dropped for want of room beside the others
            assert c.spare < len("∇in → ∇out") + 1, vars(c)
            return
        header = tl.render_line(0).text
        start = c.seq + 1 + c.dir + c.name + 1 + c.module + 1
        assert header[start : start + c.flow].strip() == "∇in → ∇out", header
        by_seq = {e["seq"]: e for e in trace if e.get("step") == 1}
        seen = set()
        for i in range(tl.row_count()):
            row = tl.row(i)
            text = "".join(t for t, _ in tl.render_row(i, width))[start : start + c.flow]
            if row.kind != GRAD:
                assert text.strip() == "", (row, text)
                continue
            ev = by_seq[row.seq]
            want = flow_text(ev["grad_outputs"], ev["grad_inputs"])
            assert text == fit_flow(want, c.flow), (row.name, text, want)
            seen.add(want)
        assert {"1 → 1", "1 → -", "1 → 1, None, 1", "1 → None, None, None"} <= seen, seen
