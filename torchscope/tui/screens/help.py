"""``?``: the keys, and what the screens show."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: list[tuple[str, str]] = [
    ("↑↓ j k", "move in the focused list; pgup/pgdn; home/end: first/last (mouse too)"),
    ("enter", "op → its backward node(s); node → the op that created it; alert → its event"),
    ("backspace", "back to where the last jump started"),
    ("esc", "back to the timeline (graph, side panel, maximised panel); ends a search"),
    ("+", "maximise the focused panel (again: restore)"),
    ("g", "backward graph of the step ⇄ timeline (on the node under the cursor)"),
    ("→ ←", "graph: expand / collapse a node's other inputs"),
    ("a", "alerts: where NaN/Inf first appeared"),
    ("/", "search the timeline: regex over name, module/param, source; all rows stay"),
    ("ctrl+n ctrl+p", "next / previous search match (wraps; n stays: next training step)"),
    ("|", "filter the timeline: only rows matching the regex stay (esc clears)"),
    (":", "go to: :12 step 12 · :#1234 event seq 1234 · :node 57 backward node id 57"),
    ("[ ]", "previous / next step"),
    ("f", "live: follow the newest events again (end in the timeline too)"),
    ("m", "stat column: norm ⇄ mean±std"),
    ("tab", "cycle focus: steps, alerts, timeline, detail (shift+tab: back)"),
    ("?", "this help"),
    ("space", "live: pause the job at the next op or node"),
    ("s", "live: step — run one op or node (from a 'before' point: the same one)"),
    ("n", "live: run to the next training step"),
    ("c", "live: continue (to the next breakpoint)"),
    ("b", "live: breakpoint from the selected event (same name, module or line; AND nan)"),
    ("B", "live: breakpoints — type a condition + enter; space on/off; delete twice; ctrl+z"),
    ("v", "paused: fetch values of the paused event's tensors (again: next tensor)"),
    ("< >", "paused: previous / next 1000 values"),
    ("q", "quit the UI (the job goes on: a pause this UI held resumes)"),
]

ABOUT = """\
[b]Timeline[/]  the step's events in the order they ran: forward ops (▸), then the
  backward nodes (◂). For a node, [i]stat[/] is the gradient that arrived (grad_outputs).
  [b]NaN[/]/[b]Inf[/] in red: this line's outputs hold them; (nan): only its inputs do.
  ⚠ marks where an alert says NaN/Inf first appeared.
[b]Detail[/]  both sides in full: inputs/outputs of an op; grad_outputs (what arrived)
  and grad_inputs (what it sends on, None shown) of a node; the source line.
[b]Steps[/]  · on disk (loads when shown)  … loading  ✗ no longer in memory
[b]Paused[/]  ⏸ marks the event a live job is paused at; paused before an op or node runs,
  it is a pending row at the end ("next"). The detail shows what it got (and made, after),
  the training thread's call stack, and values fetched from the job with v.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def compose(self) -> ComposeResult:
        width = max(len(k) for k, _ in KEYS)
        rows = "\n".join(f"[b $accent]{k.ljust(width)}[/]  {v}" for k, v in KEYS)
        with VerticalScroll(id="help-box"):
            yield Static("[b]torchscope — keys[/]", id="help-title")
            yield Static(rows, id="help-keys")
            yield Static(ABOUT, id="help-about")
            yield Static("[dim]esc / ? / q: close[/]", id="help-close")
