"""The key hints at the bottom: what the keys do here, most useful first, as many as fit.

Textual's ``Footer`` shows every binding in declaration order and cuts the line where the
terminal ends, so at 80 columns it lost ``b B q ?``. This bar takes the hints in priority
order, keeps ``? help`` and ``q quit`` always, and drops the least useful ones first.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

Hint = tuple[str, str]  # (key, what it does)

ALWAYS: list[Hint] = [("?", "help"), ("q", "quit")]


def fit_hints(hints: list[Hint], width: int) -> Content:
    """``key label`` pairs, most important first, as many as fit in ``width`` (``? help``
    and ``q quit`` always, at the end)."""
    chosen: list[Hint] = []
    used = sum(len(k) + len(t) + 3 for k, t in ALWAYS)
    for key, label in hints:
        cost = len(key) + len(label) + 3
        if used + cost > width:
            continue  # a shorter one further on may still fit
        chosen.append((key, label))
        used += cost
    parts = [
        Content.from_markup("[b $accent]$key[/] $label", key=key, label=label)
        for key, label in chosen + ALWAYS
    ]
    return Content("  ").join(parts)


class KeyBar(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.hints: list[Hint] = []
        self._last: Content | None = None

    def show(self, hints: list[Hint]) -> None:
        self.hints = hints
        self._render_hints()

    def on_resize(self) -> None:
        self._render_hints()

    def _render_hints(self) -> None:
        width = self.content_region.width or self.size.width or 80
        line = fit_hints(self.hints, width)
        if self._last is None or line.plain != self._last.plain:
            self._last = line
            self.update(line, layout=False)

    @property
    def text(self) -> str:
        return self._last.plain if self._last is not None else ""
