"""What leaves the main screen: ``y`` copies the selected event (or alert, or the values
fetched at the pause) to the clipboard (OSC 52)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torchscope.protocol.events import GRAD
from torchscope.session.format import short_name
from torchscope.session.rows import PendingRow
from torchscope.session.stepper_view import event_name
from torchscope.tui.screens.copy import CopyScreen, copy_choices
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from textual.app import App
    from textual.widget import Widget

    from torchscope.session.rows import Row
    from torchscope.session.stepper_view import ValuesView
    from torchscope.tui.widgets.alert_list import AlertList
    from torchscope.tui.widgets.graph_tree import GraphTree


class SharingScreen(ScreenCore, Protocol):
    """The main screen, as ``y`` sees it."""

    alerts: AlertList
    center: str  # "timeline" or "graph"
    current_step: int | None
    graph: GraphTree
    values: ValuesView | None

    @property
    def app(self) -> App[object]: ...

    @property
    def focused(self) -> Widget | None: ...

    def is_paused_row(self, row: Row | PendingRow) -> bool: ...


class Sharing:
    def __init__(self, main: SharingScreen) -> None:
        self.main = main

    def selected_event(self) -> tuple[dict | None, str | None]:
        """The event the user looks at (the graph's node, else the timeline's row) and the
        module its op ran in."""
        m = self.main
        store = m.store
        data = store.data(m.current_step)
        if m.center == "graph" and m.focused is m.graph:
            hit = m.graph.node_at_cursor()
            if hit is None or data is None:
                return None, None
            node = hit[0]
            op = data.op(node.get("op_seq")) if type(node.get("op_seq")) is int else None
            module = op.module if op is not None else None
            grads = data.grads_of_node(node.get("id"))
            if grads:
                return dict(store.event(grads[0])), module
            stub = {"kind": GRAD, "node": node.get("name"), "node_id": node.get("id")}
            if node.get("source"):
                stub["source"] = node["source"]
            return stub, module
        row = m.timeline.current_row()
        if row is None:
            return None, None
        ev = dict(row.event) if isinstance(row, PendingRow) else dict(store.event(row))
        module = row.module
        if not module and data is not None and row.op_seq is not None:
            op = data.op(row.op_seq)
            module = op.module if op is not None else None
        return ev, module or None

    def copy(self) -> None:
        m = self.main
        alerts = m.alerts
        alert = None
        index = alerts.highlighted
        if m.focused is alerts and index is not None and index < len(alerts.alerts):
            alert = alerts.alerts[index]
        ev, module = (None, None) if alert is not None else self.selected_event()
        fetched = None
        values = m.values
        row = m.timeline.current_row()
        if (
            alert is None
            and values is not None
            and values.result is not None
            and values.choice is not None
            and row is not None
            and m.is_paused_row(row)
        ):
            fetched = (values.label(), values.result)
        choices = copy_choices(ev, module=module, fetched=fetched, alert=alert)
        if not choices:
            m.notify("nothing to copy here: select an op, a node or an alert", timeout=3)
            return
        name = "alert" if alert is not None else event_name(ev or {})
        m.app.push_screen(CopyScreen(short_name(name), choices), self._copied)

    def _copied(self, choice: tuple[str, str, str] | None) -> None:
        if not choice:
            return
        _, what, text = choice
        self.main.app.copy_to_clipboard(text)
        preview = " ".join(text.split())
        if len(preview) > 60:
            preview = preview[:59] + "…"
        self.main.notify(f"copied {what}: {preview}", timeout=4)
