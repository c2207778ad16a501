"""The timeline's columns at every terminal size, and the Steps panel's live loss.

Columns: name, module and stat are there at 80x24, 120x40 and 200x50; no header is cut;
module paths are shortened from the left, keeping the leaf (``…attn.proj``); sources are
``file:line``; each column is as wide as its content (or its header), no wider.

Loss: a step in progress shows no loss until its backward runs, then the value at the root of
that backward (not the last one-value op before it: a ``sqrt``, a ``sub``, a NaN).
"""

from __future__ import annotations

import copy
import math

import pytest
from tui_pilot import sync, until

from torchscope.protocol.events import Event
from torchscope.session.format import plural, short_path, source_cell
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource
from torchscope.tui.widgets.op_timeline import Columns
from torchscope.tui.widgets.step_list import short_num

SIZES = [(80, 24), (120, 40), (200, 50)]
DEEP = "/home/me/projects/research/experiments/seed_grads.py"
LABELS = {
    "seq": "seq",
    "name": "name",
    "module": "module",
    "flow": "∇in → ∇out",
    "shapes": "shapes",
    "stat": "stat",
    "flags": "flags",
    "source": "source",
}


def attention_trace() -> list:
    """make_trace's MLP with attention-like module paths (``blocks.0.attn.proj``, parameter
    ``blocks.0.attn.proj.weight``) and a source deep in directories, NaN at step 1."""
    out = []
    for ev in make_trace(2, 2, nan_step=1):
        ev = copy.deepcopy(ev)
        if ev.get("module"):
            ev["module"] = ev["module"].replace(".fc", ".attn.proj").replace(".act", ".attn.act")
        if ev.get("param"):
            ev["param"] = ev["param"].replace(".fc", ".attn.proj")
        if isinstance(ev.get("source"), str):
            ev["source"] = ev["source"].replace("/work/job/train.py", DEEP)
        out.append(ev)
    return out


async def open_step(pilot, app: TorchscopeApp, step: int = 1):
    tl = app.main.timeline
    await until(pilot, lambda: app.main.current_step is not None, what="a step")
    app.main.show_step(step)
    await until(pilot, lambda: tl.step == step and tl.row_count() > 0, what=f"step {step}")
    await until(pilot, lambda: tl.scrollable_content_region.width > 0, what="a laid-out timeline")
    return tl


def spans(c: Columns) -> dict[str, tuple[int, int]]:
    """Where each shown column lies in a line: ``{column: (start, width)}``."""
    out = {"seq": (0, c.seq)}
    x = c.seq + 1 + c.dir
    for col in ("name", "module", "flow", "shapes", "stat", "flags", "source"):
        w = getattr(c, col)
        if w:
            out[col] = (x, w)
            x += w + 1
    return out


def cell(line: str, span: tuple[int, int]) -> str:
    start, width = span
    return line[start : start + width].strip()


def check_header(tl, width: int) -> str:
    header = tl.render_line(0).text
    c = tl.columns(width)
    shown = spans(c)
    assert "…" not in header, header
    for col in ("name", "module", "stat"):  # never dropped
        assert col in shown, (col, header)
    for col, span in shown.items():
        text = cell(header, span)
        want = c.module_header() if col == "module" else LABELS[col]
        assert text == want, (col, text, header)  # the whole label, in its column
    words = header.split()
    assert words[:2] == ["seq", "name"] and "module" in words and "stat" in words, header
    return header


def check_widths(tl, width: int) -> None:
    """Each column as wide as its content or its header, never wider; with room to spare,
    every column gets all of its content."""
    c = tl.columns(width)
    nat = tl.natural
    for col, (_, w) in spans(c).items():
        if col == "seq":
            continue
        label = c.module_header() if col == "module" else LABELS[col]
        assert w <= max(nat[col], len(label)), (col, w, nat[col])
        if c.spare:
            assert w == max(nat[col], len("module" if col == "module" else label)), (col, w)
    for col in ("flow", "shapes", "source"):  # dropped only for want of room
        if not getattr(c, col) and nat[col]:
            assert c.spare < max(nat[col], len(LABELS[col])) + 1, (col, c.spare)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@sync
async def test_header_name_module_stat_never_cut_and_modules_keep_their_leaf(size):
    app = TorchscopeApp(ScriptedSource(attention_trace(), mode="replay"))
    async with app.run_test(size=size) as pilot:
        tl = await open_step(pilot, app)
        width = tl.scrollable_content_region.width
        check_header(tl, width)
        check_widths(tl, width)
        c = tl.columns(width)
        span = spans(c)["module"]
        linears = 0
        for i in range(tl.row_count()):
            row = tl.row(i)
            full = row.param or row.module or "-"
            text = "".join(t for t, _ in tl.render_row(i, width))[span[0] : span[0] + span[1]]
            text = text.strip()
            if text == full:
                continue
            # shortened from the left by whole parts: the leaf is kept
            assert text.startswith("…") and full.endswith(text[1:]), (full, text)
            assert full[-len(text)] == ".", (full, text)
            assert text.endswith(full.rsplit(".", 1)[-1]), (full, text)
            assert len(text) <= c.module
            if row.name == "torch.nn.functional.linear":
                assert "attn.proj" in text, text  # never "blocks.0.a…"
                linears += 1
        if size == (200, 50):
            assert c.source, "the source shows at 200x50"
        if c.module < len("blocks.0.attn.proj"):
            assert linears, "some attention ops were shortened"


@sync
async def test_sources_are_file_and_line():
    app = TorchscopeApp(ScriptedSource(attention_trace(), mode="replay"))
    async with app.run_test(size=(200, 50)) as pilot:
        tl = await open_step(pilot, app)
        width = tl.scrollable_content_region.width
        c = tl.columns(width)
        span = spans(c)["source"]
        seen = 0
        for i in range(tl.row_count()):
            row = tl.row(i)
            text = "".join(t for t, _ in tl.render_row(i, width))
            got = text[span[0] : span[0] + span[1]].strip()
            if row.source:
                line = row.source.rsplit(":", 1)[1]
                assert got == f"seed_grads.py:{line}", (row.source, got)
                seen += 1
            else:
                assert got == ""
        assert seen > 5
        assert "source" in check_header(tl, width)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@sync
async def test_widths_follow_the_content(size):
    # make_trace's own names: at 200x50 everything fits with room to spare
    app = TorchscopeApp(ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"))
    async with app.run_test(size=size) as pilot:
        tl = await open_step(pilot, app)
        width = tl.scrollable_content_region.width
        check_header(tl, width)
        check_widths(tl, width)
        if size == (200, 50):  # every column shows, name and module in full
            c = tl.columns(width)
            assert all((c.flow, c.shapes, c.source)), vars(c)
            assert (c.name, c.module) == (tl.natural["name"], tl.natural["module"])


def test_columns_keep_name_module_stat_and_whole_headers_at_any_width():
    natural = {"seq": 4, "name": 24, "module": 25, "shapes": 7, "stat": 15, "flags": 5}
    natural["source"] = 16
    for flags in (0, 3, 9):
        nat = dict(natural, flags=flags)
        for width in range(40, 260):
            c = Columns(width, nat)
            assert c.name >= 8 and c.module >= len("module") and c.stat >= 5, width
            assert bool(c.flags) == bool(flags) and (not c.flags or c.flags >= len("flags"))
            for col in ("shapes", "source"):
                w = getattr(c, col)
                assert w == 0 or w >= len(col), (width, col, w)
            shown = [getattr(c, k) for k in ("name", "module", "shapes", "stat", "flags", "source")]
            used = c.seq + 1 + c.dir + sum(w + 1 for w in shown if w)
            assert used + c.spare <= width, width
            for k in ("name", "module", "shapes", "stat", "source"):
                assert getattr(c, k) <= max(nat[k], len(k)), (width, k)
    wide = Columns(250, natural)
    assert (wide.name, wide.module, wide.stat, wide.shapes, wide.source) == (24, 25, 15, 7, 16)


def test_short_path_keeps_the_leaf_and_source_cell_is_file_and_line():
    assert short_path("blocks.0.attn.proj", 18) == "blocks.0.attn.proj"
    assert short_path("blocks.0.attn.proj", 10) == "…attn.proj"
    assert short_path("blocks.0.attn.proj", 12) == "…0.attn.proj"
    assert short_path("blocks.1.attn.proj.weight", 12) == "…proj.weight"
    assert short_path("blocks.1.attn.proj.weight", 5) == "…ight"
    assert source_cell(f"{DEEP}:30") == "seed_grads.py:30"
    assert source_cell("train.py:3") == "train.py:3"
    assert source_cell(None) == ""
    assert [plural(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert plural(1, "match") == "1 match" and plural(3, "match") == "3 matches"


# -- the live loss -----------------------------------------------------------------------------


def _scalar(value: float) -> dict:
    return {
        "shape": [],
        "dtype": "float32",
        "device": "cpu",
        "stats": {"min": value, "max": value, "mean": value, "std": 0.0, "norm": abs(value)},
        "values": [value],
    }


@sync
async def test_the_live_loss_is_blank_until_the_backward_then_its_root():
    trace = make_trace(2, 2)
    step1 = [e for e in trace if e.get("step") == 1]
    ops = [e for e in step1 if e.get("kind") == "op"]
    loss_op = next(e for e in ops if e["name"].endswith("mse_loss"))
    at_loss = trace.index(loss_op)
    # The two ops before the loss make one value each: a NaN, then a sqrt giving 4. Neither
    # is the loss (the old column showed the last of them).
    nan_op, sqrt_op = trace[at_loss - 2], trace[at_loss - 1]
    assert nan_op in ops and sqrt_op in ops
    nan_op["outputs"] = [dict(_scalar(0.0), values=[math.nan])]
    sqrt_op["name"], sqrt_op["outputs"] = "Tensor.sqrt", [_scalar(4.0)]
    root = trace.index(next(e for e in step1 if e.get("kind") == "grad"))
    assert trace[root]["op_seq"] == loss_op["seq"]  # the backward's root: the loss op's node
    loss = loss_op["outputs"][0]["values"][0]
    last = max(e["seq"] for e in trace)
    sentinels = iter(range(last + 1, last + 100))

    src = ScriptedSource(trace[: at_loss - 2])  # live: step 0, and step 1 up to the NaN
    app = TorchscopeApp(src)
    async with app.run_test(size=(120, 40)) as pilot:
        store, steps = app.store, app.main.steps

        async def feed(events: list) -> None:
            """Feed ``events``, then wait until the UI has applied them and what the source's
            overview made of them (a late op of step 0 behind them says when)."""
            before = store.steps[0].n_ops
            mark = Event(kind="op", seq=next(sentinels), step=0, name="Tensor.clone")
            src.feed([*events, mark])
            await until(pilot, lambda: store.steps[0].n_ops > before, what="the events")
            await pilot.pause()

        def loss_cell() -> str:
            index = store.order.index(1)
            cells = steps.render_row(index, steps.scrollable_content_region.width)
            return cells[1][0]

        await until(pilot, lambda: 1 in store.steps and store.overview_version > 0)
        assert store.steps[0].loss is not None  # step 0's backward ran: its loss shows
        for events in ([nan_op], [sqrt_op], trace[at_loss:root]):  # no backward yet
            await feed(events)
            assert store.steps[1].loss is None, events[-1].get("name")
            assert loss_cell().strip() == "", loss_cell()
        assert store.steps[1].n_ops == ops.index(loss_op) + 1  # the loss op came
        await feed([trace[root]])  # the backward starts at the loss's node
        await until(pilot, lambda: store.steps[1].loss is not None, what="the loss")
        assert math.isclose(store.steps[1].loss, loss)
        assert loss_cell().strip() == short_num(loss, 6)
        await feed(trace[root + 1 :])  # the rest of the step leaves it alone
        assert math.isclose(store.steps[1].loss, loss)
        assert loss_cell().strip() == short_num(loss, 6)
