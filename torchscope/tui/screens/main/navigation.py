"""Where the main screen is and how it moves: jumps (enter, the detail's links, alerts), the
back stack that backspace walks, and the ``:`` go-to line."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol

from torchscope.protocol.events import GRAD, OP, Event
from torchscope.session.format import short_name
from torchscope.session.rows import AtenRow, PendingRow, Row
from torchscope.tui.screens.main.context import Location, ScreenCore
from torchscope.tui.widgets.detail_panel import Link

if TYPE_CHECKING:
    from torchscope.tui.widgets.graph_tree import GraphTree


class NavigationScreen(ScreenCore, Protocol):
    """The main screen, as jumps and the back stack see it."""

    back_stack: list[Location]  # jumps backspace goes back over
    center: str  # "timeline" or "graph"
    current_step: int | None
    follow: bool
    graph: GraphTree
    pending: Location | None  # a jump waiting for its step to load

    def clear_filter(self) -> None: ...

    def set_follow(self, on: bool) -> None: ...

    def show_graph(self, node: int | None = None) -> None: ...

    def show_step(self, step: int, *, keep_position: bool = False) -> None: ...


_BACK_STACK = 64  # jumps backspace can go back over

COMMAND_HELP = ":12 step · :#1234 event seq · :node 57 node id"


class Navigation:
    def __init__(self, main: NavigationScreen) -> None:
        self.main = main

    # -- jumps -------------------------------------------------------------------------------
    def here(self) -> Location | None:
        m = self.main
        if m.current_step is None:
            return None
        if m.center == "graph":
            return Location("graph", m.current_step, node=m.graph.current_node_id())
        row = m.timeline.current_row()
        return Location(
            "timeline",
            m.current_step,
            row.kind if row is not None else None,
            row.seq if row is not None else None,
        )

    def go(self, loc: Location, *, record: bool = True) -> None:
        m = self.main
        if record:
            here = self.here()
            if here is not None:
                m.back_stack.append(here)
                del m.back_stack[:-_BACK_STACK]
        if loc.step != m.current_step:
            m.set_follow(False)
            m.show_step(loc.step)
        if m.store.data(loc.step) is None:
            m.pending = loc
            return
        self.land(loc)

    def land(self, loc: Location) -> None:
        m = self.main
        if loc.view == "graph":
            m.show_graph(loc.node)
            return
        if m.center == "graph":
            m.center = "timeline"
        if loc.seq is not None and not self.select_in_timeline(loc.kind, loc.seq):
            m.notify(f"event #{loc.seq} is not in step {loc.step}", severity="warning")
        m.timeline.focus()

    def select_in_timeline(self, kind: str | None, seq: int) -> bool:
        m = self.main
        if m.follow:
            m.set_follow(False)
        if m.timeline.select(kind, seq):
            return True
        if m.timeline.pattern is not None:  # hidden by the filter: drop the filter
            m.clear_filter()
            return m.timeline.select(kind, seq)
        return False

    def jump_from_row(self, row: Row | PendingRow) -> None:
        m = self.main
        step = m.current_step
        data = m.store.data(step)
        if data is None or step is None:
            return
        if row.pending:
            m.notify(f"{row.name} has not run yet: s runs it", timeout=3)
            return
        if row.kind == OP:
            grads = data.grads_of_op(row.seq)
            ids = data.nodes_of_op(row.seq)
            if grads:
                self.go(Location("timeline", step, GRAD, grads[0].seq))
                if len(ids) > 1:
                    names = ", ".join(g.name for g in grads[:6])
                    m.notify(f"{row.name} created {len(ids)} nodes: {names}", timeout=4)
            elif ids:
                in_graph = [i for i in ids if data.graph_of_node(i) is not None]
                if in_graph:
                    self.go(Location("graph", step, node=in_graph[0]))
                    m.notify("its node did not run in this backward call", timeout=4)
                else:  # no graph holds it yet: an empty graph view would say nothing
                    nodes = ", ".join(f"node id {i}" for i in ids[:4])
                    m.notify(
                        f"backward has not reached {short_name(row.name)} yet ({nodes}): "
                        "enter again once it has run",
                        timeout=5,
                    )
            else:
                m.notify(f"{row.name} created no autograd node", timeout=4)
        elif isinstance(row, AtenRow):  # an aten call: to the op or node it ran in
            self.go(Location("timeline", step, row.parent.kind, row.parent.seq))
        else:
            op_seq = row.op_seq
            if op_seq is not None and data.op(op_seq) is not None:
                self.go(Location("timeline", step, OP, op_seq))
            elif op_seq is not None:
                m.notify(f"op #{op_seq} that created {row.name} is not in this step")
            else:
                label = f"parameter {row.param}" if row.param else "no forward op recorded"
                m.notify(f"{row.name}: {label}", timeout=4)

    def jump_to_alert(self, alert: Event) -> None:
        m = self.main
        step, seq = alert.get("step"), alert.get("event_seq")
        if type(step) is not int or type(seq) is not int or step not in m.store:
            m.notify("this alert does not name an event", severity="warning")
            return
        # forward / input alerts name an op, backward ones a node: the seq says which.
        self.go(Location("timeline", step, None, seq))

    # -- the detail's links --------------------------------------------------------------------
    def follow_link(self, link: Link) -> None:
        """Go where a detail link points: an op, a backward node, an event."""
        m = self.main
        step = link.step if link.step is not None else m.current_step
        if step is None or step not in m.store:
            m.notify("that step is not known any more", severity="warning", timeout=3)
            return
        if link.kind == "op":
            self.go(Location("timeline", step, OP, link.target))
        elif link.kind == "event":
            self.go(Location("timeline", step, None, link.target))
        elif link.kind == "node":
            data = m.store.data(step)
            grads = data.grads_of_node(link.target) if data is not None else []
            if grads:
                self.go(Location("timeline", step, GRAD, grads[0].seq))
            elif data is not None and data.graph_of_node(link.target) is not None:
                self.go(Location("graph", step, node=link.target))
                m.notify("that node did not run in this backward call", timeout=3)
            else:
                m.notify(
                    f"backward has not reached node id {link.target} yet: "
                    "follow the link again once it has run",
                    timeout=4,
                )

    def back(self) -> None:
        m = self.main
        if not m.back_stack:
            m.notify("no earlier jump to go back to", timeout=2)
            return
        self.go(m.back_stack.pop(), record=False)

    # -- : command line ----------------------------------------------------------------------
    def run_command(self, text: str) -> str | None:
        """Run a ``:`` command; None when it went, else the one-line reason it did not."""
        text = text.strip().lstrip(":").strip()
        if not text:
            return None
        found = re.fullmatch(r"(?:step\s*)?(\d+)", text)
        if found:
            return self._goto_step(int(found.group(1)))
        found = re.fullmatch(r"(?:#|seq\s*|event\s*)#?(\d+)", text)
        if found:
            return self._goto_seq(int(found.group(1)))
        found = re.fullmatch(r"node\s*#?(\d+)", text)
        if found:
            return self._goto_node(int(found.group(1)))
        return f"unknown command {text!r}: {COMMAND_HELP}"

    def _goto_step(self, step: int) -> str | None:
        m = self.main
        order = m.store.order
        if step not in m.store:
            span = f" (steps {order[0]}-{order[-1]})" if order else " (no steps yet)"
            return f"no step {step}{span}"
        m.set_follow(False)
        self.go(Location("timeline", step))
        return None

    def _goto_seq(self, seq: int) -> str | None:
        store = self.main.store
        for step in store.order:
            info = store.steps[step]
            if info.first_seq is not None and info.first_seq <= seq <= (info.last_seq or seq):
                data = store.data(step)
                if data is not None and not data.has_row(None, seq):
                    return (
                        f"event #{seq} is not an op, a backward node or an aten call (step {step})"
                    )
                self.go(Location("timeline", step, None, seq))
                return None
        return f"no op, node or aten call with event seq #{seq} in the steps known so far"

    def _goto_node(self, node: int) -> str | None:
        store = self.main.store
        here = self.main.current_step
        steps = ([here] if here is not None else []) + [
            s for s in reversed(store.order) if s != here
        ]
        for step in steps:
            data = store.data(step) if store.is_resident(step) else None
            if data is None:
                continue
            grads = data.grads_of_node(node)
            if grads:
                self.go(Location("timeline", step, GRAD, grads[0].seq))
                return None
            if data.graph_of_node(node) is not None:
                self.go(Location("graph", step, node=node))
                return None
        return f"no backward node id {node} in the steps in memory"
