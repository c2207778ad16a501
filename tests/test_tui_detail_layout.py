"""The detail panel laid out for its width (issue: "the detail panel wraps into fragments"):
stats are key/value pairs that wrap as whole pairs, a 0-d tensor and a small one-row tensor
are one line each, the source excerpt has a line-number gutter and its lines are cut (never
wrapped), and at 120x40 the detail sits under the timeline, where MulBackward0 of the seed
example shows where both its gradients go without scrolling."""

from __future__ import annotations

import math
import re

import pytest
from textual.geometry import Region
from tui_pilot import sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.scripted import ScriptedSource

SIZES = [(80, 24), (120, 40)]
KEYS = {"min", "max", "mean", "std", "norm", "value", "NaN", "Inf"}
GUTTER = re.compile(r"^(?:▶| ) +\d+ │")


def visual_lines(app: TorchscopeApp) -> list[str]:
    """The detail's text as the panel shows it: after any wrapping the widget does."""
    body = app.main.detail.body
    width, height = body.size
    return [strip.text.rstrip() for strip in body.render_lines(Region(0, 0, width, height))]


def is_number(token: str) -> bool:
    try:
        float(token.rstrip(","))
    except ValueError:
        return False
    return True


def assert_pairs_whole(lines: list[str]) -> int:
    """Every stat key is followed by its value on the same line; returns how many pairs."""
    pairs = 0
    for line in lines:
        if "├" in line or "│" in line:  # the range bar ("min ├──┤ max"), source lines
            continue
        tokens = line.split()
        for i, token in enumerate(tokens):
            if token in KEYS:
                assert i + 1 < len(tokens) and is_number(tokens[i + 1]), (token, line, lines)
                pairs += 1
    return pairs


async def show(pilot, app: TorchscopeApp, pred) -> None:
    """Select the first timeline row ``pred`` accepts and wait for its detail, laid out for
    the panel's width."""
    main = app.main
    tl = main.timeline
    await until(pilot, lambda: tl.row_count() > 0, what="rows")
    index = next(i for i in range(tl.row_count()) if pred(tl.row(i)))
    seq = tl.row(index).seq
    tl.move_cursor(index, user=True, center=True)
    detail = main.detail

    def shown() -> bool:
        ev = detail.event
        body = detail.body
        return (
            ev is not None
            and ev.get("seq") == seq
            and body.size.width > 0
            and detail._width == body.content_region.width
        )

    await until(pilot, shown, what=f"the detail of #{seq}")


def small_tensors_trace() -> list:
    """The synthetic trace, its first op's output a 0-d tensor and its first input 3 values."""
    trace = make_trace(2, 2)
    op = next(e for e in trace if e.get("kind") == "op" and e.get("step") == 0)
    out = dict(op["outputs"][0])
    out.update(shape=[], values=[0.25], stats={"min": 0.25, "max": 0.25, "mean": 0.25})
    first = dict(op["inputs"][0])
    first.update(
        shape=[3],
        values=[1.0, 2.0, 3.0],
        stats={"min": 1.0, "max": 3.0, "mean": 2.0, "std": 1.0, "norm": 3.742},
    )
    second = dict(op["inputs"][1])
    second.update(shape=[2], values=[math.nan, 1.0], stats={**first["stats"], "nan": 1})
    op["outputs"] = [out]
    op["inputs"] = [first, second, *op["inputs"][2:]]
    return trace


@pytest.mark.parametrize("size", SIZES)
@sync
async def test_stats_wrap_by_whole_pairs(size):
    app = TorchscopeApp(ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"))
    async with app.run_test(size=size) as pilot:
        for name in ("torch.nn.functional.linear", "AddmmBackward0"):
            await show(pilot, app, lambda r, name=name: r.name == name)
            lines = visual_lines(app)
            # 3 inputs and an output, or a grad_output and 3 grad_inputs: 5 pairs each
            assert assert_pairs_whole(lines) >= 4 * 5, lines
            width = app.main.detail.body.content_region.width
            assert all(len(line) <= width for line in lines)


@pytest.mark.parametrize("size", SIZES)
@sync
async def test_a_0d_tensor_and_a_small_tensor_are_one_line_each(size):
    app = TorchscopeApp(ScriptedSource(small_tensors_trace(), mode="replay"))
    async with app.run_test(size=size) as pilot:
        await show(pilot, app, lambda r: r.kind == "op")
        lines = visual_lines(app)
        outputs = lines[next(i for i, t in enumerate(lines) if t.startswith("outputs")) :]
        zero_d = next(t for t in outputs if "[0] [] float32" in t)
        assert "value 0.25" in zero_d, lines
        small = next(t for t in lines if "[0] [3] float32" in t)
        assert "values [1, 2, 3]" in small and "mean 2" in small and "norm 3.742" in small
        i = lines.index(small)
        assert lines[i + 1].lstrip().startswith("[1]"), lines  # nothing of it on the next line
        assert "[1] [2] float32 cpu  values [nan, 1]" in lines[i + 1]
        assert "NaN 1" in lines[i + 1] + lines[i + 2]
        assert_pairs_whole(lines)


@pytest.mark.parametrize("size", SIZES)
@sync
async def test_source_lines_have_a_gutter_and_are_cut_not_wrapped(seed, size):
    app = TorchscopeApp(FileSource(str(seed)))
    async with app.run_test(size=size) as pilot:
        await show(pilot, app, lambda r: r.name == "MulBackward0")
        lines = visual_lines(app)
        head = next(i for i, t in enumerate(lines) if t.startswith("source "))
        assert "seed_grads.py:30" in lines[head]
        excerpt = lines[head + 1 : head + 8]  # line 30 and three lines either side
        assert all(GUTTER.match(t) for t in excerpt), excerpt
        assert [int(t.split("│")[0].strip(" ▶")) for t in excerpt] == list(range(27, 34))
        assert lines[head + 8 : head + 9] in ([], [""])  # no continuation line after them
        assert excerpt[3].startswith("▶ 30 │ ") and "out = x * y + x / y" in excerpt[3]
        width = app.main.detail.body.content_region.width
        assert all(len(t) <= width for t in excerpt)
        long = next(t for t in excerpt if "print(" in t)  # line 33 is 84 characters long
        if size == (80, 24):
            assert long.endswith("…") and len(long) == width
        assert_pairs_whole(lines)


@sync
async def test_mul_backward_shows_where_both_gradients_go_without_scrolling_at_120x40(seed):
    app = TorchscopeApp(FileSource(str(seed)))
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        await show(pilot, app, lambda r: r.name == "MulBackward0")
        # the detail under the timeline, the timeline keeping its columns
        assert main.has_class("-stacked")
        assert main.timeline.region.width >= 70 and main.detail.region.width >= 70
        await pilot.pause()
        region = main.detail.region
        screen = app.screen_text().splitlines()
        shown = [
            line[region.x : region.right]
            for line in screen[region.y : region.bottom]  # the panel as it is on the screen
        ]
        sent = [t for t in shown if "→ AccumulateGrad" in t]
        assert len(sent) == 2, shown
        assert "[0] [] float32 cpu" in sent[0] and "value 2" in sent[0]
        assert "[1] None → AccumulateGrad" in sent[1]
        assert any("[0] [] float32 cpu  value 1" in t for t in shown)  # grad_outputs


@sync
async def test_the_detail_is_laid_out_again_when_the_terminal_is_resized(seed):
    app = TorchscopeApp(FileSource(str(seed)))
    async with app.run_test(size=(160, 45)) as pilot:
        main = app.main
        await show(pilot, app, lambda r: r.name == "MulBackward0")
        wide = main.detail._width
        await pilot.resize_terminal(80, 24)
        detail = main.detail
        await until(
            pilot,
            lambda: detail._width == detail.body.content_region.width != wide,
            what="the detail laid out for 80 columns",
        )
        await pilot.pause()
        lines = visual_lines(app)
        assert len(lines) == len(detail._template.split("\n"))  # nothing wrapped by the widget
        assert all(len(t) <= detail.body.content_region.width for t in lines)
        assert_pairs_whole(lines)
