"""Where the main screen is and how it moves: jumps (enter, the detail's links, alerts), the
history that backspace walks, and the ``:`` go-to line. A mixin of
:class:`~torchscope.tui.screens.main.MainScreen`: it uses the screen's widgets and store."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchscope.protocol.events import GRAD, OP
from torchscope.tui.format import short_name
from torchscope.tui.store import (
    AtenRow,
)
from torchscope.tui.widgets.detail_panel import DetailPanel, Link

_HISTORY = 64  # jumps backspace can go back over


@dataclass(frozen=True)
class Location:
    """Where a jump starts or lands."""

    view: str  # "timeline" or "graph"
    step: int
    kind: str | None = None  # op / grad (timeline); None: whichever has this seq
    seq: int | None = None
    node: int | None = None  # graph


class Navigation:
    """Part of MainScreen (see the module's docstring)."""

    # -- jumps -------------------------------------------------------------------------------
    def _here(self) -> Location | None:
        if self.current_step is None:
            return None
        if self.center == "graph":
            return Location("graph", self.current_step, node=self.graph.current_node_id())
        row = self.timeline.current_row()
        return Location(
            "timeline",
            self.current_step,
            row.kind if row is not None else None,
            row.seq if row is not None else None,
        )

    def _go(self, loc: Location, *, record: bool = True) -> None:
        if record:
            here = self._here()
            if here is not None:
                self.history.append(here)
                del self.history[:-_HISTORY]
        if loc.step != self.current_step:
            self.set_follow(False)
            self.show_step(loc.step)
        if self.store.data(loc.step) is None:
            self.pending = loc
            return
        self._land(loc)

    def _land(self, loc: Location) -> None:
        if loc.view == "graph":
            self.show_graph(loc.node)
            return
        if self.center == "graph":
            self.center = "timeline"
        if loc.seq is not None and not self.select_in_timeline(loc.kind, loc.seq):
            self.notify(f"event #{loc.seq} is not in step {loc.step}", severity="warning")
        self.timeline.focus()

    def select_in_timeline(self, kind: str | None, seq: int) -> bool:
        if self.follow:
            self.set_follow(False)
        if self.timeline.select(kind, seq):
            return True
        if self.timeline.pattern is not None:  # hidden by the filter: drop the filter
            self._apply_filter(None)
            return self.timeline.select(kind, seq)
        return False

    def _jump_from_row(self, row) -> None:
        data = self.store.data(self.current_step)
        if data is None or self.current_step is None:
            return
        if row.pending:
            self.notify(f"{row.name} has not run yet: s runs it", timeout=3)
            return
        if row.kind == OP:
            grads = data.grads_of_op(row.seq)
            ids = data.nodes_of_op(row.seq)
            if grads:
                self._go(Location("timeline", self.current_step, GRAD, grads[0].seq))
                if len(ids) > 1:
                    names = ", ".join(g.name for g in grads[:6])
                    self.notify(f"{row.name} created {len(ids)} nodes: {names}", timeout=4)
            elif ids:
                in_graph = [i for i in ids if data.graph_of_node(i) is not None]
                if in_graph:
                    self._go(Location("graph", self.current_step, node=in_graph[0]))
                    self.notify("its node did not run in this backward call", timeout=4)
                else:  # no graph holds it yet: an empty graph view would say nothing
                    nodes = ", ".join(f"node id {i}" for i in ids[:4])
                    self.notify(
                        f"backward has not reached {short_name(row.name)} yet ({nodes}): "
                        "enter again once it has run",
                        timeout=5,
                    )
            else:
                self.notify(f"{row.name} created no autograd node", timeout=4)
        elif isinstance(row, AtenRow):  # an aten call: to the op or node it ran in
            self._go(Location("timeline", self.current_step, row.parent.kind, row.parent.seq))
        else:
            op_seq = row.op_seq
            if op_seq is not None and data.op(op_seq) is not None:
                self._go(Location("timeline", self.current_step, OP, op_seq))
            elif op_seq is not None:
                self.notify(f"op #{op_seq} that created {row.name} is not in this step")
            else:
                label = f"parameter {row.param}" if row.param else "no forward op recorded"
                self.notify(f"{row.name}: {label}", timeout=4)

    # -- the detail's links --------------------------------------------------------------------
    def on_detail_panel_follow(self, event: DetailPanel.Follow) -> None:
        self.follow_link(event.link)

    def action_detail_link(self, i: int) -> None:
        """A click on link ``i`` of the detail."""
        self.detail.follow(i)

    def follow_link(self, link: Link) -> None:
        """Go where a detail link points: an op, a backward node, an event."""
        step = link.step if link.step is not None else self.current_step
        if step is None or step not in self.store:
            self.notify("that step is not known any more", severity="warning", timeout=3)
            return
        if link.kind == "op":
            self._go(Location("timeline", step, OP, link.target))
        elif link.kind == "event":
            self._go(Location("timeline", step, None, link.target))
        elif link.kind == "node":
            data = self.store.data(step)
            grads = data.grads_of_node(link.target) if data is not None else []
            if grads:
                self._go(Location("timeline", step, GRAD, grads[0].seq))
            elif data is not None and data.graph_of_node(link.target) is not None:
                self._go(Location("graph", step, node=link.target))
                self.notify("that node did not run in this backward call", timeout=3)
            else:
                self.notify(
                    f"backward has not reached node id {link.target} yet: "
                    "follow the link again once it has run",
                    timeout=4,
                )

    def action_back(self) -> None:
        if not self.history:
            self.notify("no earlier jump to go back to", timeout=2)
            return
        self._go(self.history.pop(), record=False)

    # -- : command line ----------------------------------------------------------------------
    COMMAND_HELP = ":12 step · :#1234 event seq · :node 57 node id"

    def run_command(self, text: str) -> str | None:
        """Run a ``:`` command; None when it went, else the one-line reason it did not."""
        text = text.strip().lstrip(":").strip()
        if not text:
            return None
        m = re.fullmatch(r"(?:step\s*)?(\d+)", text)
        if m:
            return self._goto_step(int(m.group(1)))
        m = re.fullmatch(r"(?:#|seq\s*|event\s*)#?(\d+)", text)
        if m:
            return self._goto_seq(int(m.group(1)))
        m = re.fullmatch(r"node\s*#?(\d+)", text)
        if m:
            return self._goto_node(int(m.group(1)))
        return f"unknown command {text!r}: {self.COMMAND_HELP}"

    def _goto_step(self, step: int) -> str | None:
        order = self.store.order
        if step not in self.store:
            span = f" (steps {order[0]}-{order[-1]})" if order else " (no steps yet)"
            return f"no step {step}{span}"
        self.set_follow(False)
        self._go(Location("timeline", step))
        return None

    def _goto_seq(self, seq: int) -> str | None:
        for step in self.store.order:
            info = self.store.steps[step]
            if info.first_seq is not None and info.first_seq <= seq <= (info.last_seq or seq):
                data = self.store.data(step)
                if data is not None and not data.has_row(None, seq):
                    return (
                        f"event #{seq} is not an op, a backward node or an aten call (step {step})"
                    )
                self._go(Location("timeline", step, None, seq))
                return None
        return f"no op, node or aten call with event seq #{seq} in the steps known so far"

    def _goto_node(self, node: int) -> str | None:
        here = self.current_step
        steps = ([here] if here is not None else []) + [
            s for s in reversed(self.store.order) if s != here
        ]
        for step in steps:
            data = self.store.data(step) if self.store.is_resident(step) else None
            if data is None:
                continue
            grads = data.grads_of_node(node)
            if grads:
                self._go(Location("timeline", step, GRAD, grads[0].seq))
                return None
            if data.graph_of_node(node) is not None:
                self._go(Location("graph", step, node=node))
                return None
        return f"no backward node id {node} in the steps in memory"
