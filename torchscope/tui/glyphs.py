"""Glyphs that depend on the fonts at hand.

A terminal finds ``⏸`` in some font of the system's; a browser page (``tui --web``) has only
its web font and the fonts installed where the browser runs, and on a plain Linux machine
none of them holds U+23F8: the mark of a pause would be blank. The web server sets
``TORCHSCOPE_GLYPHS=web`` for the UIs it starts, and they mark a pause with ``‖`` (in
DejaVu, which every Linux desktop has) instead.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "WEB", "pause"]

ENV = "TORCHSCOPE_GLYPHS"
WEB = "web"


def pause() -> str:
    """The mark of a paused job or event: ``⏸``, or ``‖`` in a browser."""
    return "‖" if os.environ.get(ENV) == WEB else "⏸"
