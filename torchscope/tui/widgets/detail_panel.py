"""Everything about one event: both sides of an op or a backward node, in full.

For an op: its inputs and outputs, and the autograd nodes it created. For a backward node:
``grad_outputs`` (the gradient that arrived) and ``grad_inputs`` (what it sends to each input,
with ``None`` shown explicitly, and where each goes). Each tensor gets its full summary (shape,
dtype, device, min/max/mean/std/norm, NaN/Inf), a bar of where mean±std lies in [min, max],
its values when small, and a sparkline of them. Then the source line with three lines of
context, read from the file when it is on this machine.

At the aten level, an aten call gets the same (its inputs and outputs) under the op or node
it ran in (a link back to it), and a node lists its calls, each with a compact stat.

The event a live job is paused at gets more: what the pause is (before or after it ran, and
why), the training thread's call stack (innermost first, with each line's text when the file
is here), and a values section: a slice of one tensor fetched from the job on demand
(``v``), paged with ``<`` / ``>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.widgets import Static

from torchscope.protocol.events import ATEN, OP, Event
from torchscope.tui.format import (
    compact_stat,
    first_bad,
    fnum,
    index_text,
    is_bad,
    range_bar,
    resolve_source,
    shape_text,
    short_name,
    short_source,
    source_context,
    sparkline,
    value_rows,
)
from torchscope.tui.stepping import ValuesView, pause_key
from torchscope.tui.store import (
    FLAG_ACCUMULATE,
    FLAGS,
    NAME,
    SEQ,
    AtenRow,
    EventStore,
    PendingRow,
    Row,
    StepData,
)

_MAX_VALUES = 64  # small values shown in rows; more: the first ones and "…"
_MAX_TENSORS = 64
_MAX_LINKS = 24  # node links listed for one op
_LINK = "\x00"  # a line that starts with it is link number N: "\x00N\x00text"


def _e(value: Any) -> str:
    return escape(str(value))


@dataclass(frozen=True)
class Link:
    """Somewhere the detail can take you: ``kind`` "op" (an op's event seq), "node" (a
    backward node id), "event" (any event seq, in ``step``)."""

    kind: str
    target: int
    step: int | None = None


class DetailPanel(VerticalScroll, can_focus=True):
    """Scrollable detail of the event under the cursor.

    Its links (the nodes an op created, the op that created a node, an alert's event) are a
    list: with the panel focused, ``up``/``down`` move between them and ``enter`` follows one
    (a click does too); ``j``/``k`` and the page keys scroll."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k", "scroll_up", "Up", show=False),
        Binding("j", "scroll_down", "Down", show=False),
        Binding("up", "link(-1)", "Previous link", show=False),
        Binding("down", "link(1)", "Next link", show=False),
        Binding("enter", "follow_link", "Follow link", show=False),
    ]

    class Follow(Message):
        """``enter`` (or a click) on a link."""

        def __init__(self, link: Link) -> None:
            super().__init__()
            self.link = link

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.body = Static("", id="detail-body", markup=True)
        self.stack_box = Static("", id="detail-stack", markup=True)
        self.values_box = Static("", id="detail-values", markup=True)
        self.cwd: str | None = None
        self.subject: tuple | None = None
        self.values_version: int | None = None
        self.links: list[Link] = []
        self.link_cursor = 0
        self.event: dict | None = None  # the event shown (op or grad), if any
        self._template = ""
        self._new_links: list[Link] = []

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
        self.event = None
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
        self.event = ev
        if row.kind == OP:
            text = self._op(store, data, ev)
        elif row.kind == ATEN:
            text = self._aten(store, data, row, ev)
        else:
            text = self._grad(store, data, row, ev)
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
        self.event = None
        self._set(self._node(store, data, node, call))

    def show_alert(self, alert: Event, knock_on: list[Event] | None = None) -> None:
        self.subject = ("alert", alert.get("seq"))
        self.event = None
        step, seq = alert.get("step"), alert.get("event_seq")
        lines = [
            f"[b $text-error]⚠ {_e(alert.get('message', 'alert'))}[/]",
            f"step {_e(step)} · {_e(alert.get('where', ''))}",
        ]
        if type(seq) is int:
            target = Link("event", seq, step if type(step) is int else None)
            lines.append(self._link(target, f"the event: #{seq} [dim](event seq)[/]"))
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
        self._template = markup
        self.links, self._new_links = self._new_links, []
        self.link_cursor = 0
        self._render_body()
        self.stack_box.display = False
        self.values_box.display = False
        self.values_version = None
        self.scroll_home(animate=False, immediate=True)

    # -- links -------------------------------------------------------------------------------
    def _link(self, link: Link, text: str) -> str:
        """A line that is a link (``text`` is markup)."""
        self._new_links.append(link)
        return f"{_LINK}{len(self._new_links) - 1}{_LINK}{text}"

    def _render_body(self) -> None:
        if not self.links:
            self.body.update(self._template)
            return
        focused = self.has_focus
        out = []
        for line in self._template.split("\n"):
            if not line.startswith(_LINK):
                out.append(line)
                continue
            number, _, text = line[1:].partition(_LINK)
            i = int(number)
            if i == self.link_cursor and focused:
                mark = "[b reverse $accent]▶[/] "
            elif i == self.link_cursor:
                mark = "[$accent]▶[/] "
            else:
                mark = "  "
            out.append(f"{mark}[@click=screen.detail_link({i})]{text}[/]")
        self.body.update("\n".join(out))

    def link_line(self, i: int) -> int | None:
        """The line of the body where link ``i`` is (before wrapping)."""
        tag = f"{_LINK}{i}{_LINK}"
        for n, line in enumerate(self._template.split("\n")):
            if line.startswith(tag):
                return n
        return None

    def link_texts(self) -> list[str]:
        """The links' text, plain (tests)."""
        from textual.content import Content

        out = []
        for line in self._template.split("\n"):
            if line.startswith(_LINK):
                out.append(Content.from_markup(line[1:].partition(_LINK)[2]).plain)
        return out

    def on_focus(self) -> None:
        self._render_body()

    def on_blur(self) -> None:
        self._render_body()

    def action_link(self, delta: int) -> None:
        """Move between links; past the first or the last one (or with none): scroll."""
        n = len(self.links)
        target = self.link_cursor + delta
        if not n or not 0 <= target < n:
            if delta < 0:
                self.scroll_up(animate=False)
            else:
                self.scroll_down(animate=False)
            return
        self.link_cursor = target
        self._render_body()
        line = self.link_line(target)
        if line is not None:
            top, height = round(self.scroll_y), max(1, self.scrollable_content_region.height)
            if not top <= line < top + height:
                self.scroll_to(y=max(0, line - height // 3), animate=False)

    def action_follow_link(self) -> None:
        if 0 <= self.link_cursor < len(self.links):
            self.post_message(self.Follow(self.links[self.link_cursor]))

    def follow(self, i: int) -> None:
        """Link ``i`` (a click)."""
        if 0 <= i < len(self.links):
            self.link_cursor = i
            self._render_body()
            self.post_message(self.Follow(self.links[i]))

    # -- a pause -----------------------------------------------------------------------------
    def _pause_head(self, pause: dict, ev: dict) -> str:
        what = {OP: "op", ATEN: "aten call"}.get(ev.get("kind"), "node")
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
        stats = summary.get("stats") if isinstance(summary.get("stats"), dict) else {}
        bad_known = bool(stats.get("nan") or stats.get("inf"))
        jump = "  [@click=screen.first_nan]! first NaN/Inf[/]" if bad_known else ""
        lines.append(f"  \\[{start:,}:{end:,}] of {total}  {prev}  {nxt}  [dim](< >)[/]{jump}")
        if len(vals) > 1:
            width = max(8, min(40, self._text_width() - 4))
            lines.append(f"  [$accent]{sparkline(vals, width)}[/]")
        shape = result.get("shape") if isinstance(result.get("shape"), list) else None
        shape = shape or (summary.get("shape") if isinstance(summary.get("shape"), list) else None)
        bad = first_bad(vals)
        mark = values.mark
        if mark is None and bad is not None:
            mark = start + bad
        lines.extend(_value_grid(vals, start, self._text_width(), shape, mark))
        if values.note:
            lines.append(f"  [b $text-warning]{_e(values.note)}[/]")
        elif bad is not None:
            at = index_text(start + bad, shape)
            lines.append(
                f"  [b $text-error]first NaN/Inf of this slice: {at}[/]"
                f" [dim](flat {start + bad:,})[/]"
            )
        return "\n".join(lines)

    def _text_width(self) -> int:
        width = self.body.content_region.width or self.scrollable_content_region.width
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
            elif s.get("stats_of") == "batched":
                why = "one of a batch of gradients (is_grads_batched): numbers not read"
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
        # one line, however narrow the panel: "min ├──═┼═──┤ max   (mean±std)", the legend
        # going first (2 columns spare: a scrollbar may come once the text is in)
        room = self._text_width() - 2 - len(pad) - len("min  max")
        legend = "   (mean±std)" if room - 13 >= 20 else ""
        bar = range_bar(stats, max(8, min(28, room - len(legend))))
        if bar:
            lines.append(f"{pad}[dim]min[/] {bar} [dim]max{legend}[/]")
        values = s.get("values")
        if isinstance(values, list) and values:
            shape = s.get("shape") if isinstance(s.get("shape"), list) else None
            shown = values[:_MAX_VALUES]
            width = max(24, self._text_width() - len(pad))
            flat = ", ".join(fnum(v) for v in shown)
            one_row = len(value_rows(shown, shape, 0, per_line=len(shown) or 1)) <= 1
            if one_row and len(flat) + 9 <= width:
                lines.append(f"{pad}values \\[{_e(flat)}]")
                if len(values) > 1:
                    lines.append(f"{pad}[$accent]{sparkline(values)}[/]")
            else:  # by row: "values [0,:] 1 2 3" then the next rows under it
                grid = _value_grid(shown, 0, width - 7, shape)
                lines.append(f"{pad}values {grid[0]}")
                lines.extend(f"{pad}       {g}" for g in grid[1:])
            if len(values) > _MAX_VALUES:
                lines.append(f"{pad}[dim]… {len(values) - _MAX_VALUES:,} more[/]")
            bad = first_bad(values)
            if bad is not None:
                lines.append(
                    f"{pad}[b $text-error]first NaN/Inf at {index_text(bad, shape)}[/]"
                    f" [dim](flat {bad})[/]"
                )
        return lines

    def _tensors(
        self,
        title: str,
        sums: Any,
        notes: list[str] | None = None,
        links: list[Link | None] | None = None,
    ) -> list[str]:
        if not isinstance(sums, list) or not sums:
            return [f"[b]{title}[/] [dim](none)[/]"]
        lines = [f"[b]{title}[/]"]
        for i, s in enumerate(sums[:_MAX_TENSORS]):
            note = notes[i] if notes and i < len(notes) else ""
            part = self._summary(f"\\[{i}]", s, note)
            link = links[i] if links and i < len(links) else None
            if link is not None and part:
                part[0] = self._link(link, part[0].lstrip())
            lines.extend(part)
        if len(sums) > _MAX_TENSORS:
            lines.append(f"  [dim]… {len(sums) - _MAX_TENSORS} more[/]")
        return lines

    def _op(self, store: EventStore, data: StepData | None, ev: Event) -> str:
        lines = [f"[b $accent]{_e(ev.get('name', '?'))}[/]"]
        seq = ev.get("seq")
        step = ev.get("step")
        what = f"op · event #{seq}" if seq is not None else "op (not run yet)"
        lines.append(_meta_line(what, step, ev.get("module"), ev))
        if data is not None and type(seq) is int:
            node_ids = data.nodes_of_op(seq)
            if node_ids:
                named = {
                    n["id"]: n.get("name")
                    for n in ev.get("nodes") or ()
                    if isinstance(n, dict) and "id" in n
                }
                lines.extend(self._nodes_lines(store, data, node_ids, named))
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
        if data is not None and type(seq) is int and data.aten:
            op = data.op_by_seq.get(seq)
            if op is not None:
                lines.extend(self._calls_lines(store, data, op))
        return "\n".join(lines)

    def _nodes_lines(
        self,
        store: EventStore,
        data: StepData,
        node_ids: tuple[int, ...] | list[int],
        named: dict[int, Any] | None = None,
    ) -> list[str]:
        """The op's backward nodes, one link each, by name and node id (node ids are not
        event seqs)."""
        n = len(node_ids)
        lines = []
        if n > 1:
            lines.append(f"[b]creates[/] {n} backward nodes  [dim](tab, ↑↓, enter: go)[/]")
        for nid in node_ids[:_MAX_LINKS]:
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
                text = f"{_e(name)} node id {nid} [dim]∇ {_e(stat)}[/]"
            elif gnode is not None:
                text = f"{_e(name)} node id {nid} [dim](not executed)[/]"
            else:
                text = f"{_e(name)} node id {nid} [dim](backward not run yet)[/]"
            if n == 1:
                text = f"[b]creates[/] {text}"
            lines.append(self._link(Link("node", nid, data.step), text))
        if n > _MAX_LINKS:
            lines.append(f"  [dim]… {n - _MAX_LINKS} more (g: the graph)[/]")
        return lines

    def _next_targets(self, data: StepData | None, node_id: Any, n: int) -> list[int | None]:
        """For grad_inputs[i]: the id of the node it is sent to (next_functions[i])."""
        if data is None or not isinstance(node_id, int):
            return []
        gnode = data.graph_nodes.get(node_id)
        if gnode is None:
            return []
        out: list[int | None] = []
        for edge in (gnode.get("next") or [])[:n]:
            target = edge[0] if isinstance(edge, list) and edge else None
            out.append(target if isinstance(target, int) and target in data.graph_nodes else None)
        return out

    def _grad(
        self, store: EventStore, data: StepData | None, row: Row | PendingRow, ev: Event
    ) -> str:
        nid = ev.get("node_id")
        lines = [f"[b $accent]{_e(ev.get('node', '?'))}[/]"]
        seq = ev.get("seq")
        meta = [
            f"backward node id {_e(nid)}",
            f"event #{seq}" if seq is not None else "not run yet",
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
            text = f"[b]created by[/] {_e(short_name(op.name))} (op, event #{op.seq}){where}"
            lines.append(self._link(Link("op", op.seq, data.step if data else None), text))
        elif row.op_seq is not None:
            lines.append(f"[b]created by[/] op event #{row.op_seq} [dim](not in this step)[/]")
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
        n = len(gi) if isinstance(gi, list) else 0
        targets = self._next_targets(data, nid, n)
        notes: list[str] = []
        links: list[Link | None] = []
        for target in targets:
            tnode = None
            if data is not None and target is not None:
                tnode = data.graph_nodes.get(target)
            if tnode is None:
                notes.append("→ (no node)")
                links.append(None)
                continue
            label = tnode.get("param") or tnode.get("name", "?")
            notes.append(f"→ {label} node id {target}")
            links.append(Link("node", target, data.step if data else None))
        lines.extend(self._tensors("grad_inputs — what it sends on", gi, notes, links))
        if data is not None and not row.pending:
            lines.extend(self._calls_lines(store, data, row))
        return "\n".join(lines)

    def _calls_lines(self, store: EventStore, data: StepData, row: Row | tuple) -> list[str]:
        """An op's or node's aten calls (the aten level), one line each: name, output stat."""
        calls = data.aten_of(row)
        if not calls:
            return []
        n = len(calls)
        lines = ["", f"[b]aten calls[/] {n}  [dim](→ in the timeline: unfold)[/]"]
        for t in calls[:_MAX_LINKS]:
            outs = store.event(t).get("outputs") or []
            stat = compact_stat(outs[0]) if outs and isinstance(outs[0], dict) else "-"
            mark = "Σ " if t[FLAGS] & FLAG_ACCUMULATE else ""
            lines.append(f"  {mark}{_e(t[NAME])} #{t[SEQ]} [dim]{_e(stat)}[/]")
        if n > _MAX_LINKS:
            lines.append(f"  [dim]… {n - _MAX_LINKS} more[/]")
        return lines

    def _aten(
        self, store: EventStore, data: StepData | None, row: Row | PendingRow, ev: Event
    ) -> str:
        """One aten call: what ran it (op or node, a link), then like an op."""
        lines = [f"[b $accent]{_e(ev.get('name', '?'))}[/]"]
        seq = ev.get("seq")
        module = row.module if isinstance(row, Row) else ev.get("module")
        what = f"aten call · event #{seq}" if seq is not None else "aten call (not run yet)"
        lines.append(_meta_line(what, ev.get("step"), module, ev))
        step = data.step if data is not None else None
        parent = row.parent if isinstance(row, AtenRow) else None
        op_seq, nid = ev.get("op_seq"), ev.get("node_id")
        if type(op_seq) is int:
            name = short_name(parent.name) if parent is not None else f"op event #{op_seq}"
            text = f"[b]in[/] {_e(name)} (op, event #{op_seq})"
            lines.append(self._link(Link("op", op_seq, step), text))
        elif type(nid) is int:
            name = ev.get("node") or (parent.name if parent is not None else "node")
            if ev.get("accumulate"):
                text = (
                    f"[b]sum after[/] {_e(name)} node id {nid} "
                    "[dim](the engine adding up a tensor's incoming gradients)[/]"
                )
            else:
                text = f"[b]in[/] {_e(name)} node id {nid} (backward)"
            lines.append(self._link(Link("node", nid, step), text))
        elif ev.get("node"):  # paused before a node's kernel: the pause names the node only
            lines.append(f"[b]in[/] {_e(ev['node'])} (backward)")
        else:  # paused at a forward call: its op's event comes once the op returns
            lines.append("[b]in[/] the op running now [dim](its row comes once it returns)[/]")
        lines.append("")
        lines.extend(self._source(ev.get("source"), ev.get("function")))
        lines.append("")
        lines.extend(self._tensors("inputs", ev.get("inputs")))
        if seq is None and ev.get("outputs") is None:
            lines.append("[b]outputs[/] [dim]not computed yet: paused before the call runs[/]")
        else:
            lines.extend(self._tensors("outputs", ev.get("outputs")))
        return "\n".join(lines)

    def _node(self, store: EventStore, data: StepData, node: dict, call: Event | None) -> str:
        nid = node.get("id")
        name = node.get("name", "?")
        lines = [f"[b $accent]{_e(name)}[/]", f"backward node id {_e(nid)} · step {data.step}"]
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
            text = f"[b]created by[/] {_e(short_name(op.name))} (op, event #{op.seq})"
            lines.append(self._link(Link("op", op.seq, data.step), text))
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


def _value_grid(
    values: list,
    start: int,
    width: int,
    shape: list[int] | None = None,
    mark: int | None = None,
) -> list[str]:
    """Values as the rows of their tensor's last dimension (the last two dims of an N-D one,
    each row led by its index: ``[1,:]``), NaN/Inf in red, the value at flat index ``mark``
    highlighted. A row wider than the panel wraps (``[1,8:]``)."""
    texts = [fnum(v) for v in values]
    cell = min(11, max((len(t) for t in texts), default=1) + 2)  # sized from the content
    rows = value_rows(values, shape, start, per_line=1_000_000)
    label_width = max((len(label) for label, _, _ in rows), default=3)
    per_line = max(1, (width - label_width - 2) // cell)
    rows = value_rows(values, shape, start, per_line=per_line)
    label_width = max((len(label) for label, _, _ in rows), default=3)
    lines = []
    for label, flat, part in rows:
        if label.endswith(":]") and not label.endswith(",:]") and label != "[:]":
            # a row that goes on: only its column ("8:"), the row's index is on the line above
            label = label.rpartition(",")[2][:-1] if "," in label else label[1:-1]
        cells = []
        for j, v in enumerate(part):
            text = fnum(v).rjust(cell - 1)
            if flat + j == mark:
                cells.append(f"[b reverse $text-error]{text}[/]")
            elif is_bad(v):
                cells.append(f"[b $text-error]{text}[/]")
            else:
                cells.append(text)
        lines.append(f"[dim]{_e(label).rjust(label_width)}[/] " + " ".join(cells))
    return lines


def _meta_line(what: str, step: Any, module: str | None, ev: Event) -> str:
    """``op · event #8 · step 0 · module [b]blocks.0[/] · 12 µs · MainThread``."""
    meta = [what, f"step {step}"]
    if module:
        meta.append(f"module [b]{_e(module)}[/]")
    if isinstance(ev.get("duration_us"), (int, float)):
        meta.append(f"{ev['duration_us']:.0f} µs")
    if ev.get("thread"):
        meta.append(_e(ev["thread"]))
    return " · ".join(meta)
