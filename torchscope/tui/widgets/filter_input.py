"""The one-line prompt under the timeline: ``/`` search, ``|`` filter, ``:`` go to.

- search: a regex (any case) matched against each field a row shows on its own: the name
  (as shown, ``F.linear``, and in full), the module (or parameter), the source (as shown,
  ``train.py:20``, and the full path); ``^`` and ``$`` anchor within one field, and an aten
  call is matched by its name. The cursor moves to the first match as you type, every row
  stays; ``ctrl+n`` / ``ctrl+p`` next / previous match.
- filter: the same regex, and only the matching rows stay.
- command (k9s-style ``:``): ``:12`` step 12, ``:#1234`` the event with seq 1234,
  ``:node 57`` the backward node with id 57.
- export (``e``): the file to write the step (or the filtered rows) to, as JSON lines.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Input


class Mode(Protocol):
    """What the box needs of a prompt mode (``torchscope.tui.screens.main.prompt``)."""

    name: str
    title: str
    placeholder: str


class FilterInput(Input):
    """Hidden until ``/``, ``|`` or ``:``. Enter keeps (or runs), escape clears (closes)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Clear", show=False),
        Binding("up", "history(-1)", "Earlier", show=False),
        Binding("down", "history(1)", "Later", show=False),
    ]

    class Cancelled(Message):
        pass

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.mode: Any = None  # a Mode once opened
        self._recalled: int | None = None  # where ↑↓ are in the mode's history

    def action_history(self, delta: int) -> None:
        """↑↓ in a mode that keeps a history (``p``, ``e``): earlier / later entries, as a
        shell's; past the newest, the box is empty again."""
        history = getattr(self.mode, "history", None)
        items = history(self.screen) if history is not None else None
        if not items:
            return
        at = len(items) if self._recalled is None else self._recalled
        at = max(0, min(len(items), at + delta))
        self._recalled = at
        self.value = items[at] if at < len(items) else ""
        self.cursor_position = len(self.value)

    def set_mode(self, mode: Mode) -> None:
        self.mode = mode
        self._recalled = None
        self.placeholder = mode.placeholder
        self.ok()

    def ok(self) -> None:
        """Back to the mode's own title (after an error)."""
        self.remove_class("-invalid")
        self.border_title = self.mode.title if self.mode is not None else ""

    def error(self, text: str) -> None:
        """A one-line error in the box's title."""
        self.add_class("-invalid")
        self.border_title = text

    def action_cancel(self) -> None:
        self.post_message(self.Cancelled())
