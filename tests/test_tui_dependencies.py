"""The UI's modules never need each other round a circle (imports under TYPE_CHECKING count):
the app imports the screens it pushes, and the screens reach the app only through the
``Host`` protocol of screens/host.py; each part of the main screen reaches the screen only
through its own protocol (built on ``ScreenCore``, screens/main/context.py)."""

from __future__ import annotations

from test_layout import PACKAGE, cycles, graph_of, imports_of, module_name


def test_no_two_modules_of_the_ui_need_each_other() -> None:
    assert cycles(graph_of("tui")) == []


def test_no_screen_imports_the_app() -> None:
    wrong = {
        module_name(p)
        for p in (PACKAGE / "tui" / "screens").rglob("*.py")
        if "torchscope.tui.app" in imports_of(p)
    }
    assert wrong == set()


def test_the_main_screens_helpers_do_not_import_the_screen() -> None:
    screen = "torchscope.tui.screens.main.screen"
    wrong = {
        module_name(p)
        for p in (PACKAGE / "tui" / "screens" / "main").glob("*.py")
        if p.stem not in ("screen", "__init__") and screen in imports_of(p)
    }
    assert wrong == set()
