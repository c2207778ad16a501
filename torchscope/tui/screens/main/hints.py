"""The main screen's key bar: the keys that act now, most useful first (it shows what fits).
Which keys depends on the pause, live or recording, the focused panel and the sources."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torchscope.session.rows import FLAG_INF_IN, FLAG_INF_OUT, FLAG_NAN_IN, FLAG_NAN_OUT
from torchscope.tui.keys import Hint, hint
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from textual.widget import Widget

    from torchscope.session.search import FieldPattern
    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.alert_list import AlertList
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.graph_tree import GraphTree


class HintsScreen(ScreenCore, Protocol):
    """The main screen, as the key bar's hints see it."""

    alerts: AlertList
    detail: DetailPanel
    graph: GraphTree
    host: Host
    search: FieldPattern | None

    @property
    def focused(self) -> Widget | None: ...

    @property
    def live(self) -> bool: ...


# A row's NaN/Inf flags (its other flags, FLAG_ACCUMULATE, say nothing of its values).
NAN_INF = FLAG_NAN_IN | FLAG_INF_IN | FLAG_NAN_OUT | FLAG_INF_OUT


def key_hints(m: HintsScreen, *, maximised: bool, ready: bool) -> list[Hint]:
    """The key bar of ``m`` (``maximised``: a panel has the whole screen; ``ready``: the
    widgets are mounted)."""
    live = m.live
    paused = m.store.stepper.paused is not None
    focus = m.focused
    graph = m.graph
    out: list[Hint] = []
    if paused:
        out += [hint("step"), hint("next"), hint("continue")]
        if not live:
            out += [hint("step_back")]
    elif live:
        out += [hint("pause"), hint("continue")]
    out += m.host.lane_hints()  # several sources: 1-9, o, x
    out += [hint("break_here"), hint("breakpoints")]
    out += [hint("search")]
    if focus is not graph:
        out += [hint("toggle_graph")]
    out += [hint("alerts")]
    if paused and live:
        out += [hint("values")]
    if focus is graph:
        out += [
            hint("enter", "op"),
            hint("toggle_graph", "timeline"),
            hint("group_modules", "chains" if graph.by_module else None),
        ]
    elif focus is m.alerts:
        out += [hint("enter", "go to alert")]
    elif focus is m.detail:
        out += [("↑↓", "link", "link"), hint("enter", "follow"), hint("escape", "timeline")]
    else:
        out += [hint("enter")]
    if m.search is not None or (focus is graph and graph.search is not None):
        out += [hint("next_match")]
    out += [hint("command_line"), hint("prev_step")]
    out += [hint("back")]
    out += [hint("maximize_panel", "restore" if maximised else None)]
    if live:
        out += [hint("follow")]
    row = m.timeline.current_row() if ready else None
    if paused or (row is not None and row.flags & NAN_INF):
        out += [hint("first_nan")]
    out += [hint("copy"), hint("export")]
    out += [hint("filter"), hint("tab"), hint("stat_mode"), hint("↑↓ j k")]
    if m.store.has_aten:
        out += [hint("unfold_all", "fold aten" if m.timeline.unfold_all else None)]
    return out
