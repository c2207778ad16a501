"""The key hints at the bottom: what the keys do here, most useful first, as many as fit.

Textual's ``Footer`` shows every binding in declaration order and cuts the line where the
terminal ends, so at 80 columns it lost ``b B q ?``. This bar takes the hints in priority
order, keeps ``? help`` and ``q quit`` always, and drops the least useful ones first.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from torchscope.tui.keys import Hint, hint

ALWAYS: list[Hint] = [hint("help"), hint("quit")]


def _fit(hints: list[Hint], width: int, short: bool) -> list[tuple[str, str]]:
    chosen: list[tuple[str, str]] = []
    # each pair is "key label" plus two spaces before the next; the last has none after it
    used = sum(len(k) + len(t) + 3 for k, t, _ in ALWAYS) - 2
    for key, label, brief in hints:
        label = brief if short else label
        cost = len(key) + len(label) + 3
        if used + cost > width:
            continue  # a shorter one further on may still fit
        chosen.append((key, label))
        used += cost
    return chosen


def fit_hints(hints: list[Hint], width: int) -> Content:
    """``key label`` pairs, most important first, as many as fit in ``width`` (``? help``
    and ``q quit`` always, at the end). Short labels where they keep more keys on the bar
    (``n next`` for ``n next step`` at 80 columns)."""
    chosen = _fit(hints, width, short=False)
    if len(chosen) < len(hints):
        brief = _fit(hints, width, short=True)
        if len(brief) > len(chosen):
            chosen = brief
    parts = [
        Content.from_markup("[b $accent]$key[/] $label", key=key, label=label)
        for key, label in chosen + [(k, t) for k, t, _ in ALWAYS]
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
