"""The main screen (screen.py) and the helpers that do the work of its keys."""

from torchscope.tui.screens.main.screen import MainScreen

__all__ = ["MainScreen"]
