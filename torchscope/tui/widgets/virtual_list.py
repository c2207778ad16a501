"""A cursor list drawn line by line (Textual's Line API), for lists of any length.

Only the visible rows are rendered, and rendered rows are cached, so a keypress costs the same
with ten rows or a million (the approach of Toolong's ``LogLines``). Subclasses say how many rows
there are and how one row looks; this class does the cursor, scrolling, keys and mouse.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

Cell = tuple[str, Style | None]


def fit(text: str, width: int) -> str:
    """Pad or cut ``text`` to exactly ``width`` cells (an ellipsis marks a cut)."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text.ljust(width)
    if width == 1:
        return "…"
    return text[: width - 1] + "…"


def rfit(text: str, width: int) -> str:
    if width <= 0:
        return ""
    if len(text) <= width:
        return text.rjust(width)
    return "…" + text[-(width - 1) :] if width > 1 else "…"


class VirtualList(ScrollView, can_focus=True):
    """Base class: subclasses implement ``row_count``, ``render_row`` and optionally
    ``render_header`` and ``empty_text``."""

    HEADER_LINES: ClassVar[int] = 0
    CACHE_SIZE: ClassVar[int] = 2000

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "virtual-list--cursor",
        "virtual-list--cursor-blurred",
        "virtual-list--header",
        "virtual-list--dim",
        "virtual-list--accent",
        "virtual-list--error",
        "virtual-list--warning",
        "virtual-list--success",
        "virtual-list--muted",
    }

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor_up", "Up", show=False),
        Binding("down,j", "cursor_down", "Down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home", "first", "First", show=False),
        Binding("end", "last", "Last", show=False),
        Binding("enter", "select", "Select", show=False),
    ]

    class Highlighted(Message):
        """The cursor moved to ``index`` (user=True when a key or click moved it)."""

        def __init__(self, widget: VirtualList, index: int, user: bool) -> None:
            super().__init__()
            self.widget = widget
            self.index = index
            self.user = user

        @property
        def control(self) -> VirtualList:
            return self.widget

    class Selected(Message):
        """Enter (or a double click) on row ``index``."""

        def __init__(self, widget: VirtualList, index: int) -> None:
            super().__init__()
            self.widget = widget
            self.index = index

        @property
        def control(self) -> VirtualList:
            return self.widget

    def __init__(
        self, *, name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.cursor = -1
        self._cache: OrderedDict[tuple, Strip] = OrderedDict()
        self._styles: dict[str, Style] | None = None
        self._content_width = 0
        self._reveal_pending = False
        self._reveal_center = False

    # -- to override -------------------------------------------------------------------------
    def row_count(self) -> int:
        return 0

    def render_row(self, index: int, width: int) -> list[Cell]:
        return []

    def render_header(self, width: int) -> list[Cell]:
        return []

    def empty_text(self) -> str:
        return ""

    def row_width(self) -> int:
        """Width rows are laid out for (the visible width: no horizontal scrolling)."""
        return max(1, self.scrollable_content_region.width)

    # -- styles ------------------------------------------------------------------------------
    def cstyle(self, name: str) -> Style:
        if self._styles is None:
            self._styles = {
                cls.rsplit("--", 1)[1]: self.get_component_rich_style(cls, partial=True)
                for cls in self._get_component_classes()
            }
        return self._styles.get(name, Style())

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = None
        self._cache.clear()

    # -- data changes ------------------------------------------------------------------------
    def refresh_rows(self, *, clear: bool = True) -> None:
        """Row count or contents changed: resize the virtual area and repaint."""
        if clear:
            self._cache.clear()
        count = self.row_count()
        if self.cursor >= count:
            self.cursor = count - 1
        elif self.cursor < 0 and count:
            self.cursor = 0
        self.virtual_size = Size(self.row_width(), count + self.HEADER_LINES)
        self.refresh()

    def on_resize(self) -> None:
        self._cache.clear()
        self.virtual_size = Size(self.row_width(), self.row_count() + self.HEADER_LINES)
        self.scroll_to_cursor(animate=False)
        self.reveal_after_refresh()

    # -- cursor ------------------------------------------------------------------------------
    @property
    def page_height(self) -> int:
        return max(1, self.scrollable_content_region.height - self.HEADER_LINES)

    def move_cursor(self, index: int, *, user: bool = False, center: bool = False) -> None:
        count = self.row_count()
        if count == 0:
            self.cursor = -1
            self.refresh()
            return
        index = max(0, min(count - 1, index))
        old = self.cursor
        self.cursor = index
        if old != index:
            if 0 <= old < count:
                self.refresh_line(old + self.HEADER_LINES)
            self.refresh_line(index + self.HEADER_LINES)
        self.scroll_to_cursor(center=center)
        self.reveal_after_refresh(center=center)
        self.post_message(self.Highlighted(self, index, user))

    def cursor_visible(self) -> bool:
        top = round(self.scroll_y)
        return self.cursor < 0 or top <= self.cursor < top + self.page_height

    def reveal_after_refresh(self, *, center: bool = False) -> None:
        """Make sure the cursor is in view once pending layout and scroll updates are done
        (a jump or a pause can land while the list is being refilled or resized)."""
        self._reveal_center = center or self._reveal_center
        if not self._reveal_pending:
            self._reveal_pending = True
            self.call_after_refresh(self._reveal)

    def _reveal(self) -> None:
        self._reveal_pending = False
        center, self._reveal_center = self._reveal_center, False
        if not self.cursor_visible():
            self.scroll_to_cursor(center=center)

    def scroll_to_cursor(self, *, animate: bool = False, center: bool = False) -> None:
        if self.cursor < 0:
            return
        height = self.page_height
        top = round(self.scroll_y)
        if center:
            y = max(0, self.cursor - height // 2)
        elif self.cursor < top:
            y = self.cursor
        elif self.cursor >= top + height:
            y = self.cursor - height + 1
        else:
            return
        # force: rows that came in since the last layout have no scrollbar yet, and Textual
        # refuses a scroll without one (the reveal after the refresh could be the last look)
        self.scroll_to(y=y, animate=animate, immediate=True, force=True)

    def action_cursor_up(self) -> None:
        self.move_cursor(self.cursor - 1, user=True)

    def action_cursor_down(self) -> None:
        self.move_cursor(self.cursor + 1, user=True)

    def action_page_up(self) -> None:
        self.move_cursor(self.cursor - self.page_height, user=True)

    def action_page_down(self) -> None:
        self.move_cursor(self.cursor + self.page_height, user=True)

    def action_first(self) -> None:
        self.move_cursor(0, user=True)

    def action_last(self) -> None:
        self.move_cursor(self.row_count() - 1, user=True)

    def action_select(self) -> None:
        if 0 <= self.cursor < self.row_count():
            self.post_message(self.Selected(self, self.cursor))

    async def _on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        line = offset.y - self.HEADER_LINES
        if line < 0:
            return
        index = round(self.scroll_y) + line
        if index >= self.row_count():
            return
        self.move_cursor(index, user=True)
        if event.chain >= 2:  # a double click acts like enter
            self.post_message(self.Selected(self, index))

    # -- rendering ---------------------------------------------------------------------------
    def _strip(self, cells: list[Cell], width: int, base: Style, extra: Style | None) -> Strip:
        segments = []
        for text, style in cells:
            if not text:
                continue
            st = base + style if style is not None else base
            if extra is not None:
                st = st + extra
            segments.append(Segment(text, st))
        strip = Strip(segments)
        fill = base + extra if extra is not None else base
        return strip.adjust_cell_length(width, fill)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.rich_style
        if y < self.HEADER_LINES:
            return self._strip(self.render_header(width), width, base, self.cstyle("header"))
        count = self.row_count()
        index = round(self.scroll_y) + y - self.HEADER_LINES
        if count == 0:
            if y == self.HEADER_LINES:
                text = self.empty_text()
                return self._strip([(" " + text, self.cstyle("dim"))], width, base, None)
            return Strip.blank(width, base)
        if index >= count or index < 0:
            return Strip.blank(width, base)
        selected = index == self.cursor
        key = (index, width, selected, selected and self.has_focus)
        strip = self._cache.get(key)
        if strip is not None:
            self._cache.move_to_end(key)
            return strip
        extra = None
        if selected:
            cur = self.cstyle("cursor" if self.has_focus else "cursor-blurred")
            extra = Style(bgcolor=cur.bgcolor, bold=cur.bold)
        strip = self._strip(self.render_row(index, width), width, base, extra)
        self._cache[key] = strip
        if len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)
        return strip

    def on_focus(self) -> None:
        if self.cursor >= 0:
            self.refresh_line(self.cursor + self.HEADER_LINES)

    def on_blur(self) -> None:
        if self.cursor >= 0:
            self.refresh_line(self.cursor + self.HEADER_LINES)
