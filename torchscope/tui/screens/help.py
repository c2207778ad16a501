"""``?``: the keys, and what the screens show."""

from __future__ import annotations

import textwrap
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Static

from torchscope.tui.keys import help_sections

ABOUT = """\
[b]Timeline[/]  the step's events in the order they ran: forward ops (▸), then the
  backward nodes (◂). For a node, [i]stat[/] is the gradient that arrived (grad_outputs).
  [b]NaN[/]/[b]Inf[/] in red: this line's outputs hold them; (nan): only its inputs do.
  ⚠ marks where an alert says NaN/Inf first appeared.
[b]Numbers[/]  [b]#1234[/] is an event's seq: its place among all the run's events (the
  timeline's first column, :#1234). [b]node id 57[/] is an autograd node's id, a different
  count (the graph, :node 57). An op and the nodes it created have different numbers.
[b]Detail[/]  both sides in full: inputs/outputs of an op; grad_outputs (what arrived)
  and grad_inputs (what it sends on, None shown) of a node; the source line. Values are
  shown by row of their last dimension ([1,:]), with the first NaN/Inf's index.
[b]Steps[/]  · on disk (loads when shown)  … loading  ✗ no longer in memory; loss and
  |g| (global gradient norm) with a bar, and a sparkline of |g| under the panel.
[b]Paused[/]  ⏸ marks the event a live job is paused at; paused before an op or node runs,
  it is a pending row at the end ("next"). The detail shows what it got (and made, after),
  the training thread's call stack, and values fetched from the job with v.
[b]Sources[/]  with several (ranks, recordings), a bar over the status line: each one's
  key and state (⏸ paused, ● running, ○ gone, ! alerts, s12 its newest step), where
  space s n c go (all ranks, or one: o), and how long ranks have been paused (against the
  process group's timeout when the job says it).
"""


def lease_text(status: dict | None, session: dict | None) -> str:
    """How long a paused job waits for a silent UI: from the session or the status when
    the job says, else just "its lease"."""
    for source in (status or {}, session or {}):
        for key in ("lease", "lease_seconds"):
            value = source.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return f"its lease ({value:g} s)"
    return "its lease"


def lease_about(status: dict | None, session: dict | None) -> str:
    lease = lease_text(status, session)
    return (
        f"[b]Lease[/]  the UI pings the job every second; a pause it holds lasts while it does. "
        f"If the UI goes silent, the job resumes by itself after {lease}."
    )


class HelpScreen(ModalScreen[None]):
    """The keys from keys.py: stepping first, then the focused panel's, then the rest; in two
    columns where the terminal is wide enough, with a cue when more is below."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
        Binding("j,down", "scroll(1)", "Down", show=False),
        Binding("k,up", "scroll(-1)", "Up", show=False),
    ]

    def __init__(self, focused: str | None = None) -> None:
        super().__init__()
        self.focused_section = focused  # keys.py's section of the panel that had the focus

    def compose(self) -> ComposeResult:
        app = self.app
        source = getattr(app, "source", None)
        store = getattr(app, "store", None)
        sections = help_sections(
            self.focused_section,
            live=getattr(source, "mode", None) == "live",
            aten=bool(getattr(store, "has_aten", False)),
            sources=bool(getattr(app, "multi", False)),
        )
        two = app.size.width >= 120
        column_width = (min(app.size.width, 200) - 8) // (2 if two else 1) - 2
        blocks = [_section_text(title, rows, column_width) for title, rows in sections]
        session = getattr(store, "session", None)
        status = dict(getattr(app, "status", None) or {})
        lease = getattr(getattr(store, "stepper", None), "lease", None)  # the job's stepper
        if lease is not None:
            status["lease"] = lease
        about = ABOUT + lease_about(status, session)
        with VerticalScroll(id="help-box", classes="-wide" if two else ""):
            yield Static("[b]torchscope — keys[/]", id="help-title")
            if two:
                left, right = _balance(blocks)
                with Horizontal(id="help-columns"):
                    yield Static("\n\n".join(left), classes="help-column")
                    yield Static("\n\n".join(right), classes="help-column")
            else:
                yield Static("\n\n".join(blocks), id="help-keys")
            yield Static(about, id="help-about")

    def on_mount(self) -> None:
        self.call_after_refresh(self._cue)

    def _cue(self) -> None:
        box = self.query_one("#help-box", VerticalScroll)
        more = box.max_scroll_y > 0 and box.scroll_y < box.max_scroll_y
        box.border_subtitle = ("↓ more below: j, pgdn · " if more else "") + "esc / ? / q: close"

    def action_scroll(self, lines: int) -> None:
        box = self.query_one("#help-box", VerticalScroll)
        box.scroll_to(y=box.scroll_y + lines, animate=False)
        self.call_after_refresh(self._cue)

    def on_mouse_scroll_down(self) -> None:
        self.call_after_refresh(self._cue)


def _section_text(title: str, rows: list[tuple[str, str]], width: int) -> str:
    """A section: its title, then each key and its line, wrapped under itself."""
    keys = max(len(k) for k, _ in rows)
    room = max(24, width - keys - 2)
    lines = [f"[b]{escape(title)}[/]"]
    for k, v in rows:
        wrapped = textwrap.wrap(v, room) or [""]
        lines.append(
            f"[b $accent]{escape(k.ljust(keys))}[/]  "
            + ("\n" + " " * (keys + 2)).join(escape(t) for t in wrapped)
        )
    return "\n".join(lines)


def _balance(blocks: list[str]) -> tuple[list[str], list[str]]:
    """Sections in order into two columns of about the same height (the first keeps the
    stepping keys at its top)."""
    heights = [b.count("\n") + 2 for b in blocks]
    total, acc = sum(heights), 0
    for i, h in enumerate(heights):
        if acc + h / 2 > total / 2 and i > 0:
            return blocks[:i], blocks[i:]
        acc += h
    return blocks, []
