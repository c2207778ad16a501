"""The first ten minutes, in Pilot: what a new user reads first does not mislead."""

from __future__ import annotations

import os

import pytest
from tui_pilot import sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource


def _cut_in_backward(events: list, step: int) -> list:
    """The events up to the middle of ``step``'s backward (its graph event not yet sent):
    what a live UI holds while the job is paused at a backward node."""
    grads = [i for i, e in enumerate(events) if e.get("step") == step and e["kind"] == "grad"]
    return events[: grads[len(grads) // 2]]


def _step_row(app, step: int) -> str:
    lines = app.screen_text().splitlines()
    return next((ln for ln in lines if ln.lstrip("│ ").startswith(f"{step} ")), "")


@sync
async def test_a_live_step_paused_in_its_backward_shows_its_gradient_norm_as_partial():
    events = _cut_in_backward(make_trace(3, 4), step=2)
    app = TorchscopeApp(ScriptedSource(events, mode="live"))
    async with app.run_test(size=(120, 40)) as pilot:
        store = app.store

        def partial_shown() -> bool:
            info = store.steps.get(2)
            return info is not None and info.grad_norm is not None and "…" in _step_row(app, 2)

        await until(pilot, partial_shown, what="step 2's |g| marked partial")
        assert store.steps[2].backward_open and not store.steps[1].backward_open
        done = _step_row(app, 1)
        assert done and "…" not in done  # a complete step's norm reads as it always did


def _long_named_origin() -> list:
    events = make_trace(3, 4, nan_step=1)
    for e in events:
        if e["kind"] == "alert":
            e["name"] = "torch.nn.functional.cross_entropy"
    return events


@pytest.mark.parametrize("size", [(200, 50), (120, 40)])
@sync
async def test_the_alerts_column_shows_an_origins_op_name_whole(size):
    app = TorchscopeApp(ScriptedSource(_long_named_origin(), mode="replay"), at_origin=False)
    async with app.run_test(size=size) as pilot:
        alerts = app.main.alerts
        await until(pilot, lambda: alerts.option_count > 0, what="the alerts")
        await until(
            pilot,
            lambda: "F.cross_entropy" in _panel_text(app, alerts),
            what="the whole name in the alerts panel",
        )


def _panel_text(app, widget) -> str:
    """What the screen shows inside a widget's region."""
    region = widget.content_region
    lines = app.screen_text().splitlines()
    return "\n".join(line[region.x : region.right] for line in lines[region.y : region.bottom])


@sync
async def test_in_a_browser_the_pause_mark_is_a_glyph_its_fonts_have(monkeypatch):
    # ⏸ (U+23F8) is in no font a browser has offline on Linux: the web UI marks with ‖
    from torchscope.cli.web import app_main
    from torchscope.tui import glyphs

    # Recorded as it was (unset, usually): app_main sets it in os.environ itself, and the
    # teardown must put it back as it was, not as it was after app_main.
    monkeypatch.setenv(glyphs.ENV, "")
    assert app_main(["/nonexistent.tsc"]) == 2  # a tab's process, refused: the mark is set
    assert glyphs.pause() == "‖"
    app = TorchscopeApp(ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "NaN first appears" in app.screen_text(), what="the pause")
        text = app.screen_text()
        assert "‖ NaN first appears" in text and "⏸" not in text
    os.environ.pop(glyphs.ENV)
    assert glyphs.pause() == "⏸"
