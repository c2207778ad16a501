"""What the history view's two widgets (the plot, the heatmap) share: they draw from the
store's ``HistoryIndex`` in whole frames, every line at once, kept until what they show
changes (a frame over 100k steps costs milliseconds, a line lookup nothing)."""

from __future__ import annotations

from textual.strip import Strip
from textual.widget import Widget

from torchscope.session.history_index import HistoryIndex


class HistoryFrame(Widget, can_focus=True):
    """A widget over a ``HistoryIndex``, drawn by ``frame`` and redrawn only when
    ``frame_key`` (with the size, the index and its version) changes."""

    def __init__(
        self,
        index: HistoryIndex | None = None,
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.index = index if index is not None else HistoryIndex()
        self._frame_key: tuple | None = None
        self._frame: list[Strip] = []

    def frame_key(self) -> tuple:
        """What the frame shows beyond the size and the index (view, cursor, ...)."""
        raise NotImplementedError

    def frame(self, width: int, height: int) -> list[Strip]:
        raise NotImplementedError

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        key = (width, height, id(self.index), self.index.version, *self.frame_key())
        if key != self._frame_key:
            self._frame_key = key
            self._frame = self.frame(width, height)
        if 0 <= y < len(self._frame):
            return self._frame[y]
        return Strip.blank(width, self.rich_style)
