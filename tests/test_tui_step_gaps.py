"""Dormant gaps in the step list: where traced steps are not consecutive (152 then 164: the
job ran untraced between), a dim row says how many steps were not traced, at every width,
and the cursor passes over it."""

from __future__ import annotations

import pytest
from tui_pilot import sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource
from torchscope.tui.widgets.step_list import gap_text

STEPS = {0: 151, 1: 152, 2: 164, 3: 165, 4: 167}


def gappy_trace() -> list:
    """make_trace's steps renumbered 151, 152, 164, 165, 167."""
    out = []
    for ev in make_trace(len(STEPS), 2):
        if ev.get("kind") != "session":
            ev["step"] = STEPS[ev["step"]]
        out.append(ev)
    return out


def row_text(steps, index: int, width: int) -> str:
    return "".join(t for t, _ in steps.render_row(index, width))


def test_gap_text_fits_every_width():
    assert gap_text(11, 40) == "… 11 steps not traced"
    assert gap_text(1, 40) == "… 1 step not traced"
    assert gap_text(11, 16) == "… 11 not traced"
    assert gap_text(11, 13) == "… 11 untraced"
    assert gap_text(11, 12) == "… 11"
    for missing in (1, 11, 12_345):
        for width in range(1, 40):
            text = gap_text(missing, width)
            assert len(text) <= width and text.startswith("…"), (missing, width, text)
            if width >= len(str(missing)) + 1:
                assert str(missing) in text.replace(",", ""), (missing, width, text)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
@sync
async def test_the_step_list_marks_untraced_steps_and_the_cursor_passes_over(size):
    app = TorchscopeApp(ScriptedSource(gappy_trace(), mode="replay"))
    async with app.run_test(size=size) as pilot:
        main, steps = app.main, app.main.steps
        await until(pilot, lambda: len(app.store.order) == len(STEPS), what="the steps")
        await until(pilot, lambda: main.current_step == 151, what="the first step")
        assert app.store.order == list(STEPS.values())
        # 151, 152, gap, 164, 165, gap, 167
        assert steps.row_count() == len(STEPS) + 2
        assert [steps.step_at(i) for i in range(7)] == [151, 152, None, 164, 165, None, 167]
        assert [steps.gap_at(i) for i in range(7)] == [None, None, 11, None, None, 1, None]
        for width in (10, 16, 24, 40, 60):  # the gap rows at every width
            gap = row_text(steps, 2, width)
            assert len(gap) <= width and "…" in gap and "11" in gap, (width, gap)
            assert "1" in row_text(steps, 5, width), width
        assert "11 steps not traced" in row_text(steps, 2, 40)
        assert "1 step not traced" in row_text(steps, 5, 40)
        steps.focus()
        await until(pilot, lambda: steps.has_focus, what="the steps panel focused")
        await pilot.press("down")  # 151 -> 152
        await until(pilot, lambda: main.current_step == 152, what="step 152")
        await pilot.press("down")  # over the gap row: 164
        await until(pilot, lambda: main.current_step == 164, what="step 164")
        assert steps.cursor == 3
        await pilot.press("up")  # back over it: 152
        await until(pilot, lambda: main.current_step == 152, what="step 152 again")
        assert steps.cursor == 1
        main.show_step(167)  # a jump puts the cursor on the step's row
        await until(pilot, lambda: steps.cursor == 6, what="the cursor on 167")
        if steps.size.width:  # the panel is shown: the gap row is painted
            lines = [steps.render_line(y).text for y in range(steps.HEADER_LINES + 7)]
            assert any("11" in line and "…" in line for line in lines), lines


@sync
async def test_consecutive_steps_have_no_gap_rows():
    app = TorchscopeApp(ScriptedSource(make_trace(3, 2), mode="replay"))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: len(app.store.order) == 3, what="the steps")
        steps = app.main.steps
        assert steps.row_count() == 3
        assert [steps.step_at(i) for i in range(3)] == [0, 1, 2]
        assert all(steps.gap_at(i) is None for i in range(3))
