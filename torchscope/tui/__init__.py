"""The torchscope terminal UI (Textual). Imports no torch: it runs on a laptop looking at a
cluster job or at a trace file.

``run_tui(source)`` runs it on an event source: ``FileSource(path)`` (replay),
``LiveSource(control_endpoint)`` (a running job) or ``ScriptedSource(events)`` (tests);
``open_source(target)`` picks one for a command-line argument. ``run_tui([s1, s2, ...])`` opens
several side by side (the ranks of a job, recordings: ``torchscope.tui.sources.open.open_sources``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchscope.tui.app import TorchscopeApp, run_tui
    from torchscope.tui.sources.base import EventSource, SourceError
    from torchscope.tui.sources.file import FileSource
    from torchscope.tui.sources.live import LiveSource
    from torchscope.tui.sources.open import open_source
    from torchscope.tui.sources.scripted import ScriptedSource

__all__ = [
    "EventSource",
    "FileSource",
    "LiveSource",
    "ScriptedSource",
    "SourceError",
    "TorchscopeApp",
    "open_source",
    "run_tui",
]

_SOURCES = {
    "EventSource": "base",
    "FileSource": "file",
    "LiveSource": "live",
    "ScriptedSource": "scripted",
    "SourceError": "base",
    "open_source": "open",
}


def __getattr__(name: str) -> Any:
    # Lazy: the data layer (sources, store) is usable without importing textual.
    if name in ("TorchscopeApp", "run_tui"):
        from torchscope.tui import app

        return getattr(app, name)
    if name in _SOURCES:
        import importlib

        return getattr(importlib.import_module(f"torchscope.tui.sources.{_SOURCES[name]}"), name)
    raise AttributeError(f"module 'torchscope.tui' has no attribute {name!r}")
