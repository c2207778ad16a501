"""The timeline filter: a regex over op/node name, module (or parameter) and source."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Input


class FilterInput(Input):
    """Hidden until ``/``. Enter keeps the filter, escape clears it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Clear filter", show=False),
    ]

    class Cancelled(Message):
        pass

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            placeholder="regex (any case) over name, module, source — enter: keep, esc: clear",
            id=id,
        )

    def action_cancel(self) -> None:
        self.post_message(self.Cancelled())
