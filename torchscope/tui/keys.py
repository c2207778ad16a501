"""Every key of the UI, once: what it is bound to, its label on the key bar (a long and a short
one), its line in the help, and the help's section. The screens' ``BINDINGS``, the key bar's
hints and the help (``?``) are all made from this table, so a key is written in one place.

Entries without an ``action`` are keys a widget handles itself (the lists' arrows, ``enter``,
``tab``): they are here for the help alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding, BindingType

# The help's sections, in the order it shows them (stepping first; the focused panel's own
# section moves up right after it).
STEPPING = "Stepping"
TIMELINE = "Timeline"
GRAPH = "Graph"
DETAIL = "Detail"
ALERTS = "Alerts"
MOVING = "Moving around"
FINDING = "Finding"
SHARING = "Copy and export"
SOURCES = "Several sources (ranks, recordings)"
THIS_UI = "This UI"
SECTIONS = (STEPPING, TIMELINE, GRAPH, DETAIL, ALERTS, MOVING, FINDING, SHARING, SOURCES, THIS_UI)

Hint = tuple[str, str, str]  # (key as shown, label, short label)


@dataclass(frozen=True)
class Key:
    shown: str  # the key as the user reads it: "space", "/", "< >"
    help: str  # its line in the help
    section: str
    action: str | None = None  # None: a widget handles it (documented here only)
    bind: str | None = None  # Textual's key names, when not ``shown``
    label: str = ""  # the key bar's word for it ("" : never on the bar)
    short: str = ""  # the key bar's word at narrow widths ("" : the label)
    priority: bool = False  # before the focused widget (the graph's tree takes space)
    owner: str = "main"  # whose BINDINGS: "main" (the main screen) or "app"
    only: str = ""  # "live": a running job's key; "aten": when the trace has aten calls
    on_bar: str = ""  # the key as the bar writes it, when shorter than ``shown`` ("⌫")

    def hint(self, label: str | None = None) -> Hint:
        label = label or self.label
        short = self.short if label == self.label and self.short else label
        return (self.on_bar or self.shown, label, short)


KEYS: tuple[Key, ...] = (
    # -- stepping: a live job ------------------------------------------------------------------
    Key(
        "space",
        "pause the job at the next op or node",
        STEPPING,
        "pause",
        label="pause",
        priority=True,
    ),
    Key(
        "s",
        "step: run one op or node (from a 'before' point: the same one)",
        STEPPING,
        "step",
        label="step",
    ),
    Key("n", "run to the next training step", STEPPING, "next", label="next step", short="next"),
    Key(
        "c",
        "continue (to the next breakpoint)",
        STEPPING,
        "continue",
        label="continue",
        short="cont",
    ),
    Key(
        "b",
        "breakpoint from the selected event (same name, module or line; AND nan)",
        STEPPING,
        "break_here",
        label="break",
        short="bp",
    ),
    Key(
        "B",
        "breakpoints: type a condition + enter; with the box empty, space on/off and "
        "delete (twice); ctrl+z undoes a delete",
        STEPPING,
        "breakpoints",
        label="breakpoints",
        short="bps",
    ),
    Key(
        "S N C",
        "a recording: back one event, to the previous step, back to the previous breakpoint "
        "hit (s n c go forward; space pauses at the selected row)",
        STEPPING,
        "step_back",
        bind="S",
        label="back",
    ),
    Key("N", "", STEPPING, "prev", bind="N"),
    Key("C", "", STEPPING, "continue_back", bind="C"),
    Key(
        "v",
        "paused: fetch values of the paused event's tensors (again: the next tensor)",
        STEPPING,
        "values",
        label="values",
        short="vals",
    ),
    Key(
        "p",
        "paused: evaluate a Python expression in the job over the paused event's tensors "
        "(x: the tensor v shows, out, args, kwargs, grad_inputs, grad_outputs, module, torch, "
        "F); ↑↓ history; on a recording, what its summaries kept",
        STEPPING,
        "evaluate",
    ),
    Key(
        "< >",
        "paused: previous / next 1000 values",
        STEPPING,
        "prev_slice",
        bind="less_than_sign,comma",
    ),
    Key(">", "", STEPPING, "next_slice", bind="greater_than_sign,full_stop"),
    Key(
        "@",
        "trace the job's next step at the aten level, inside the selected row's module "
        "(everywhere when none, or the root, is selected); the job's own tracing stays",
        STEPPING,
        "aten_next",
        bind="at",
        only="live",
    ),
    Key(
        "E",
        "run the next step's torch.compile'd modules once more eagerly and compare "
        "(an alert per call says what differs: a check, not a NaN origin; ops [eager])",
        STEPPING,
        "eager_check",
        only="live",
    ),
    # -- the timeline --------------------------------------------------------------------------
    Key(
        "↑↓ j k",
        "move in the focused list; pgup/pgdn; home/end: first/last (mouse too)",
        TIMELINE,
        label="move",
    ),
    Key(
        "enter",
        "op → its backward node(s); node → the op that created it; alert → its event",
        TIMELINE,
        label="jump",
    ),
    Key(
        "m", "stat column: norm ⇄ mean±std", TIMELINE, "stat_mode", label="norm/mean", short="stat"
    ),
    Key(
        "f",
        "follow the newest step (it stays on when pressed again; any move in the "
        "timeline stops it, end or f resumes it)",
        TIMELINE,
        "follow",
        label="follow",
        only="live",
    ),
    Key(
        "→ ← l h",
        "aten level: unfold / fold the aten calls of an op or node marked + (on a "
        "call, ←: back to its op or node; Σ: the engine summing gradients). / and | match "
        "calls by name: a search unfolds the row of the call it goes to; the filter keeps "
        "matching calls under their row; :#N, y, x, e work on calls too",
        TIMELINE,
        only="aten",
    ),
    Key(
        "A",
        "aten level: unfold every op's and node's aten calls at once, in every step and "
        "in rows that come live ⇄ fold them all again. A call's dim tag says why it ran: "
        "[autocast] a cast autocast added, [recompute] checkpointing re-running the forward, "
        "[vmap] [grad] [jvp] a torch.func transform",
        TIMELINE,
        "unfold_all",
        label="all aten",
        only="aten",
    ),
    # -- the graph -----------------------------------------------------------------------------
    Key(
        "g",
        "backward graph of the step ⇄ timeline (on the node under the cursor)",
        GRAPH,
        "toggle_graph",
        label="graph",
    ),
    Key("→ ←", "expand / collapse a node's other inputs (or a module's nodes)", GRAPH),
    Key(
        "M",
        "group the nodes by module ⇄ chains",
        GRAPH,
        "group_modules",
        label="by module",
        short="mods",
    ),
    # -- the detail ----------------------------------------------------------------------------
    Key(
        "↑↓ enter",
        "the detail's links (nodes an op created, the op that made a node, where "
        "a gradient goes): ↑↓ move, enter follows (or click)",
        DETAIL,
        label="link",
    ),
    # -- alerts --------------------------------------------------------------------------------
    Key(
        "a",
        "alerts: where NaN/Inf first appeared, each with its consequences counted",
        ALERTS,
        "alerts",
        label="alerts",
    ),
    Key(
        "!",
        "values: go to the first NaN/Inf (paused: searches the fetched tensor)",
        ALERTS,
        "first_nan",
        bind="exclamation_mark",
        label="first NaN",
        short="NaN",
    ),
    # -- moving around -------------------------------------------------------------------------
    Key(
        "backspace",
        "back to where the last jump started",
        MOVING,
        "back",
        label="back",
        on_bar="⌫",
    ),
    Key(
        "esc",
        "back to the timeline from any panel or view (graph, steps, alerts, detail, a "
        "maximised panel); in the timeline, ends a search",
        MOVING,
        "escape",
        bind="escape",
    ),
    Key(
        "[ ]", "previous / next step", MOVING, "prev_step", bind="left_square_bracket", label="step"
    ),
    Key("]", "", MOVING, "next_step", bind="right_square_bracket"),
    Key(
        ":",
        "go to: :12 step 12 · :#1234 event seq 1234 · :node 57 backward node id 57",
        MOVING,
        "command_line",
        bind="colon",
        label="go to",
    ),
    Key(
        "tab",
        "cycle focus: steps, alerts, timeline, detail (shift+tab: back)",
        MOVING,
        label="panel",
    ),
    Key(
        "+",
        "maximise the focused panel (again: restore)",
        MOVING,
        "maximize_panel",
        bind="plus,equals_sign",
        label="maximise",
        short="max",
    ),
    Key(
        "H",
        "the run's history: loss and |g| over every step (per-module norms with the "
        "watch); arm the job at a step or when a condition holds",
        MOVING,
        "history",
        label="history",
        short="hist",
    ),
    # -- finding -------------------------------------------------------------------------------
    Key(
        "/",
        "search: a regex over each shown field on its own (name, module, source); all "
        "rows stay (in the graph: its nodes)",
        FINDING,
        "search",
        bind="slash",
        label="search",
        short="find",
    ),
    Key(
        "ctrl+n ctrl+p",
        "next / previous search match (wraps; n stays: next training step)",
        FINDING,
        "next_match",
        bind="ctrl+n",
        label="match",
        priority=True,
        on_bar="^n ^p",
    ),
    Key("ctrl+p", "", FINDING, "prev_match", bind="ctrl+p", priority=True),
    Key(
        "|",
        "filter: only rows matching the regex stay (esc clears); in the graph, only the "
        "matching nodes, by module",
        FINDING,
        "filter",
        bind="vertical_line",
        label="filter",
    ),
    # -- copy and export -----------------------------------------------------------------------
    Key(
        "y",
        "copy (OSC 52): the selected event's source path:line, a --break-on spec, its name, values",
        SHARING,
        "copy",
        label="copy",
    ),
    Key(
        "e",
        "export the step, or the filtered rows, to a JSON-lines file; on the paused event's "
        "row: edit its tensor x (a replacement expression, run in the job as it goes on)",
        SHARING,
        "export",
        label="export",
    ),
    # -- several sources -----------------------------------------------------------------------
    Key(
        "1-9 r R",
        "show source N; r / R: the next / previous one (same step, same op)",
        SOURCES,
        owner="app",
        label="source",
    ),
    Key(
        "o",
        "live ranks: space s n c act on every rank (default) ⇄ on the shown rank only",
        SOURCES,
        "toggle_scope",
        owner="app",
        label="this rank only",
    ),
    Key(
        "x",
        "compare the selected op or node across the sources, or with the marked one",
        SOURCES,
        "compare",
        label="compare",
    ),
    Key(
        "X",
        "mark the selected op or node; x in another step (or source) compares the two",
        SOURCES,
        "mark",
        label="mark",
    ),
    # -- this UI -------------------------------------------------------------------------------
    Key(
        "?",
        "this help (it starts with the focused panel's keys)",
        THIS_UI,
        "help",
        bind="question_mark",
        owner="app",
        label="help",
    ),
    Key(
        "q",
        "quit the UI (the job goes on: a pause this UI held resumes)",
        THIS_UI,
        "quit",
        owner="app",
        label="quit",
    ),
)

_BY_ACTION = {k.action: k for k in KEYS if k.action}
_BY_SHOWN = {k.shown: k for k in KEYS}


def key(action_or_shown: str) -> Key:
    """The entry for an action (``"step"``) or a key as shown (``"↑↓ j k"``)."""
    found = _BY_ACTION.get(action_or_shown) or _BY_SHOWN.get(action_or_shown)
    if found is None:
        raise KeyError(action_or_shown)
    return found


def hint(action_or_shown: str, label: str | None = None) -> Hint:
    """The key bar's hint for a key (``label`` when it says something else right now)."""
    return key(action_or_shown).hint(label)


def bindings(owner: str) -> list[BindingType]:
    """The ``BINDINGS`` of ``owner`` ("main" or "app"); none is shown by Textual's footer
    (the key bar takes its hints from here)."""
    return [
        Binding(k.bind or k.shown, k.action, k.label or k.help, show=False, priority=k.priority)
        for k in KEYS
        if k.action and k.owner == owner
    ]


def help_sections(
    focused: str | None, *, live: bool, aten: bool, sources: bool
) -> list[tuple[str, list[tuple[str, str]]]]:
    """The help's sections: stepping first, then the focused panel's (a ``*_SECTION``
    name), then the rest; each a list of (key, what it does). ``live``/``aten`` keep the
    keys only a running job or a trace with aten calls has; ``sources`` the several
    sources' keys."""
    order = list(SECTIONS)
    if focused in order and focused != STEPPING:
        order.remove(focused)
        order.insert(1, focused)
    out = []
    for section in order:
        if section == SOURCES and not sources:
            continue
        rows = [
            (k.shown, ("live: " if k.only == "live" else "") + k.help)
            for k in KEYS
            if k.section == section
            and k.help
            and (k.only != "live" or live)
            and (k.only != "aten" or aten)
        ]
        if rows:
            out.append((section, rows))
    return out
