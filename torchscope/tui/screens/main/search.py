"""``/`` in the timeline: where the search matches (rows and aten calls, folded or not), the
cursor from match to match (``ctrl+n`` / ``ctrl+p``), and the title's word on it. In the graph
the same keys walk the graph's own search."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Protocol

from torchscope.session.format import plural
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from torchscope.session.search import FieldPattern
    from torchscope.tui.widgets.graph_tree import GraphTree


class SearchScreen(ScreenCore, Protocol):
    """The main screen, as the search sees it."""

    center: str  # "timeline" or "graph"
    graph: GraphTree
    search: FieldPattern | None

    def graph_title(self) -> None: ...

    def refresh_title(self) -> None: ...

    def set_follow(self, on: bool) -> None: ...

    def show_detail(self) -> None: ...

    def show_timeline(self) -> None: ...


class Search:
    def __init__(self, main: SearchScreen) -> None:
        self.main = main
        self._origin: tuple[str, int] | None = None
        self._match_cache: tuple[tuple, list[tuple[int, int]]] | None = None

    def start(self) -> None:
        """A new search starts from the selected row (escape goes back to it)."""
        m = self.main
        row = m.timeline.current_row()
        self._origin = (row.kind, row.seq) if row is not None else None
        m.search = None

    def back_to_origin(self) -> None:
        origin = self._origin
        if origin is not None:
            self.main.timeline.select(*origin)

    def matches(self) -> list[tuple[int, int]]:
        """Where the search matches in the timeline: rows and aten calls, folded or not (see
        ``OpTimeline.match_positions``); cached per step view."""
        search = self.main.search
        if search is None:
            return []
        tl = self.main.timeline
        data = tl.data
        if data is None:
            return []
        shown = tl.row_count() - tl.calls_shown()  # the rows the filter keeps, and the pending
        key: tuple = (id(data), len(data.rows), len(data.aten), data.reorders, search, shown)
        key += (tl.pattern,)
        if self._match_cache is not None and self._match_cache[0] == key:
            return self._match_cache[1]
        found = tl.match_positions(search)
        self._match_cache = (key, found)
        return found

    def to_match(
        self, direction: int, *, include_current: bool = False, origin: bool = False
    ) -> bool:
        """Move the cursor to the next (1) or previous (-1) match, wrapping around."""
        m = self.main
        found = self.matches()
        if not found:
            return False
        tl = m.timeline
        cur = tl.position(tl.cursor)
        if origin and self._origin is not None:
            index = tl.index_of(*self._origin)
            cur = tl.position(index if index is not None else 0)
        if direction > 0:
            after = bisect.bisect_left if include_current else bisect.bisect_right
            i = after(found, cur)
            wrapped = i >= len(found)
            target = found[0] if wrapped else found[i]
        else:
            i = bisect.bisect_left(found, cur) - 1
            wrapped = i < 0
            target = found[-1] if wrapped else found[i]
        if wrapped and not origin:
            m.notify(
                "search wrapped" + (" to the top" if direction > 0 else " to the bottom"), timeout=2
            )
        m.set_follow(False)
        tl.go_to_position(target)
        m.show_detail()
        m.refresh_title()
        return True

    def step(self, direction: int) -> None:
        """``ctrl+n`` / ``ctrl+p``: the next or previous match (the graph's, in the graph)."""
        m = self.main
        graph = m.graph
        if m.center == "graph" and graph.search is not None:
            moved = graph.next_match(direction)
            if moved is None:
                m.notify(f"no node matches /{graph.search.pattern}/", timeout=3)
            elif moved[2]:
                m.notify("search wrapped", timeout=2)
            m.graph_title()
            return
        if m.search is None:
            m.notify("/ searches first (then ctrl+n / ctrl+p: next / previous match)", timeout=3)
            return
        if m.center == "graph":
            m.show_timeline()
        if not self.to_match(direction):
            m.notify(f"no match for /{m.search.pattern}/ in this step", timeout=3)

    def text(self) -> str:
        """The timeline's subtitle on the search: where the cursor is among the matches."""
        m = self.main
        if m.search is None:
            return ""
        found = self.matches()
        cur = m.timeline.position(m.timeline.cursor)
        i = bisect.bisect_left(found, cur)
        at = (
            f"{i + 1}/{len(found)}"
            if i < len(found) and found[i] == cur
            else plural(len(found), "match")
        )
        return f"search /{m.search.pattern}/ {at}"
