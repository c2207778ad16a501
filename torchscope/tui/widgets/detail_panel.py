"""Everything about one event: both sides of an op or a backward node, in full.

For an op: its inputs and outputs, and the autograd nodes it created. For a backward node:
``grad_outputs`` (the gradient that arrived) and ``grad_inputs`` (what it sends to each input,
with ``None`` shown explicitly, and where each goes). Each tensor gets its full summary (shape,
dtype, device, min/max/mean/std/norm, NaN/Inf), a bar of where mean±std lies in [min, max],
its values when small, and a sparkline of them. Then the source line with three lines of
context, read from the file when it is on this machine.

The event a live job is paused at gets more: what the pause is (before or after it ran, and
why), the training thread's call stack (innermost first, with each line's text when the file
is here), and a values section: a slice of one tensor fetched from the job on demand
(``v``), paged with ``<`` / ``>``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.widgets import Static

from torchscope.protocol.events import OP, Event
from torchscope.tui.format import (
    compact_stat,
    fnum,
    range_bar,
    resolve_source,
    shape_text,
    short_name,
    short_source,
    source_context,
    sparkline,
)
from torchscope.tui.stepping import ValuesView, pause_key
from torchscope.tui.store import EventStore, PendingRow, Row, StepData

_MAX_VALUES = 16
_MAX_TENSORS = 64


def _e(value: Any) -> str:
    return escape(str(value))


class DetailPanel(VerticalScroll, can_focus=True):
    """Scrollable detail of the event under the cursor."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k", "scroll_up", "Up", show=False),
        Binding("j", "scroll_down", "Down", show=False),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.body = Static("", id="detail-body", markup=True)
        self.stack_box = Static("", id="detail-stack", markup=True)
        self.values_box = Static("", id="detail-values", markup=True)
        self.cwd: str | None = None
        self.subject: tuple | None = None
        self.values_version: int | None = None

    def compose(self):  # type: ignore[override]
        yield self.body
        yield self.stack_box
        yield self.values_box

    def on_mount(self) -> None:
        self.stack_box.display = False
        self.values_box.display = False

    # -- entry points ------------------------------------------------------------------------
    def show_message(self, text: str) -> None:
        self.subject = ("message", text)
        self._set(f"[dim]{_e(text)}[/]")

    def show_row(
        self,
        store: EventStore,
        data: StepData | None,
        row: Row | PendingRow,
        pause: dict | None = None,
        values: ValuesView | None = None,
    ) -> None:
        """An op or node; with ``pause``, it is where the job is paused (``values``: what
        was fetched of its tensors)."""
        subject = ("row", row.seq, row.kind, id(data), id(row) if row.pending else None)
        if pause is not None:
            subject += (pause_key(pause),)
        if subject == self.subject:
            if pause is not None and values is not None and values.version != self.values_version:
                self._show_values(values, scroll=True)
            return
        self.subject = subject
        ev = row.event if row.pending else store.event(row)
        text = self._op(store, data, ev) if row.kind == OP else self._grad(store, data, row, ev)
        if pause is not None:
            text = self._pause_head(pause, ev) + "\n\n" + text
        self._set(text)
        if pause is not None:
            self.stack_box.update(self._stack(pause.get("stack")))
            self.stack_box.display = True
            self._show_values(values, scroll=False)

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

    def show_alert(self, alert: Event, knock_on: list[Event] | None = None) -> None:
        self.subject = ("alert", alert.get("seq"))
        lines = [
            f"[b $text-error]⚠ {_e(alert.get('message', 'alert'))}[/]",
            f"step {_e(alert.get('step'))} · {_e(alert.get('where', ''))} · "
            f"event #{_e(alert.get('event_seq'))}",
            "[dim]enter jumps to the event[/]",
        ]
        if knock_on:
            lines.append("")
            lines.append(
                f"[b]{len(knock_on)} knock-on alert{'s' * (len(knock_on) != 1)}[/] "
                "[dim](NaN/Inf coming in from it, not new causes)[/]"
            )
            counts: dict[tuple, int] = {}
            for a in knock_on:
                label = str(a.get("name", "?"))
                if label.startswith("parameter "):
                    label = "parameters"
                elif label.startswith("input "):
                    label = "input of " + label.split(" of ", 1)[-1].split(" (")[0]
                key = (a.get("step"), label)
                counts[key] = counts.get(key, 0) + 1
            for (step, label), n in list(counts.items())[:12]:
                lines.append(f"  step {_e(step)} · {n}x {_e(label)}")
            if len(counts) > 12:
                lines.append(f"  [dim]… {len(counts) - 12} more[/]")
        self._set("\n".join(lines))

    def _set(self, markup: str) -> None:
        self.body.update(markup)
        self.stack_box.display = False
        self.values_box.display = False
        self.values_version = None
        self.scroll_home(animate=False, immediate=True)

    # -- a pause -----------------------------------------------------------------------------
    def _pause_head(self, pause: dict, ev: dict) -> str:
        what = "op" if ev.get("kind") == OP else "node"
        if pause.get("phase") == "before":
            where = f"[b]before[/] this {what} runs"
        else:
            where = f"[b]after[/] this {what} ran"
        reason = pause.get("reason") or "paused"
        return (
            f"[b $text-warning]⏸ PAUSED[/] {where} · {_e(reason)}\n"
            "[dim]s step · n next step · c continue · v values · b break here[/]"
        )

    def _stack(self, stack: Any) -> str:
        lines = ["[b]call stack[/] [dim]training thread, innermost first[/]"]
        frames = [f for f in stack or () if isinstance(f, (list, tuple)) and len(f) >= 3]
        if not frames:
            lines.append("  [dim](not known)[/]")
        for i, (file, line, func) in enumerate(frames):
            where = f"{file}:{line}"
            mark = "[b $accent]▶[/]" if i == 0 else " "
            lines.append(
                f" {mark} [$accent]{_e(short_source(where, self.cwd))}[/] in [i]{_e(func)}[/]"
            )
            text = _line_text(where, self.cwd)
            if text:
                lines.append(f"      {_e(text)}")
        return "\n".join(lines)

    def _show_values(self, values: ValuesView | None, *, scroll: bool) -> None:
        self.values_box.update(self._values(values))
        self.values_box.display = True
        self.values_version = values.version if values is not None else None
        if scroll and values is not None and values.choice is not None:
            self.call_after_refresh(self._scroll_to_values)

    def _scroll_to_values(self) -> None:
        self.scroll_to_widget(self.values_box, animate=False, top=True, immediate=True)

    def _values(self, values: ValuesView | None) -> str:
        head = "[b]values[/]"
        if values is None or not values.choices:
            return f"{head} [dim](no tensor is held at this point)[/]"
        choice = values.choice
        if choice is None:
            tensors = " · ".join(
                f"{group}[{i}] {shape_text(s)}" for group, i, s in values.choices[:8]
            )
            more = f" … {len(values.choices) - 8} more" if len(values.choices) > 8 else ""
            return (
                f"{head} [dim]fetched on demand:[/] [@click=screen.values]v: fetch[/]\n"
                f"  [dim]{_e(tensors)}{more}[/]"
            )
        group, index, summary = choice
        numel = values.numel
        size = f"{numel:,} values" if numel is not None else "? values"
        lines = [
            f"{head} [b $accent]{group}\\[{index}][/] {_e(shape_text(summary))} "
            f"{_e(summary.get('dtype', '?'))} · {size}  [dim]v: next tensor[/]"
        ]
        if values.error:
            lines.append(f"  [b $text-error]{_e(values.error)}[/]")
            return "\n".join(lines)
        result = values.result
        if values.loading or result is None:
            lines.append("  [dim]fetching…[/]")
            return "\n".join(lines)
        vals = result.get("values")
        if vals is None:
            lines.append("  [b]None[/] [dim](no tensor here)[/]")
            return "\n".join(lines)
        start = result.get("start") if type(result.get("start")) is int else values.start
        end = start + len(vals)
        prev = "[@click=screen.prev_slice]◀ prev[/]" if start > 0 else "[dim]◀ prev[/]"
        more = numel is not None and end < numel
        nxt = "[@click=screen.next_slice]next ▶[/]" if more else "[dim]next ▶[/]"
        total = f"{numel:,}" if numel is not None else "?"
        lines.append(f"  \\[{start:,}:{end:,}] of {total}  {prev}  {nxt}  [dim](< >)[/]")
        if len(vals) > 1:
            width = max(8, min(40, self._text_width() - 4))
            lines.append(f"  [$accent]{sparkline(vals, width)}[/]")
        lines.extend(_value_grid(vals, start, self._text_width()))
        return "\n".join(lines)

    def _text_width(self) -> int:
        width = self.scrollable_content_region.width
        return width if width > 0 else 40

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
        if isinstance(s.get("param"), str):
            head += f" [b]{_e(s['param'])}[/]"
        if note:
            head += f" [dim]{_e(note)}[/]"
        lines = [head]
        stats = s.get("stats")
        if not isinstance(stats, dict) or not stats:
            if s.get("external"):
                # The tracer reduces data and weights only when the op's output goes bad.
                why = "from outside: stats only on a bad output"
            else:
                why = "metadata only: no values summarised"
            lines.append(f"{pad}[dim]({why})[/]")
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

    def _op(self, store: EventStore, data: StepData | None, ev: Event) -> str:
        lines = [f"[b $accent]{_e(ev.get('name', '?'))}[/]"]
        seq = ev.get("seq")
        meta = [f"op #{seq}" if seq is not None else "op (not run yet)", f"step {ev.get('step')}"]
        if ev.get("module"):
            meta.append(f"module [b]{_e(ev['module'])}[/]")
        if isinstance(ev.get("duration_us"), (int, float)):
            meta.append(f"{ev['duration_us']:.0f} µs")
        if ev.get("thread"):
            meta.append(_e(ev["thread"]))
        lines.append(" · ".join(meta))
        if data is not None and type(seq) is int:
            node_ids = data.nodes_of_op(seq)
            if node_ids:
                named = {
                    n["id"]: n.get("name")
                    for n in ev.get("nodes") or ()
                    if isinstance(n, dict) and "id" in n
                }
                lines.append("[b]creates[/] " + self._nodes_line(store, data, node_ids, named))
            elif ev.get("grad_fn") is None:
                lines.append("[dim]creates no autograd node[/]")
        lines.append("")
        lines.extend(self._source(ev.get("source"), ev.get("function")))
        lines.append("")
        lines.extend(self._tensors("inputs", ev.get("inputs")))
        if seq is None and ev.get("outputs") is None:
            lines.append("[b]outputs[/] [dim]not computed yet: paused before the op runs[/]")
        else:
            lines.extend(self._tensors("outputs", ev.get("outputs")))
        return "\n".join(lines)

    def _nodes_line(
        self,
        store: EventStore,
        data: StepData,
        node_ids: list[int],
        named: dict[int, Any] | None = None,
    ) -> str:
        """The op's backward nodes, by name and node id (node ids are not event seqs)."""
        parts = []
        for nid in node_ids[:12]:
            grads = data.grads_of_node(nid)
            gnode = data.graph_nodes.get(nid)
            name = (
                grads[0].name
                if grads
                else (gnode or {}).get("name") or (named or {}).get(nid) or "node"
            )
            if grads:
                go = store.event(grads[0]).get("grad_outputs") or []
                stat = compact_stat(go[0]) if go and isinstance(go[0], dict) else ""
                parts.append(f"{_e(name)} node id {nid} [dim]∇ {_e(stat)}[/]")
            elif gnode is not None:
                parts.append(f"{_e(name)} node id {nid} [dim](not executed)[/]")
            else:
                parts.append(f"{_e(name)} node id {nid} [dim](backward not run yet)[/]")
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

    def _grad(
        self, store: EventStore, data: StepData | None, row: Row | PendingRow, ev: Event
    ) -> str:
        lines = [f"[b $accent]{_e(ev.get('node', '?'))}[/] #{_e(ev.get('node_id'))}"]
        seq = ev.get("seq")
        meta = [
            f"grad #{seq}" if seq is not None else "node (not run yet)",
            f"step {ev.get('step')}",
        ]
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
        if seq is None and gi is None:
            lines.append(
                "[b]grad_inputs — what it sends on[/] "
                "[dim]not computed yet: paused before the node runs[/]"
            )
            return "\n".join(lines)
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


def _line_text(source: str, cwd: str | None) -> str | None:
    """The text of ``path:line`` when the file is on this machine."""
    found = resolve_source(source, cwd)
    if found is None:
        return None
    import linecache

    text = linecache.getline(found[0], found[1])
    return text.strip() or None


def _value_grid(values: list, start: int, width: int) -> list[str]:
    """Values in rows, each led by the flat index of its first value."""
    cell = 11
    index_width = len(str(start + max(0, len(values) - 1)))
    per_line = max(1, (width - index_width - 2) // cell)
    lines = []
    for i in range(0, len(values), per_line):
        cells = []
        for v in values[i : i + per_line]:
            text = fnum(v).rjust(cell - 1)
            bad = text.strip() in ("nan", "inf", "-inf")
            cells.append(f"[b $text-error]{text}[/]" if bad else text)
        lines.append(f"[dim]{str(start + i).rjust(index_width)}[/] " + " ".join(cells))
    return lines
