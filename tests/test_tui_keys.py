"""One key table (tui/keys.py) makes the bindings, the key bar and the help: every action a
screen binds is in it once; the help starts with stepping and then the focused panel's keys,
in two columns where there is room, and says when more is below; the 80-column key bar keeps
the keys a paused user needs, with short labels."""

from __future__ import annotations

from textual.widgets import Static
from tui_pilot import sync, until

from torchscope.tui import keys
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.screens.help import HelpScreen
from torchscope.tui.screens.main import MainScreen

TRACE = make_trace(2, 2)
GELU0 = next(e["seq"] for e in TRACE if e.get("name") == "torch.nn.functional.gelu")


def test_every_bound_action_is_in_the_table_once_and_has_a_handler():
    actions = [k.action for k in keys.KEYS if k.action]
    assert len(actions) == len(set(actions))
    for k in keys.KEYS:
        if k.action and k.owner == "main":
            assert callable(getattr(MainScreen, f"action_{k.action}", None)), k.action
        if k.action and k.owner == "app":
            assert callable(getattr(TorchscopeApp, f"action_{k.action}", None)), k.action
    bound = {b.action for b in MainScreen.BINDINGS}  # type: ignore[union-attr]
    assert bound == {k.action for k in keys.KEYS if k.action and k.owner == "main"}


def test_help_sections_start_with_stepping_then_the_focused_panel():
    titles = [t for t, _ in keys.help_sections(keys.GRAPH, live=True, aten=False, sources=False)]
    assert titles[:2] == [keys.STEPPING, keys.GRAPH]
    assert keys.SOURCES not in titles
    replay = dict(keys.help_sections(None, live=False, aten=False, sources=True))
    assert "@" not in dict(replay[keys.STEPPING]) and keys.SOURCES in replay
    live = dict(keys.help_sections(None, live=True, aten=False, sources=False))
    assert dict(live[keys.STEPPING])["@"].startswith("live: ")


def help_text(app: TorchscopeApp) -> str:
    return "\n".join(str(w.render()) for w in app.screen.query(Static))


@sync
async def test_help_at_80x24_cues_more_below_and_at_200x50_shows_two_columns():
    job = FakeJob(TRACE, pause_at=GELU0)
    app = TorchscopeApp(job)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.store.stepper.paused is not None, what="paused")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        box = app.screen.query_one("#help-box")
        await until(pilot, lambda: "more below" in str(box.border_subtitle), what="the cue")
        text = help_text(app)
        assert text.index("Stepping") < text.index("Timeline") < text.index("Moving around")
        assert not app.screen.query(".help-column")  # one column at 80
        for _ in range(200):
            await pilot.press("j")
            if "more below" not in str(box.border_subtitle):
                break
        assert "more below" not in str(box.border_subtitle)  # at the end, the cue goes
    app = TorchscopeApp(FakeJob(TRACE, pause_at=GELU0))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.store.stepper.paused is not None, what="paused")
        await pilot.press("g")
        await until(pilot, lambda: app.main.center == "graph", what="the graph")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        columns = app.screen.query(".help-column")
        assert len(columns) == 2
        first = str(columns[0].render())
        assert first.index("Stepping") < first.index("Graph")  # the focused panel's next


@sync
async def test_the_paused_key_bar_at_80_columns_keeps_break_search_graph_and_alerts():
    app = TorchscopeApp(FakeJob(TRACE, pause_at=GELU0))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.store.stepper.paused is not None, what="paused")
        await until(pilot, lambda: "s step" in app.main.key_bar.text, what="the paused bar")
        bar = app.main.key_bar.text
        for shown in ("s ", "n ", "c ", "b ", "B ", "/ ", "a ", "? help", "q quit"):
            assert shown in bar, (shown, bar)
        assert len(bar) <= 80
