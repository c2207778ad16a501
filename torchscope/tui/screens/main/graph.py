"""The backward graph in the middle of the main screen (``g``): showing it at the selected op's
node and back to the timeline at the node's gradient, ``M`` grouping by module, its title, and
the detail following its cursor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from textual.widgets import Tree

from torchscope.protocol.events import GRAD, OP
from torchscope.session.format import plural
from torchscope.tui.screens.main.context import Location, ScreenCore

if TYPE_CHECKING:
    from torchscope.tui.widgets.detail_panel import DetailPanel
    from torchscope.tui.widgets.graph_tree import GraphTree


class GraphScreen(ScreenCore, Protocol):
    """The main screen, as the graph view sees it."""

    center: str  # "timeline" or "graph"
    current_step: int | None
    detail: DetailPanel
    graph: GraphTree

    def go(self, loc: Location, *, record: bool = True) -> None: ...

    def refresh_status(self) -> None: ...

    def select_in_timeline(self, kind: str | None, seq: int) -> bool: ...


class GraphView:
    def __init__(self, main: GraphScreen) -> None:
        self.main = main

    def toggle(self) -> None:
        if self.main.center == "graph":
            self.hide()
        else:
            self.show()

    def group_modules(self) -> None:
        """``M`` in the graph: group its nodes by module ⇄ chains."""
        m = self.main
        if m.center != "graph":
            m.notify("M groups the backward graph by module: g opens the graph", timeout=3)
            return
        by_module = m.graph.toggle_grouping()
        m.notify(
            "graph: module tree with each module's gradient norm (→ opens one)"
            if by_module
            else "graph: chains of nodes",
            timeout=2,
        )
        self.title()
        m.refresh_status()

    def title(self) -> None:
        graph = self.main.graph
        sub = ["by module (M: chains)" if graph.by_module else "M: by module"]
        if graph.node_filter is not None:
            kept = graph.shown_count()
            shown = plural(kept, "node")
            sub.insert(0, f"filter /{graph.node_filter.pattern}/ {shown} (| esc: clear)")
        if graph.search is not None:
            n = len(graph.matches)
            at = f"{graph.match_at + 1}/{n}" if n and graph.match_at >= 0 else plural(n, "match")
            sub.insert(0, f"search /{graph.search.pattern}/ {at}")
        graph.border_subtitle = " · ".join(sub)

    def show(self, node: int | None = None) -> None:
        """The graph instead of the timeline, at ``node`` (else the selected row's)."""
        m = self.main
        store, graph = m.store, m.graph
        data = store.data(m.current_step)
        m.center = "graph"
        graph.set_step(store, data, "" if data else m.timeline.message)
        if node is None:
            row = m.timeline.current_row()
            if row is not None and data is not None:
                if row.kind == GRAD:
                    node = row.node_id
                else:
                    ids = data.nodes_of_op(row.seq)
                    node = ids[0] if ids else None
        if node is not None:
            graph.reveal(node)
        self.title()
        graph.focus()
        hit = graph.node_at_cursor()  # the detail follows the graph's cursor from here
        if hit is not None and data is not None:
            m.detail.show_node(store, data, *hit)

    def hide(self) -> None:
        """Back to the timeline, at the gradient of the graph's node."""
        m = self.main
        node = m.graph.current_node_id()
        m.center = "timeline"
        data = m.store.data(m.current_step)
        if node is not None and data is not None:
            grads = data.grads_of_node(node)
            if grads:
                m.select_in_timeline(GRAD, grads[0].seq)
        m.timeline.focus()

    def node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        m = self.main
        if event.control is not m.graph:
            return
        hit = m.graph.node_at_cursor()
        data = m.store.data(m.current_step)
        if hit is not None and data is not None:
            node, call = hit
            m.detail.show_node(m.store, data, node, call)

    def node_selected(self, event: Tree.NodeSelected) -> None:
        m = self.main
        step = m.current_step
        if event.control is not m.graph:
            return
        hit = m.graph.node_at_cursor()
        if hit is None or step is None:
            return
        node, _ = hit
        op_seq = node.get("op_seq")
        data = m.store.data(step)
        if isinstance(op_seq, int) and data is not None and data.op(op_seq) is not None:
            m.go(Location("timeline", step, OP, op_seq))
        elif node.get("param"):
            m.notify(f"{node.get('name')} accumulates into parameter {node['param']}")
        else:
            m.notify(f"{node.get('name')} (node id {node.get('id')}): no forward op recorded")
