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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.cells import cell_len, get_character_cell_size
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.widgets import Static

from torchscope.protocol.events import ATEN, OP, Event
from torchscope.session.checks import check_passed, eager_of, is_check
from torchscope.session.format import (
    call_label,
    check_text,
    compact_stat,
    first_bad,
    fnum,
    index_text,
    is_bad,
    label_meaning,
    range_bar,
    resolve_source,
    shape_text,
    short_name,
    short_source,
    source_context,
    sparkline,
    value_rows,
)
from torchscope.session.rows import FLAG_ACCUMULATE, FLAGS, NAME, SEQ, AtenRow, PendingRow, Row
from torchscope.session.stepper_view import ValuesView, pause_key
from torchscope.session.steps import StepData
from torchscope.session.store import EventStore
from torchscope.tui import glyphs
from torchscope.tui.widgets.alert_list import knock_on_count

_MAX_VALUES = 64  # small values shown in rows; more: the first ones and "…"
_MAX_TENSORS = 64
_MAX_LINKS = 24  # node links listed for one op
_LINK = "\x00"  # a line that starts with it is link number N: "\x00N\x00text"
# A summary's ``stats_of``: what its numbers are of, when not the tensor itself.
# by a summary's ``stats_of``: None (absent) for the tensor itself
_STATS_OF: dict[str | None, str] = {"abs": "of |z|", "local": "of the local shard"}
_ONE_LINE = 16  # a one-row tensor with at most this many values: one line, values then stats
_PAD = 6  # where a tensor's lines go on, under its "  [0] "


def _e(value: Any) -> str:
    return escape(str(value))


# -- laying text out for the panel's width ------------------------------------------------------
# A line is built from units (``min -1.087``, ``[8,32]``, ``→ AccumulateGrad``): a unit is never
# split, lines break between units, and a line never goes past the panel's width unless one
# unit alone does (then it is alone on its line).

Unit = tuple[str, int, str]  # markup, its width in cells, what joins it to the unit before


def _u(text: Any, style: str = "", join: str = " ") -> Unit:
    """A unit of plain ``text`` (escaped here), in ``style`` (markup style) if given."""
    text = str(text)
    markup = _e(text)
    return (f"[{style}]{markup}[/]" if style else markup, cell_len(text), join)


def _kv(key: str, value: str, style: str = "", join: str = "  ") -> Unit:
    """A key/value pair as one unit: ``min -1.087`` (the key dim)."""
    markup = f"[dim]{_e(key)}[/] {_e(value)}"
    return (f"[{style}]{markup}[/]" if style else markup, cell_len(f"{key} {value}"), join)


def _words(text: str, style: str = "", join: str = " ") -> list[Unit]:
    """Prose: one unit a word (it wraps between words)."""
    words = str(text).split()
    return [_u(w, style, join if i == 0 else " ") for i, w in enumerate(words)]


def _flow(units: list[Unit], width: int, first: str = "", indent: int = 0) -> list[str]:
    """``units`` joined, broken into lines of at most ``width`` cells between units. The first
    line starts with ``first`` (plain spaces or markup as wide as its plain text is long:
    give spaces), the others with ``indent`` spaces."""
    lines: list[str] = []
    line, used = first, cell_len(first)
    empty = True
    for markup, cells, join in units:
        if empty:
            line, used, empty = line + markup, used + cells, False
        elif used + len(join) + cells <= width:
            line, used = f"{line}{join}{markup}", used + len(join) + cells
        else:
            lines.append(line)
            line, used = " " * indent + markup, indent + cells
    lines.append(line)
    return lines


def _pairs(units: list[Unit], width: int, indent: int) -> list[str]:
    """Key/value pairs under each other: on one line when they fit, else in aligned columns
    (each pair padded to the widest), as many columns as the width holds."""
    if not units:
        return []
    one = indent + sum(c for _, c, _ in units) + 2 * (len(units) - 1)
    if one <= width:
        return [" " * indent + "  ".join(m for m, _, _ in units)]
    cell = max(c for _, c, _ in units)
    per = max(1, (width - indent + 2) // (cell + 2))
    lines = []
    for i in range(0, len(units), per):
        row = units[i : i + per]
        cells = [m + " " * (cell - c) for m, c, _ in row[:-1]] + [row[-1][0]]
        lines.append(" " * indent + "  ".join(cells))
    return lines


def _clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells: cut with an ellipsis when longer (plain text)."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    out, used = [], 0
    for ch in text:
        size = get_character_cell_size(ch)
        if used + size > width - 1:
            break
        out.append(ch)
        used += size
    return "".join(out) + "…"


def _span(units: list[Unit]) -> int:
    """The width of ``units`` on one line."""
    return sum(c for _, c, _ in units) + sum(len(j) for _, _, j in units[1:])


def _numel(shape: list | None) -> int | None:
    if shape is None or any(type(d) is not int or d < 0 for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


def _value_units(values: list) -> list[Unit]:
    """``values [1, 2, 3]``, one unit a value (the list wraps between values), NaN/Inf red."""
    out: list[Unit] = []
    for i, v in enumerate(values):
        text = fnum(v)
        pre, post = ("[" if i == 0 else ""), ("," if i < len(values) - 1 else "]")
        number = f"[b $text-error]{_e(text)}[/]" if is_bad(v) else _e(text)
        opening = "\\[" if pre else ""  # escape() leaves a "[" before "[b" as it is
        markup, cells = f"{opening}{number}{post}", len(pre) + cell_len(text) + len(post)
        if i == 0:
            markup, cells = f"[dim]values[/] {markup}", cells + len("values ")
        out.append((markup, cells, "  " if i == 0 else " "))
    return out


class _Body(Static):
    """The detail's text: laid out again when its width changes (the panel was resized, or
    its scrollbar came or went)."""

    def on_resize(self, event: events.Resize) -> None:
        panel = self.parent
        if isinstance(panel, DetailPanel):
            panel.relayout()


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
        self.body = _Body("", id="detail-body", markup=True)
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
        # The text is laid out for the width it is shown at: what builds it (again, when the
        # width changes), the width it was built for, and what builds the pause's call stack.
        self._build: Callable[[], str] | None = None
        self._stack_build: Callable[[], str] | None = None
        self._width = 40

    def compose(self) -> ComposeResult:
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
        self._set(lambda: "\n".join(_flow(_words(text, "dim"), self._width)))

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
        subject: tuple[Any, ...]
        subject = ("row", row.seq, row.kind, id(data), id(row) if row.pending else None)
        if pause is not None:
            subject += (pause_key(pause),)
        if subject == self.subject:
            if pause is not None and values is not None and values.version != self.values_version:
                self._show_values(values, scroll=True)
            return
        self.subject = subject
        ev = row.event if isinstance(row, PendingRow) else store.event(row)
        self.event = ev

        def build() -> str:
            if row.kind == OP:
                text = self._op(store, data, ev)
            elif row.kind == ATEN:
                text = self._aten(store, data, row, ev)
            else:
                text = self._grad(store, data, row, ev)
            if pause is not None:
                text = self._pause_head(pause, ev) + "\n\n" + text
            return text

        self._set(build)
        if pause is not None:
            self._stack_build = lambda: self._stack(pause.get("stack"))
            self.stack_box.update(self._stack_build())
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
        self._set(lambda: self._node(store, data, node, call))

    def show_alert(self, alert: Event, knock_on: list[Event] | None = None) -> None:
        self.subject = ("alert", alert.get("seq"))
        self.event = None
        if is_check(alert):
            self._set(lambda: "\n".join(self._check(alert)))
            return
        self._set(lambda: self._alert(alert, knock_on))

    def _alert(self, alert: Event, knock_on: list[Event] | None) -> str:
        step, seq = alert.get("step"), alert.get("event_seq")
        lines = [
            f"[b $text-error]⚠ {_e(alert.get('message', 'alert'))}[/]",
            f"step {_e(step)} · {_e(alert.get('where', ''))}",
        ]
        if type(seq) is int:
            target = Link("event", seq, step if type(step) is int else None)
            lines.append(self._link(target, f"the event: #{seq} [dim](event seq)[/]"))
        if knock_on:
            count = knock_on_count(alert, knock_on)  # the tracer's count: it lists a few
            lines.append("")
            lines.append(
                f"[b]{count} knock-on alert{'s' * (count != 1)}[/] "
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
        return "\n".join(lines)

    def _check(self, alert: Event) -> list[str]:
        """An eager check: its message, the compiled call (a link), and what differs, one
        row per output or parameter gradient: max |Δ|, relative, within tolerance."""
        step, seq = alert.get("step"), alert.get("event_seq")
        style = "$text-success" if check_passed(alert) else "$text-warning"
        mark = "✓" if check_passed(alert) else "≠"
        where = {"forward": "outputs (forward)", "backward": "gradients (backward)"}.get(
            str(alert.get("where")), str(alert.get("where", ""))
        )
        lines = [
            f"[b {style}]{mark} {_e(alert.get('message', 'eager check'))}[/]",
            f"eager check · step {_e(step)} · {_e(where)} "
            "[dim](a compiled call run once more eagerly: not a NaN/Inf origin)[/]",
        ]
        if type(seq) is int:
            target = Link("event", seq, step if type(step) is int else None)
            name = short_name(str(alert.get("name", "?")))
            lines.append(self._link(target, f"the compiled call: {_e(name)} #{seq}"))
        diffs = [d for d in alert.get("differences") or () if isinstance(d, dict)]
        lines.append("")
        if not diffs:
            lines.append("[b]differences[/] [dim](nothing to compare)[/]")
            return lines
        lines.append("[b]differences[/] [dim]compiled against eager[/]")
        rows = [("of", "max |Δ|", "rel", "within")]
        for d in diffs[:_MAX_TENSORS]:
            within = "yes" if d.get("within") is True else "no"
            bad = [
                f"{d[k]} NaN/Inf only {side}"
                for k, side in (
                    ("nonfinite_only_compiled", "compiled"),
                    ("nonfinite_only_eager", "eager"),
                )
                if type(d.get(k)) is int and d[k]
            ]
            if bad:
                within += f" ({', '.join(bad)})"
            rows.append(
                (str(d.get("of", "?")), fnum(d.get("max_abs")), fnum(d.get("max_rel")), within)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for n, r in enumerate(rows):
            cells = [r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2].rjust(widths[2]), r[3]]
            text = _e("  ".join(cells))
            if n == 0:
                text = f"[dim]{text}[/]"
            elif r[3] != "yes":
                text = f"[{style}]{text}[/]"
            lines.append(f"  {text}")
        if len(diffs) > _MAX_TENSORS:
            lines.append(f"  [dim]… {len(diffs) - _MAX_TENSORS} more[/]")
        tols = sorted(
            {(d.get("rtol"), d.get("atol")) for d in diffs if d.get("rtol") is not None},
            key=str,
        )
        if tols:
            text = " · ".join(f"rtol {fnum(r)}, atol {fnum(a)}" for r, a in tols[:3])
            lines.append(f"  [dim]tolerance: {_e(text)}[/]")
        return lines

    def _set(self, build: Callable[[], str]) -> None:
        """Show what ``build`` makes (laid out for the panel's width; made again when the
        width changes)."""
        self._build = build
        self._stack_build = None
        self._lay_out()
        self.link_cursor = 0
        self._render_body()
        self.stack_box.display = False
        self.values_box.display = False
        self.values_version = None
        self.scroll_home(animate=False, immediate=True)

    def _lay_out(self) -> None:
        self._width = self._text_width()
        self._new_links = []
        self._template = self._build() if self._build is not None else ""
        self.links, self._new_links = self._new_links, []

    def relayout(self) -> None:
        """The width changed: the same text, laid out again (links and scroll kept)."""
        if self._build is None or self._text_width() == self._width:
            return
        cursor = self.link_cursor
        self._lay_out()
        self.link_cursor = min(cursor, max(0, len(self.links) - 1))
        self._render_body()
        if self._stack_build is not None:
            self.stack_box.update(self._stack_build())
        # called while the screen is being laid out: the new height is taken after it
        self.call_after_refresh(self.body.refresh, layout=True)

    # -- links -------------------------------------------------------------------------------
    def _link(self, link: Link, text: str) -> str:
        """A line that is a link (``text`` is markup)."""
        self._new_links.append(link)
        return f"{_LINK}{len(self._new_links) - 1}{_LINK}{text}"

    def _link_flow(self, link: Link, units: list[Unit], indent: int = 2) -> list[str]:
        """A link laid out like ``_flow`` (its mark takes 2 columns): its first line is the
        link, the others go on under its text, ``indent`` further in."""
        lines = _flow(units, self._width - 2, indent=indent)
        return [self._link(link, lines[0])] + [f"  {line}" for line in lines[1:]]

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
        kind = ev.get("kind")
        what = "op" if kind == OP else "aten call" if kind == ATEN else "node"
        if pause.get("phase") == "before":
            where = f"[b]before[/] this {what} runs"
        else:
            where = f"[b]after[/] this {what} ran"
        reason = pause.get("reason") or "paused"
        return (
            f"[b $text-warning]{glyphs.pause()} PAUSED[/] {where} · {_e(reason)}\n"
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
                lines.append(f"      {_e(_clip(text, self._width - 6))}")
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
        got = result.get("start")
        start = got if type(got) is int else values.start
        end = start + len(vals)
        prev = "[@click=screen.prev_slice]◀ prev[/]" if start > 0 else "[dim]◀ prev[/]"
        has_next = numel is not None and end < numel
        nxt = "[@click=screen.next_slice]next ▶[/]" if has_next else "[dim]next ▶[/]"
        total = f"{numel:,}" if numel is not None else "?"
        stats = summary.get("stats")
        stats = stats if isinstance(stats, dict) else {}
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
        """The source line with three lines of context, under a line-number gutter; lines
        are cut with an ellipsis at the panel's edge (never wrapped), their common indent
        taken off."""
        if not source:
            return ["[dim]source: unknown[/]"]
        head = [_u("source", "b"), _u(short_source(source, self.cwd), "$accent")]
        if function:
            head.append(("in " + f"[i]{_e(function)}[/]", 3 + cell_len(str(function)), " "))
        lines = _flow(head, self._width, indent=2)
        ctx = source_context(source, self.cwd)
        if ctx is None:
            lines.extend(
                _flow(_words("(file not available on this machine)", "dim"), self._width, "  ", 2)
            )
            return lines
        texts = [text.expandtabs(4).rstrip() for _, text, _ in ctx]
        indent = min((len(t) - len(t.lstrip()) for t in texts if t.strip()), default=0)
        number_width = len(str(ctx[-1][0]))
        room = self._width - (number_width + 5)  # "▶ 30 │ "
        for (number, _, target), text in zip(ctx, texts, strict=True):
            num = str(number).rjust(number_width)
            code = _e(_clip(text[indent:], room))
            if target:
                lines.append(f"[b $accent]▶ {num} │ {code}[/]")
            else:
                lines.append(f"[dim]  {num} │[/] {code}")
        return lines

    def _summary(self, index: int, s: Any, note: list[str] | None = None) -> list[str]:
        """One tensor: ``  [0] [8,32] float32 cpu`` and its notes (where a gradient goes),
        then its stats as key/value pairs, a bar of mean±std in [min, max], its values. A
        tensor of one value, or one row of at most 16, is one line when it fits."""
        width, pad = self._width, " " * _PAD
        label = _u(f"[{index}]", join="")
        notes = [_u(n, "dim") for n in note or ()]
        if s is None:
            none_why = _words("no gradient (input needs none, or it was not requested)", "dim")
            units = [label, _u("None", "b")] + (notes or none_why)
            return _flow(units, width, "  ", _PAD)
        if not isinstance(s, dict):
            return [f"  \\[{index}] [dim]?[/]"]
        head = [label, _u(shape_text(s), "b"), _u(s.get("dtype", "?")), _u(s.get("device", "?"))]
        if isinstance(s.get("param"), str):
            head.append(_u(s["param"], "b"))
        head += notes
        shard = _shard_text(s)
        stats = s.get("stats")
        if not isinstance(stats, dict) or not stats:
            if s.get("pending"):
                # An async collective's output: the tracer summarises it after the wait().
                why = "not read: the collective had not completed"
            elif s.get("external"):
                # The tracer reduces data and weights only when the op's output goes bad.
                why = "from outside: stats only on a bad output"
            elif s.get("stats_of") == "batched":
                why = "one of a batch of gradients (is_grads_batched): numbers not read"
            else:
                why = "metadata only: no values summarised"
            lines = _flow(head, width, "  ", _PAD)
            if shard:
                lines.append(f"{pad}{shard}")
            lines.extend(_flow(_words(f"({why})", "dim"), width, pad, _PAD))
            return lines
        of = _STATS_OF.get(s.get("stats_of"), "")
        nan, inf = stats.get("nan") or 0, stats.get("inf") or 0
        counts = (("NaN", nan), ("Inf", inf))
        flags = [_u(f"{k} {n}", "b $text-error", "  ") for k, n in counts if n]
        values = s.get("values") if isinstance(s.get("values"), list) else None
        shape = s.get("shape") if isinstance(s.get("shape"), list) else None
        numel = _numel(shape)
        if numel == 1 and not shard and (values or "min" in stats):
            # one value: the value, no stats (they would all say it again)
            v = values[0] if values else stats.get("min")
            value = _kv("value", fnum(v), "b $text-error" if is_bad(v) else "")
            units = head + [value] + flags + ([_u(f"({of})", "dim")] if of else [])
            return _flow(units, width, "  ", _PAD)
        norm = f"{fnum(stats.get('norm'))}" + (f" ({of})" if of else "")
        pairs = [
            _kv("min", fnum(stats.get("min"))),
            _kv("max", fnum(stats.get("max"))),
            _kv("mean", fnum(stats.get("mean"))),
            _kv("std", fnum(stats.get("std"))),
            _kv("norm", norm, "b"),
            *flags,
        ]
        bad = first_bad(values) if values else None
        bad_line = []
        if bad is not None:
            at = index_text(bad, shape)
            bad_line.append(f"{pad}[b $text-error]first NaN/Inf at {at}[/] [dim](flat {bad})[/]")
        shown = values[:_MAX_VALUES] if values else []
        one_row = bool(shown) and len(value_rows(shown, shape, 0, per_line=len(shown))) <= 1
        if one_row and not shard and len(values or ()) <= _ONE_LINE:
            # one line: the values, then the stats they do not show (min and max they do);
            # else the values with the head, the stats under them
            vals, pairs = _value_units(values or []), pairs[2:]
            if 2 + _span(head + vals + pairs) <= width:
                return _flow(head + vals + pairs, width, "  ") + bad_line
            if 2 + _span(head + vals) <= width:
                lines = _flow(head + vals, width, "  ")
            else:
                lines = _flow(head, width, "  ", _PAD)
                lines.extend(_flow(vals, width, pad, _PAD + len("values [")))
            lines.extend(_pairs(pairs, width, _PAD))
            return lines + bad_line
        lines = _flow(head, width, "  ", _PAD)
        if shard:
            lines.append(f"{pad}{shard}")
        lines.extend(_pairs(pairs, width, _PAD))
        # one line, however narrow the panel: "min ├──═┼═──┤ max   (mean±std)", the legend
        # going first
        room = width - len(pad) - len("min  max")
        legend = "   (mean±std)" if room - 13 >= 20 else ""
        bar = range_bar(stats, max(8, min(28, room - len(legend))))
        if bar:
            lines.append(f"{pad}[dim]min[/] {bar} [dim]max{legend}[/]")
        if shown:
            grid = _value_grid(shown, 0, width - _PAD - 7, shape)
            lines.append(f"{pad}[dim]values[/] {grid[0]}")
            lines.extend(f"{pad}       {g}" for g in grid[1:])
            if one_row and len(values or ()) > 1:
                spark = sparkline(values, max(8, width - _PAD - 7))
                lines.append(f"{pad}       [$accent]{spark}[/]")
            if len(values or ()) > _MAX_VALUES:
                lines.append(f"{pad}[dim]… {len(values or ()) - _MAX_VALUES:,} more[/]")
        return lines + bad_line

    def _tensors(
        self,
        title: str,
        sums: Any,
        notes: list[list[str]] | None = None,
        links: list[Link | None] | None = None,
    ) -> list[str]:
        if not isinstance(sums, list) or not sums:
            return [f"[b]{title}[/] [dim](none)[/]"]
        lines = [f"[b]{title}[/]"]
        for i, s in enumerate(sums[:_MAX_TENSORS]):
            note = notes[i] if notes and i < len(notes) else None
            part = self._summary(i, s, note)
            link = links[i] if links and i < len(links) else None
            if link is not None and part:
                part[0] = self._link(link, part[0][2:])  # its mark takes the 2 spaces
            lines.extend(part)
        if len(sums) > _MAX_TENSORS:
            lines.append(f"  [dim]… {len(sums) - _MAX_TENSORS} more[/]")
        return lines

    def _op(self, store: EventStore, data: StepData | None, ev: dict[str, Any]) -> str:
        lines = [f"[b $accent]{_e(ev.get('name', '?'))}[/]"]
        seq = ev.get("seq")
        step = ev.get("step")
        what = f"op · event #{seq}" if seq is not None else "op (not run yet)"
        lines.extend(_flow(_meta_line(what, step, ev.get("module"), ev), self._width))
        lines.extend(self._compiled_lines(data, ev))
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

    def _compiled_lines(self, data: StepData | None, ev: dict[str, Any]) -> list[str]:
        """torch.compile: a compiled module's call says that its inside is not traced (and
        what its eager checks found); an op of an eager re-run names the call it re-ran."""
        step = data.step if data is not None else None
        lines = []
        if ev.get("compiled") is True:
            lines.append(
                "[b]compiled[/]: what runs inside is not traced "
                "[dim](E: check the next step against eager)[/]"
            )
            seq = ev.get("seq")
            for alert in data.alerts if data is not None and type(seq) is int else ():
                if is_check(alert) and alert.get("event_seq") == seq:
                    mark = "✓" if check_passed(alert) else "≠"
                    style = "$text-success" if check_passed(alert) else "$text-warning"
                    lines.append(f"[{style}]{mark} eager check:[/] {_e(check_text(alert))}")
        of = eager_of(ev)
        if of is not None:
            text = f"eager re-run of the compiled call #{of}"
            lines.append(self._link(Link("op", of, step), f"[b]{text}[/]"))
        return lines

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
            units = [("[b]creates[/]", 7, ""), _u(f"{n} backward nodes")]
            lines.extend(_flow(units + _words("(tab, ↑↓, enter: go)", "dim", "  "), self._width))
        for nid in node_ids[:_MAX_LINKS]:
            grads = data.grads_of_node(nid)
            gnode = data.graph_nodes.get(nid)
            name = (
                grads[0].name
                if grads
                else (gnode or {}).get("name") or (named or {}).get(nid) or "node"
            )
            units = [_u(name), _u(f"node id {nid}")]
            if grads:
                go = store.event(grads[0]).get("grad_outputs") or []
                stat = compact_stat(go[0]) if go and isinstance(go[0], dict) else ""
                units.append(_u(f"∇ {stat}", "dim"))
            elif gnode is not None:
                units.append(_u("(not executed)", "dim"))
            else:
                units.extend(_words("(backward not run yet)", "dim"))
            if n == 1:
                units.insert(0, ("[b]creates[/]", 7, ""))
            lines.extend(self._link_flow(Link("node", nid, data.step), units))
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
        self, store: EventStore, data: StepData | None, row: Row | PendingRow, ev: dict[str, Any]
    ) -> str:
        nid = ev.get("node_id")
        lines = [f"[b $accent]{_e(ev.get('node', '?'))}[/]"]
        seq = ev.get("seq")
        meta = [
            f"backward node id {nid}",
            f"event #{seq}" if seq is not None else "not run yet",
            f"step {ev.get('step')}",
        ]
        if ev.get("backward") is not None:
            meta.append(f"backward call {ev['backward']}")
        lines.extend(_flow(_dots(meta), self._width))
        if ev.get("param"):
            lines.append(f"[b]parameter[/] {_e(ev['param'])}")
        op = data.op(row.op_seq) if data is not None else None
        if op is not None:
            units = [
                ("[b]created by[/] " + _e(short_name(op.name)), 11 + len(short_name(op.name)), ""),
                _u(f"(op, event #{op.seq})"),
            ]
            if op.module:
                units.append(_u(f"in {op.module}"))
            link = Link("op", op.seq, data.step if data else None)
            lines.extend(self._link_flow(link, units))
        elif row.op_seq is not None:
            lines.append(f"[b]created by[/] op event #{row.op_seq} [dim](not in this step)[/]")
        # Both sides first, the source after them: at 120x40 the detail has about 14 rows
        # under the timeline, and what a node did is what its detail is opened for.
        lines.append("")
        lines.extend(self._tensors("grad_outputs — what arrived", ev.get("grad_outputs")))
        gi = ev.get("grad_inputs")
        if seq is None and gi is None:
            lines.append(
                "[b]grad_inputs — what it sends on[/] "
                "[dim]not computed yet: paused before the node runs[/]"
            )
            lines.append("")
            lines.extend(self._source(ev.get("source")))
            return "\n".join(lines)
        n = len(gi) if isinstance(gi, list) else 0
        targets = self._next_targets(data, nid, n)
        notes: list[list[str]] = []
        links: list[Link | None] = []
        for target in targets:
            tnode = None
            if data is not None and target is not None:
                tnode = data.graph_nodes.get(target)
            if target is None or tnode is None:
                notes.append(["→ (no node)"])
                links.append(None)
                continue
            label = tnode.get("param") or tnode.get("name", "?")
            notes.append([f"→ {label}", f"node id {target}"])
            links.append(Link("node", target, data.step if data else None))
        lines.extend(self._tensors("grad_inputs — what it sends on", gi, notes, links))
        lines.append("")
        lines.extend(self._source(ev.get("source")))
        if data is not None and not isinstance(row, PendingRow):
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
            units = [_u(f"{mark}{t[NAME]}", join=""), _u(f"#{t[SEQ]}"), _u(stat, "dim")]
            lines.extend(_flow(units, self._width, "  ", 4))
        if n > _MAX_LINKS:
            lines.append(f"  [dim]… {n - _MAX_LINKS} more[/]")
        return lines

    def _aten(
        self, store: EventStore, data: StepData | None, row: Row | PendingRow, ev: dict[str, Any]
    ) -> str:
        """One aten call: what ran it (op or node, a link), then like an op."""
        lines = [f"[b $accent]{_e(ev.get('name', '?'))}[/]"]
        seq = ev.get("seq")
        module = row.module if isinstance(row, Row) else ev.get("module")
        what = f"aten call · event #{seq}" if seq is not None else "aten call (not run yet)"
        lines.extend(_flow(_meta_line(what, ev.get("step"), module, ev), self._width))
        step = data.step if data is not None else None
        parent = row.parent if isinstance(row, AtenRow) else None
        op_seq, nid = ev.get("op_seq"), ev.get("node_id")
        if type(op_seq) is int:
            name = short_name(parent.name) if parent is not None else f"op event #{op_seq}"
            units = [("[b]in[/] " + _e(name), 3 + cell_len(name), ""), _u(f"(op, event #{op_seq})")]
            lines.extend(self._link_flow(Link("op", op_seq, step), units))
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
        label = call_label(ev)
        if label is not None:
            meaning = label_meaning(label)
            lines.append(f"[b]label[/] {_e(label)} [dim]({_e(meaning)})[/]")
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


def _shard_text(s: dict) -> str:
    """A DTensor's placement and this rank's local shape (markup), or "" for a plain tensor:
    ``Shard(dim=0) · local shard [4, 8]``. Its shape is the global one."""
    parts = []
    if isinstance(s.get("placement"), str):
        parts.append(f"[b]{_e(s['placement'])}[/]")
    local = s.get("local_shape")
    if isinstance(local, list):
        parts.append(f"local shard {_e(shape_text({'shape': local}))}")
    return " · ".join(parts)


def _meta_line(what: str, step: Any, module: str | None, ev: dict[str, Any]) -> list[Unit]:
    """``op · event #8 · step 0 · module [b]blocks.0[/] · group of 8 ranks · 12 µs ·
    MainThread`` (the group: a collective's process group), as units (see ``_dots``)."""
    meta: list[str | tuple[str, int]] = [what, f"step {step}"]
    if module:
        meta.append(("module [b]" + _e(module) + "[/]", cell_len(f"module {module}")))
    if type(ev.get("group_size")) is int:
        meta.append(f"group of {ev['group_size']} ranks")
    if isinstance(ev.get("duration_us"), (int, float)):
        meta.append(f"{ev['duration_us']:.0f} µs")
    if ev.get("thread"):
        meta.append(str(ev["thread"]))
    return _dots(meta)


def _dots(parts: list) -> list[Unit]:
    """Parts joined by `` · `` (a line breaks between parts, the dot ending the line before):
    plain strings, or ``(markup, width)``."""
    out: list[Unit] = []
    for i, part in enumerate(parts):
        markup, cells = part if isinstance(part, tuple) else (_e(part), cell_len(part))
        if i < len(parts) - 1:
            markup, cells = markup + " ·", cells + 2
        out.append((markup, cells, " "))
    return out
