"""Everything about one event: both sides of an op or a backward node, in full.

For an op: its inputs and outputs, and the autograd nodes it created. For a backward node:
``grad_outputs`` (the gradient that arrived) and ``grad_inputs`` (what it sends to each input,
with ``None`` shown explicitly, and where each goes). Each tensor gets its full summary (shape,
dtype, device, min/max/mean/std/norm, NaN/Inf), a bar of where mean±std lies in [min, max],
its values when small, and a sparkline of them. Then the source line with three lines of
context, read from the file when it is on this machine.
"""

from __future__ import annotations

from typing import Any

from textual.containers import VerticalScroll
from textual.markup import escape
from textual.widgets import Static

from torchscope.protocol.events import OP, Event
from torchscope.tui.format import (
    compact_stat,
    fnum,
    range_bar,
    shape_text,
    short_name,
    short_source,
    source_context,
    sparkline,
)
from torchscope.tui.store import EventStore, Row, StepData

_MAX_VALUES = 16
_MAX_TENSORS = 64


def _e(value: Any) -> str:
    return escape(str(value))


class DetailPanel(VerticalScroll, can_focus=True):
    """Scrollable detail of the event under the cursor."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.body = Static("", id="detail-body", markup=True)
        self.cwd: str | None = None
        self.subject: tuple | None = None

    def compose(self):  # type: ignore[override]
        yield self.body

    # -- entry points ------------------------------------------------------------------------
    def show_message(self, text: str) -> None:
        self.subject = ("message", text)
        self._set(f"[dim]{_e(text)}[/]")

    def show_row(self, store: EventStore, data: StepData | None, row: Row) -> None:
        subject = ("row", row.seq, row.kind, id(data))
        if subject == self.subject:
            return
        self.subject = subject
        ev = store.event(row)
        if row.kind == OP:
            self._set(self._op(store, data, row, ev))
        else:
            self._set(self._grad(store, data, row, ev))

    def show_node(self, store: EventStore, data: StepData, node: dict, call: Event | None) -> None:
        """A graph node: its grad event when it ran, else what the graph says about it."""
        nid = node.get("id")
        grads = data.grads_of_node(nid) if isinstance(nid, int) else None
        if grads:
            row = grads[0]
            self.subject = None
            self.show_row(store, data, row)
            return
        self.subject = ("node", nid)
        self._set(self._node(store, data, node, call))

    def show_alert(self, alert: Event) -> None:
        self.subject = ("alert", alert.get("seq"))
        lines = [
            f"[b $text-error]⚠ {_e(alert.get('message', 'alert'))}[/]",
            f"step {_e(alert.get('step'))} · {_e(alert.get('where', ''))} · "
            f"event #{_e(alert.get('event_seq'))}",
            "[dim]enter jumps to the event[/]",
        ]
        self._set("\n".join(lines))

    def _set(self, markup: str) -> None:
        self.body.update(markup)
        self.scroll_home(animate=False, immediate=True)

    # -- pieces ------------------------------------------------------------------------------
    def _source(self, source: str | None, function: str | None = None) -> list[str]:
        if not source:
            return ["[dim]source: unknown[/]"]
        where = _e(short_source(source, self.cwd))
        head = f"[b]source[/] [$accent]{where}[/]" + (
            f" in [i]{_e(function)}[/]" if function else ""
        )
        ctx = source_context(source, self.cwd)
        if ctx is None:
            return [head, "[dim]  (file not available on this machine)[/]"]
        width = len(str(ctx[-1][0]))
        lines = [head]
        for number, text, target in ctx:
            num = str(number).rjust(width)
            code = _e(text.expandtabs(4))
            if target:
                lines.append(f"[b $accent]▶ {num} │ {code}[/]")
            else:
                lines.append(f"[dim]  {num} │[/] {code}")
        return lines

    def _summary(self, label: str, s: Any, note: str = "") -> list[str]:
        pad = "      "
        if s is None:
            why = note or "no gradient (input needs none, or it was not requested)"
            return [f"  {label} [b]None[/] [dim]{_e(why)}[/]"]
        if not isinstance(s, dict):
            return [f"  {label} [dim]?[/]"]
        head = (
            f"  {label} [b]{_e(shape_text(s))}[/] {_e(s.get('dtype', '?'))} "
            f"{_e(s.get('device', '?'))}"
        )
        if note:
            head += f" [dim]{_e(note)}[/]"
        lines = [head]
        stats = s.get("stats")
        if not isinstance(stats, dict) or not stats:
            lines.append(f"{pad}[dim](metadata only: no values summarised)[/]")
            return lines
        of = " [dim](of |z|)[/]" if s.get("stats_of") == "abs" else ""
        lines.append(
            f"{pad}min {fnum(stats.get('min'))}  max {fnum(stats.get('max'))}  "
            f"mean {fnum(stats.get('mean'))}  std {fnum(stats.get('std'))}  "
            f"[b]norm {fnum(stats.get('norm'))}[/]{of}"
        )
        nan, inf = stats.get("nan") or 0, stats.get("inf") or 0
        if nan or inf:
            lines.append(f"{pad}[b $text-error]NaN {nan}  Inf {inf}[/]")
        bar = range_bar(stats, 28)
        if bar:
            lines.append(f"{pad}[dim]min[/] {bar} [dim]max   (mean±std)[/]")
        values = s.get("values")
        if isinstance(values, list) and values:
            shown = ", ".join(fnum(v) for v in values[:_MAX_VALUES])
            more = " …" if len(values) > _MAX_VALUES else ""
            lines.append(f"{pad}values \\[{_e(shown)}{more}]")
            if len(values) > 1:
                lines.append(f"{pad}[$accent]{sparkline(values)}[/]")
        return lines

    def _tensors(self, title: str, sums: Any, notes: list[str] | None = None) -> list[str]:
        if not isinstance(sums, list) or not sums:
            return [f"[b]{title}[/] [dim](none)[/]"]
        lines = [f"[b]{title}[/]"]
        for i, s in enumerate(sums[:_MAX_TENSORS]):
            note = notes[i] if notes and i < len(notes) else ""
            lines.extend(self._summary(f"\\[{i}]", s, note))
        if len(sums) > _MAX_TENSORS:
            lines.append(f"  [dim]… {len(sums) - _MAX_TENSORS} more[/]")
        return lines

    def _op(self, store: EventStore, data: StepData | None, row: Row, ev: Event) -> str:
        lines = [f"[b $accent]{_e(ev.get('name', '?'))}[/]"]
        meta = [f"op #{row.seq}", f"step {row.step}"]
        if ev.get("module"):
            meta.append(f"module [b]{_e(ev['module'])}[/]")
        if isinstance(ev.get("duration_us"), (int, float)):
            meta.append(f"{ev['duration_us']:.0f} µs")
        if ev.get("thread"):
            meta.append(_e(ev["thread"]))
        lines.append(" · ".join(meta))
        if data is not None:
            node_ids = data.nodes_of_op(row.seq)
            if node_ids:
                lines.append("[b]creates[/] " + self._nodes_line(store, data, node_ids))
            elif ev.get("grad_fn") is None:
                lines.append("[dim]creates no autograd node[/]")
        lines.append("")
        lines.extend(self._source(ev.get("source"), ev.get("function")))
        lines.append("")
        lines.extend(self._tensors("inputs", ev.get("inputs")))
        lines.extend(self._tensors("outputs", ev.get("outputs")))
        return "\n".join(lines)

    def _nodes_line(self, store: EventStore, data: StepData, node_ids: list[int]) -> str:
        parts = []
        for nid in node_ids[:12]:
            grads = data.grads_of_node(nid)
            gnode = data.graph_nodes.get(nid)
            name = grads[0].name if grads else (gnode or {}).get("name", "?")
            if grads:
                go = store.event(grads[0]).get("grad_outputs") or []
                stat = compact_stat(go[0]) if go and isinstance(go[0], dict) else ""
                parts.append(f"{_e(name)} #{nid} [dim]∇ {_e(stat)}[/]")
            elif gnode is not None:
                parts.append(f"{_e(name)} #{nid} [dim](not executed)[/]")
            else:
                parts.append(f"{_e(name)} #{nid} [dim](no backward yet)[/]")
        if len(node_ids) > 12:
            parts.append(f"[dim]… {len(node_ids) - 12} more[/]")
        return ", ".join(parts) + "  [dim](enter: jump)[/]"

    def _next_notes(self, data: StepData | None, node_id: Any, n: int) -> list[str]:
        """For grad_inputs[i]: the node it is sent to (next_functions[i])."""
        if data is None or not isinstance(node_id, int):
            return []
        gnode = data.graph_nodes.get(node_id)
        if gnode is None:
            return []
        notes = []
        for edge in (gnode.get("next") or [])[:n]:
            target = edge[0] if isinstance(edge, list) and edge else None
            tnode = data.graph_nodes.get(target) if isinstance(target, int) else None
            if tnode is None:
                notes.append("→ (no node)")
                continue
            label = tnode.get("param") or tnode.get("name", "?")
            notes.append(f"→ {label} #{target}")
        return notes

    def _grad(self, store: EventStore, data: StepData | None, row: Row, ev: Event) -> str:
        lines = [f"[b $accent]{_e(ev.get('node', '?'))}[/] #{_e(ev.get('node_id'))}"]
        meta = [f"grad #{row.seq}", f"step {row.step}"]
        if ev.get("backward") is not None:
            meta.append(f"backward call {_e(ev['backward'])}")
        lines.append(" · ".join(meta))
        if ev.get("param"):
            lines.append(f"[b]parameter[/] {_e(ev['param'])}")
        op = data.op(row.op_seq) if data is not None else None
        if op is not None:
            where = f" in {_e(op.module)}" if op.module else ""
            lines.append(
                f"[b]created by[/] {_e(short_name(op.name))} (op #{op.seq}){where}  "
                "[dim](enter: jump)[/]"
            )
        elif row.op_seq is not None:
            lines.append(f"[b]created by[/] op #{row.op_seq}")
        lines.append("")
        lines.extend(self._source(ev.get("source")))
        lines.append("")
        lines.extend(self._tensors("grad_outputs — what arrived", ev.get("grad_outputs")))
        gi = ev.get("grad_inputs")
        notes = self._next_notes(data, ev.get("node_id"), len(gi) if isinstance(gi, list) else 0)
        lines.extend(self._tensors("grad_inputs — what it sends on", gi, notes))
        return "\n".join(lines)

    def _node(self, store: EventStore, data: StepData, node: dict, call: Event | None) -> str:
        nid = node.get("id")
        name = node.get("name", "?")
        lines = [f"[b $accent]{_e(name)}[/] #{_e(nid)}"]
        if node.get("executed"):
            lines.append("[dim]executed; its gradient event is not in this step[/]")
        else:
            lines.append("[b $text-warning]not executed[/] in this backward call")
            lines.append(
                "[dim]autograd.grad runs only the branches leading to the inputs it was asked "
                "for, and never AccumulateGrad: no hook fired here. That is not missing data.[/]"
            )
        if node.get("param"):
            lines.append(f"[b]parameter[/] {_e(node['param'])}")
        op = data.op(node.get("op_seq")) if isinstance(node.get("op_seq"), int) else None
        if op is not None:
            lines.append(f"[b]created by[/] {_e(short_name(op.name))} (op #{op.seq})")
        if call is not None:
            lines.append(
                f"[dim]call: {_e(call.get('call', '?'))} (backward {call.get('backward')})[/]"
            )
        lines.append("")
        lines.extend(self._source(node.get("source")))
        return "\n".join(lines)
