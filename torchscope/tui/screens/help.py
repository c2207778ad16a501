"""``?``: the keys, and what the screens show."""

from __future__ import annotations

import textwrap
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: list[tuple[str, str]] = [
    ("↑↓ j k", "move in the focused list; pgup/pgdn; home/end: first/last (mouse too)"),
    ("enter", "op → its backward node(s); node → the op that created it; alert → its event"),
    ("backspace", "back to where the last jump started"),
    (
        "esc",
        "back to the timeline from any panel or view (graph, steps, alerts, detail, a "
        "maximised panel); in the timeline, ends a search",
    ),
    ("+", "maximise the focused panel (again: restore)"),
    ("g", "backward graph of the step ⇄ timeline (on the node under the cursor)"),
    ("→ ←", "graph: expand / collapse a node's other inputs (or a module's nodes)"),
    ("M", "graph: group the nodes by module (one expandable entry per module) ⇄ chains"),
    ("a", "alerts: where NaN/Inf first appeared"),
    ("/", "search: regex over name, module/param, source; all rows stay (in the graph: its nodes)"),
    ("ctrl+n ctrl+p", "next / previous search match (wraps; n stays: next training step)"),
    (
        "|",
        "filter: only rows matching the regex stay (esc clears); in the graph, only the "
        "matching nodes, by module",
    ),
    (":", "go to: :12 step 12 · :#1234 event seq 1234 · :node 57 backward node id 57"),
    ("[ ]", "previous / next step"),
    (
        "f",
        "live: follow the newest step (it stays on when pressed again; any move in the "
        "timeline stops it, end or f resumes it)",
    ),
    ("m", "stat column: norm ⇄ mean±std"),
    ("tab", "cycle focus: steps, alerts, timeline, detail (shift+tab: back)"),
    (
        "detail",
        "its links (nodes an op created, the op that made a node, where a gradient "
        "goes): ↑↓ move, enter follows (or click)",
    ),
    (
        "y",
        "copy (OSC 52): the selected event's source path:line, a --break-on spec, its name, values",
    ),
    ("e", "export the step, or the filtered rows, to a JSON-lines file"),
    ("!", "values: go to the first NaN/Inf (paused: searches the fetched tensor)"),
    (
        "1-9 r R",
        "several sources (ranks, recordings: tui t.rank*.tsc, tui A.tsc B.tsc): show source N; "
        "r / R: the next / previous one (same step, same op)",
    ),
    ("o", "live ranks: space s n c act on every rank (default) ⇄ on the shown rank only"),
    ("x", "compare the selected op or node across the sources, or with the marked one (X)"),
    ("X", "mark the selected op or node; x in another step (or source) compares the two"),
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

# Shown when the trace has aten calls (the tracer's aten level), after the graph's → ←.
ATEN_KEYS: list[tuple[str, str]] = [
    (
        "→ ← l h",
        "timeline, aten level: unfold / fold the aten calls of an op or node marked + "
        "(on a call, ←: back to its op or node; Σ: the engine summing gradients). / and | "
        "match calls by name: a search unfolds the row of the call it goes to; the filter "
        "keeps matching calls under their row (dimmed when only its calls match); :#N, y, x, "
        "e work on calls too",
    ),
    (
        "A",
        "timeline, aten level: unfold every op's and node's aten calls at once, in every step "
        "and in rows that come live (the timeline's lower border says so) ⇄ fold them all again. A "
        "call's dim tag says why it ran: [autocast] a cast autocast added, [recompute] "
        "checkpointing re-running the forward, [vmap] [grad] [jvp] a torch.func transform",
    ),
]


# Shown for a live job (a recording answers them with one line), after c.
LIVE_KEYS: list[tuple[str, str]] = [
    (
        "@",
        "live: trace the job's next step at the aten level, inside the selected row's module "
        "(everywhere when none, or the root, is selected); the job's own tracing stays",
    ),
    (
        "E",
        "live: run the next step's torch.compile'd modules once more eagerly and compare "
        "(an alert per call says what differs: a check, not a NaN origin; ops [eager])",
    ),
]


def keys_for(store: object, *, live: bool = False) -> list[tuple[str, str]]:
    """The help's keys: ``KEYS``, with ``ATEN_KEYS`` when ``store`` has aten calls and
    ``LIVE_KEYS`` for a live job."""
    if not getattr(store, "has_aten", False) and not live:
        return KEYS
    keys = list(KEYS)
    if live:
        at = next((i + 1 for i, (k, _) in enumerate(keys) if k == "c"), len(keys))
        keys[at:at] = LIVE_KEYS
    if getattr(store, "has_aten", False):
        at = next((i + 1 for i, (k, _) in enumerate(keys) if k == "→ ←"), len(keys))
        keys[at:at] = ATEN_KEYS
    return keys


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
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def compose(self) -> ComposeResult:
        source = getattr(self.app, "source", None)
        live = getattr(source, "mode", None) == "live"
        keys = keys_for(getattr(self.app, "store", None), live=live)
        width = max(len(k) for k, _ in keys)
        # hanging indent: a long description goes on under itself, not under the keys
        room = max(30, min(96, self.app.size.width - 4) - 6 - width - 2)
        rows = "\n".join(
            f"[b $accent]{escape(k.ljust(width))}[/]  "
            + ("\n" + " " * (width + 2)).join(escape(t) for t in textwrap.wrap(v, room))
            for k, v in keys
        )
        app = self.app
        store = getattr(app, "store", None)
        session = getattr(store, "session", None)
        status = dict(getattr(app, "status", None) or {})
        lease = getattr(getattr(store, "stepper", None), "lease", None)  # the job's stepper
        if lease is not None:
            status["lease"] = lease
        about = ABOUT + lease_about(status, session)
        with VerticalScroll(id="help-box"):
            yield Static("[b]torchscope — keys[/]", id="help-title")
            yield Static(rows, id="help-keys")
            yield Static(about, id="help-about")
            yield Static("[dim]esc / ? / q: close[/]", id="help-close")
