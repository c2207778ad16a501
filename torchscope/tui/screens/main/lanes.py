"""Several sources on the main screen: moving the view to another lane (same step, same op,
aligned by name, module and occurrence), ``X`` / ``x`` to mark and compare the selected op, and
the source bar. Which lane is shown, the scope of commands and the mark are the app's
(:class:`~torchscope.tui.screens.host.Host`); what the screen shows of them is here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torchscope.session.align import describe_key, find_key, row_key
from torchscope.tui.screens.compare import CompareScreen, CompareSpec
from torchscope.tui.screens.host import LaneSwitch
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from textual.app import App

    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.alert_list import AlertList
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.graph_tree import GraphTree


class LanesScreen(ScreenCore, Protocol):
    """The main screen, as the lanes (several sources) see it."""

    alerts: AlertList
    center: str  # "timeline" or "graph"
    current_step: int | None
    detail: DetailPanel
    follow: bool
    graph: GraphTree
    host: Host

    @property
    def app(self) -> App[object]: ...

    @property
    def live(self) -> bool: ...

    def refresh_sources(self) -> None: ...

    def refresh_status(self) -> None: ...

    def restart(self) -> None: ...

    def select_in_timeline(self, kind: str | None, seq: int) -> bool: ...

    def set_follow(self, on: bool) -> None: ...

    def show_detail(self) -> None: ...

    def show_graph(self, node: int | None = None) -> None: ...

    def show_step(self, step: int, *, keep_position: bool = False) -> None: ...

    def show_timeline(self) -> None: ...


class LaneView:
    def __init__(self, main: LanesScreen) -> None:
        self.main = main
        #: (lane, step, alignment key, graph shown) the last switch still has to land on
        self._align: tuple[int, int, tuple | None, bool] | None = None

    def switch(self, switch: LaneSwitch) -> None:
        """Show lane ``switch.new``, at the same step and (``align``) on the same op where it
        has them."""
        m = self.main
        host = m.host
        old = host.lanes[switch.old]
        step = m.current_step
        graph = m.center == "graph"
        if graph:
            m.show_timeline()
        row = m.timeline.current_row()
        key = row_key(old.store, old.store.data(step), row) if step is not None else None
        follow = m.follow
        host.show_lane(switch.new)
        new = host.lane
        m.restart()
        store = new.store
        cwd = store.session.get("cwd") if store.session is not None else None
        if isinstance(cwd, str):  # where the detail finds source lines
            for w in (m.timeline, m.graph, m.detail, m.alerts):
                w.cwd = cwd
        target = None
        if step is not None and new.has_step(step):
            target = step
        elif store.order:
            if step is None or follow:
                target = store.newest_step if m.live else store.order[0]
            else:  # the nearest step this lane has
                target = min(store.order, key=lambda s: (abs(s - step), s))
        if not follow or target != store.newest_step:
            m.set_follow(False)
        if target is None:
            m.timeline.set_step(store, None, None, "waiting for events…")
        else:
            m.show_step(target)
            if switch.align:
                self._align = (switch.new, target, key if target == step else None, graph)
                self.land_aligned()
        m.refresh_status()
        m.refresh_sources()

    def land_aligned(self) -> None:
        """Select the op or node the last switch kept, once its step is in memory."""
        align = self._align
        if align is None:
            return
        index, step, key, graph = align
        m = self.main
        host = m.host
        if index != host.current or m.current_step != step:
            self._align = None
            return
        store = host.store
        data = store.data(step)
        if data is None:
            return
        self._align = None
        if key is not None:
            row = find_key(store, data, key)
            if row is not None:
                m.select_in_timeline(row.kind, row.seq)
            else:
                m.notify(
                    f"{describe_key(key)} is not in step {step} of {host.label(host.lane)}",
                    timeout=3,
                )
        m.show_detail()
        if graph:
            m.show_graph()

    # -- X / x: mark and compare -------------------------------------------------------------
    def _selected(self) -> tuple[int, tuple] | None:
        """(step, alignment key) of the selected op or node; None (said) when there is none."""
        m = self.main
        store = m.store
        step = m.current_step
        row = m.timeline.current_row() if m.center == "timeline" else None
        if m.center == "graph":
            node = m.graph.current_node_id()
            data = store.data(step)
            grads = data.grads_of_node(node) if data is not None and node is not None else []
            row = grads[0] if grads else None
        if step is None or row is None:
            m.notify("select an op or a backward node first", timeout=3)
            return None
        if row.pending:
            m.notify(f"{row.name} has not run yet: s runs it", timeout=3)
            return None
        key = row_key(store, store.data(step), row)
        if key is None:
            m.notify("this event cannot be compared", timeout=3)
            return None
        return step, key

    def mark(self) -> None:
        m = self.main
        host = m.host
        found = self._selected()
        if found is None:
            return
        step, key = found
        mark = (host.current, step, key, host.label(host.lane))
        if host.mark is not None and host.mark[:3] == mark[:3]:
            host.mark = None
            m.notify("mark cleared", timeout=2)
        else:
            host.mark = mark
            m.notify(
                f"marked {describe_key(key)}, step {step}: x in another step compares them",
                timeout=4,
            )
        m.refresh_status()

    def compare(self) -> None:
        m = self.main
        host = m.host
        found = self._selected()
        if found is None:
            return
        step, key = found
        modes = []
        if host.mark is not None:
            modes.append("mark")
        if host.multi:
            modes.append("sources")
        if not modes:
            m.notify(
                "x compares the selected op across ranks or recordings (torchscope tui A B); "
                "with one, X marks an op and x compares it with another step's",
                timeout=5,
            )
            return
        spec = CompareSpec(lane=host.current, step=step, key=key, mark=host.mark)
        m.app.push_screen(CompareScreen(spec, modes, shown_step=lambda: m.current_step))
