"""Screens: the main one (live and replay alike) and help."""

from torchscope.tui.screens.help import HelpScreen
from torchscope.tui.screens.main import MainScreen

__all__ = ["HelpScreen", "MainScreen"]
