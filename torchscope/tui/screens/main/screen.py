"""The one screen, for live sessions and replays alike.

It reads only the app's :class:`~torchscope.session.store.EventStore` and asks the source
for steps that are not in memory (``request_step``); whether a file or a socket answers is not
its concern. ``apply_changes`` runs on the app's ``applied`` signal, once per batch.

The screen holds its widgets, what it shows and the key bindings; the work of each group of
keys is a part next to it (navigation.py, stepping.py, pause.py, values.py, evaluate.py,
search.py, graph.py, sharing.py, lanes.py, the prompt's modes in prompt.py, and the feature
controllers with state of their own: shown_step.py, the step shown and following the newest;
alerts.py, the alerts list; panels.py, the layout and ``+``; run_history.py, ``H``). Each
part sees the screen through its own protocol of what it uses (context.py's ``ScreenCore``
and its own members), and reaches another part only through the screen's methods it names,
or is handed them. The app is a
:class:`~torchscope.tui.screens.host.Host`: the screen calls it through that protocol and
follows its signals (``applied``, ``restarted``, ``lane_switch``, ``redraw``).

Step-through keys (live): ``space`` pause, ``s`` step, ``n`` next step, ``c`` continue, ``b``
breakpoint from the selected event, ``B`` the breakpoint list, ``v`` / ``<`` / ``>`` values of
the paused event's tensors. They go to the job through the app (``Host.command``); the job's
answers come back through the store (its ``stepper`` view) and ``apply_changes``. A replay
refuses them with a message.

``@`` and ``E`` ask a live job for more in its next step: ``arm`` with ``next=1`` and
``also`` (a hold beside the UI's own, which stays): at the aten level (inside the selected
row's module, or everywhere), or with each compiled module's call run once more eagerly and
compared. The status bar says what was asked until that step is over.
"""

from __future__ import annotations

import re
from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Input, Label, OptionList, ProgressBar, Tree

from torchscope.session.format import plural
from torchscope.session.rows import (
    PendingRow,
    Row,
)
from torchscope.session.search import FieldPattern, compile_filter
from torchscope.session.stepper_view import ValuesView
from torchscope.session.store import Changes, EventStore
from torchscope.tui.keys import Hint, bindings
from torchscope.tui.screens.host import Applied, Host, Redraw, subscribe
from torchscope.tui.screens.main.alerts import AlertsView
from torchscope.tui.screens.main.context import Asked, Location
from torchscope.tui.screens.main.evaluate import Evaluate
from torchscope.tui.screens.main.graph import GraphView
from torchscope.tui.screens.main.hints import key_hints
from torchscope.tui.screens.main.lanes import LaneView
from torchscope.tui.screens.main.navigation import Navigation
from torchscope.tui.screens.main.panels import Panels
from torchscope.tui.screens.main.pause import PauseMarks
from torchscope.tui.screens.main.prompt import MODES
from torchscope.tui.screens.main.run_history import RunHistoryPlot
from torchscope.tui.screens.main.search import Search
from torchscope.tui.screens.main.sharing import Sharing
from torchscope.tui.screens.main.shown_step import ShownStep
from torchscope.tui.screens.main.stepping import Stepping
from torchscope.tui.screens.main.values import Values
from torchscope.tui.widgets.alert_list import AlertList
from torchscope.tui.widgets.detail_panel import DetailPanel
from torchscope.tui.widgets.filter_input import FilterInput
from torchscope.tui.widgets.graph_tree import GraphTree
from torchscope.tui.widgets.key_bar import KeyBar
from torchscope.tui.widgets.op_timeline import OpTimeline
from torchscope.tui.widgets.source_bar import SourceBar
from torchscope.tui.widgets.status_bar import StatusBar
from torchscope.tui.widgets.step_list import StepList
from torchscope.tui.widgets.virtual_list import VirtualList


class MainScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = bindings("main")  # all of them in keys.py

    #: what the middle shows: "timeline" or "graph" (its ContentSwitcher follows)
    center: var[str] = var("timeline")
    #: live: the newest step is shown as it grows (any move in the timeline stops it)
    follow: var[bool] = var(False)

    def __init__(self, host: Host, *, live: bool = False, at_origin: bool = True) -> None:
        super().__init__(id="main")
        self.host = host
        self.at_origin = at_origin
        self.values: ValuesView | None = None
        self.current_step: int | None = None
        self.back_stack: list[Location] = []
        self.pending: Location | None = None
        self._detail_pending = False
        self._detail_pending_over: tuple | None = None  # the detail's subject at the last move
        self.ready = False
        self.search: FieldPattern | None = None
        # what @ / E asked of the job's next step: (text, answered, the job's step then)
        self.asked: Asked | None = None
        self.expressions: list[str] = []
        self.shown = ShownStep(self)
        self.panels = Panels(self, resized=self.shown.sparkline)
        self.nav = Navigation(self)
        self.stepping = Stepping(self)
        self.pause = PauseMarks(self)
        self.tensor_values = Values(self)
        self.evaluator = Evaluate(self)
        self.finder = Search(self)
        self.lane_view = LaneView(self)
        self.graph_view = GraphView(self)
        self.sharing = Sharing(self)
        self.history_plot = RunHistoryPlot(self)
        self.alert_view = AlertsView(
            self, jump=self.nav.jump_to_alert, plot_at=self.history_plot.open
        )

    @property
    def store(self) -> EventStore:
        return self.host.store

    @property
    def live(self) -> bool:
        return self.host.source.mode == "live"

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield StepList(id="steps")
                yield AlertList(id="alerts")
            with Vertical(id="center"):
                with ContentSwitcher(initial="timeline", id="switch"):
                    yield OpTimeline(id="timeline")
                    yield GraphTree(id="graph")
                yield FilterInput(id="filter")
            yield DetailPanel(id="detail")
        with Horizontal(id="progress-row"):
            yield Label("", id="progress-label")
            yield ProgressBar(id="progress", show_eta=False)
        yield SourceBar(id="sources")  # several sources only (hidden otherwise)
        yield StatusBar(id="status")
        yield KeyBar(id="keys")

    def on_mount(self) -> None:
        self.steps = self.query_one(StepList)
        self.timeline = self.query_one(OpTimeline)
        self.graph = self.query_one(GraphTree)
        self.detail = self.query_one(DetailPanel)
        self.alerts = self.query_one(AlertList)
        self.filter = self.query_one(FilterInput)
        self.switch = self.query_one(ContentSwitcher)
        self.status_bar = self.query_one(StatusBar)
        self.key_bar = self.query_one(KeyBar)
        self.progress_row = self.query_one("#progress-row")
        self.progress_label = self.query_one("#progress-label", Label)
        self.progress_bar = self.query_one(ProgressBar)
        self.steps.bind_store(self.store)
        self.steps.border_title = "Steps"
        self.alerts.border_title = "Alerts"
        self.detail.border_title = "Detail"
        self.graph.border_title = "Backward graph"
        self.timeline.live = self.live
        self.ready = True  # the widgets are found: the watchers below may use them
        self.follow = self.live
        self.refresh_title()
        self.detail.show_message("select an op or a backward node")
        self.timeline.set_step(self.store, None, None, "waiting for events…")
        self.timeline.focus()
        self.refresh_status()
        host = self.host
        subscribe(host.applied, self, self._applied)
        subscribe(host.restarted, self, self._restarted)
        subscribe(host.lane_switch, self, self.lane_view.switch)
        subscribe(host.redraw, self, self._redraw)
        host.screen_ready()

    # -- what the app tells ------------------------------------------------------------------
    def _applied(self, applied: Applied) -> None:
        ch = applied.changes
        if applied.shown:
            self.apply_changes(ch)
            if ch.status or ch.events or ch.replies or ch.paused_changed:
                self.refresh_status()
            self.lane_view.land_aligned()
        elif (ch.alerts_added or ch.session) and self.host.multi:
            self.alert_view.refresh()  # the job's view of the alerts holds every rank's
            if ch.alerts_added and not self.host.lanes[applied.lane].live:
                self.stepping.open_at_first_origin()  # the job's origin may be on this rank

    def _restarted(self, lane: int) -> None:
        if lane == self.host.current:
            self.restart()

    def _redraw(self, redraw: Redraw) -> None:
        if redraw.status:
            self.refresh_status()
        if redraw.bar:
            self.refresh_sources()

    def refresh_sources(self) -> None:
        """The source bar: every lane, which is shown, which paused (several sources)."""
        if not self.ready:
            return
        host = self.host
        self.query_one(SourceBar).show(host.lanes, host.labels(), host.current, host.scope)

    def restart(self) -> None:
        """Start over on a fresh store (the followed job began a new run)."""
        self.current_step = None
        self.back_stack = []
        self.pending = None
        self.pause.forget()
        self.values = None
        self.follow = self.live
        self.steps.bind_store(self.store)
        self.set_class(self.store.has_aten, "-aten")
        self.steps.refresh_rows()
        self.alert_view.refresh()  # the old run's alerts went with its store
        if self.center == "graph":
            self.center = "timeline"
        self.detail.show_message("select an op or a backward node")
        self.timeline.set_step(self.store, None, None, "new run: waiting for events…")
        self.refresh_title()
        self.refresh_status()

    def watch_center(self, center: str) -> None:
        if self.ready:
            self.switch.current = center

    # -- the panels: width, + maximise, help (panels.py) -------------------------------------
    def on_resize(self) -> None:
        self.panels.resize()

    def on_descendant_blur(self, event: events.DescendantBlur) -> None:
        self.call_after_refresh(self.panels.side_for_focus)

    @property
    def maximised(self) -> str | None:
        return self.panels.maximised

    def action_maximize_panel(self) -> None:
        self.panels.maximize()

    def hints(self) -> list[Hint]:
        """The key bar, most useful first (it shows what fits)."""
        return key_hints(self, maximised=self.maximised is not None, ready=self.ready)

    def help_section(self) -> str | None:
        return self.panels.help_section()

    def refresh_title(self) -> None:
        step = self.current_step
        info = self.store.info(step) if step is not None else None
        title = "Timeline" if step is None else f"Step {step}"
        loading = self.store.loading.get(step) if step is not None else None
        if loading is not None:
            title += f" · loading… {loading[2]:,} events so far"
        elif info is not None:
            title += f" · {plural(info.n_ops, 'op')} · {plural(info.nodes, 'node')}"
            if info.n_aten:
                title += f" · {info.n_aten:,} aten calls"
        self.timeline.border_title = title
        sub = []
        if self.search is not None:
            sub.append(self.finder.text())
        if self.timeline.pattern is not None:
            sub.append(f"/{self.timeline.pattern.pattern}/ {self.timeline.row_count():,} shown")
        if self.timeline.unfold_all:
            sub.append("all aten calls shown (A)")
        if self.live:
            sub.append("following" if self.follow else "following off (f)")
        self.timeline.border_subtitle = " · ".join(sub)

    # -- applying a batch --------------------------------------------------------------------
    def apply_changes(self, ch: Changes) -> None:
        store = self.store
        if ch.session and store.session is not None:
            cwd = store.session.get("cwd")
            if isinstance(cwd, str):
                for w in (self.timeline, self.graph, self.detail, self.alerts):
                    w.cwd = cwd
        step = self.shown.apply(ch)
        if ch.alerts_added:
            self.alert_view.refresh()
        if self.pending is not None and self.pending.step in ch.loaded:
            loc, self.pending = self.pending, None
            self.nav.land(loc)
        if not self.live:
            if ch.alerts_added:
                self.stepping.open_at_first_origin()
            self.stepping.loaded(ch)
        self.shown.progress(ch)
        for err in ch.errors:
            self.notify(err, severity="error", timeout=8)
        if step is not None and (step in ch.steps_changed or step in ch.events_changed):
            self.refresh_title()
        if ch.paused_changed:
            self.pause.changed()
        elif self.store.stepper.paused is not None and (
            self.current_step in ch.events_changed or ch.loaded
        ):
            self.sync_pause_marks()  # the paused event's row may have come

    def refresh_status(self) -> None:
        self.key_bar.show(self.hints())
        host = self.host
        self.status_bar.show(
            host.status,
            rate=host.rate.rate(),
            follow=self.follow if self.live else None,
            step=self.current_step,
            resident=self.store.resident_events,
            steps=len(self.store.order),
            stepper=self.store.stepper,
            asked=self._asked_text(),
            edits=len(self.store.edits),
        )

    def _asked_text(self) -> str | None:
        """The status bar's word on what @ / E asked, until the step it asked for is over
        (the job's step two past the one it answered in)."""
        if self.asked is None:
            return None
        text, answered, then = self.asked
        if not answered:
            return f"asking: {text}…"
        now = self.host.status.get("step") if self.live else None
        if type(now) is int and type(then) is int and now >= then + 2:
            self.asked = None
            return None
        return f"asked: {text}"

    # -- the shown step and following the newest (shown_step.py) ----------------------------
    def show_step(self, step: int, *, keep_position: bool = False) -> None:
        self.shown.show(step, keep_position=keep_position)

    def request_step(self, step: int) -> bool:
        return self.shown.request(step)

    def action_prev_step(self) -> None:
        self.shown.step_by(-1)

    def action_next_step(self) -> None:
        self.shown.step_by(1)

    def set_follow(self, on: bool) -> None:
        self.shown.set_follow(on)

    def watch_follow(self, on: bool) -> None:
        if self.ready:
            self.shown.follow_changed(on)

    def action_follow(self) -> None:
        self.shown.follow_key()

    def on_op_timeline_follow_changed(self, event: OpTimeline.FollowChanged) -> None:
        self.set_follow(event.following)

    # -- list events -------------------------------------------------------------------------
    def on_virtual_list_highlighted(self, event: VirtualList.Highlighted) -> None:
        if event.widget is self.steps:
            if event.user:
                self.shown.from_step_list()
        elif event.widget is self.timeline:
            if event.user:
                self.show_detail()
            else:
                # Moves made for the user (follow mode, at up to 30 per second) refresh the
                # detail at most a few times a second: a detail re-layout is the costly part.
                self._detail_pending_over = self.detail.subject  # as at the latest move
                if not self._detail_pending:
                    self._detail_pending = True
                    self.set_timer(0.2, self._show_followed_detail)

    def _show_followed_detail(self) -> None:
        self._detail_pending = False
        # The user has since opened the graph or gone to the alerts: what they look at there
        # owns the detail now. So does an alert or a node put in the detail after the move
        # (on a loaded machine this refresh can come seconds late).
        subject = self.detail.subject
        taken = subject != self._detail_pending_over and subject and subject[0] in ("alert", "node")
        if self.center == "timeline" and not self.alerts.has_focus and not taken:
            self.show_detail()

    def show_detail(self) -> None:
        self._detail_pending = False
        row = self.timeline.current_row()
        if row is None or (self.current_step is None and not row.pending):
            return
        data = self.store.data(self.current_step)
        pause = self.store.stepper.paused
        if pause is not None and self.is_paused_row(row):
            self.detail.show_row(self.store, data, row, pause, self.values_for(pause))
        else:
            self.detail.show_row(self.store, data, row)

    def on_virtual_list_selected(self, event: VirtualList.Selected) -> None:
        if event.widget is self.steps:
            self.timeline.focus()
        elif event.widget is self.timeline:
            row = self.timeline.row(event.index)
            if row is not None:
                self.nav.jump_from_row(row)

    # -- graph -------------------------------------------------------------------------------
    def action_toggle_graph(self) -> None:
        self.graph_view.toggle()

    def action_escape(self) -> None:
        """Back to the timeline, from wherever: a maximised panel, the graph, a side panel."""
        if self.maximised is not None:
            self.panels.restore()
            return
        if self.center == "graph":
            self.show_timeline()
        elif self.search is not None and self.timeline.has_focus:
            self.search = None  # esc in the timeline ends a search
            self.refresh_title()
            self.refresh_status()
        else:
            self.timeline.focus()

    def action_unfold_all(self) -> None:
        """``A``: every op's and node's aten calls shown in the timeline, in every step and
        as rows come ⇄ all folded again."""
        if not self.store.has_aten:
            self.notify("no aten calls in this trace (record with --aten)", timeout=3)
            return
        self.timeline.set_unfold_all(not self.timeline.unfold_all)
        if self.center == "timeline":  # the cursor may have gone from a call to its row
            self.show_detail()
        self.refresh_title()
        self.refresh_status()

    def action_group_modules(self) -> None:
        self.graph_view.group_modules()

    def graph_title(self) -> None:
        self.graph_view.title()

    def show_graph(self, node: int | None = None) -> None:
        self.graph_view.show(node)

    def show_timeline(self) -> None:
        self.graph_view.hide()

    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        self.graph_view.node_highlighted(event)

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        self.graph_view.node_selected(event)

    # -- alerts (alerts.py) -----------------------------------------------------------------
    def action_alerts(self) -> None:
        self.alert_view.key()

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        if event.control is self.alerts:
            self.alert_view.highlighted(event.option_index)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        if event.widget is self.alerts:
            self.alert_view.focused()
        self.panels.side_for_focus()
        if self.ready:
            self.key_bar.show(self.hints())

    def on_alert_list_jump(self, event: AlertList.Jump) -> None:
        self.alert_view.jump(event.alert)

    def on_alert_list_jump_to_lane(self, event: AlertList.JumpToLane) -> None:
        event.stop()
        self.alert_view.jump_to_lane(event.lane, event.alert)

    # -- search, filter, go to, export: the prompt (its modes: prompt.py) ------------------
    def open_prompt(self, name: str) -> None:
        if self.center == "graph" and name in ("search", "filter"):
            name = "graph" if name == "search" else "graph-filter"  # the graph's own nodes
        elif self.center == "graph":
            self.show_timeline()
        mode = MODES[name]()
        prompt = self.filter
        prompt.set_mode(mode)
        value = mode.opened(self)
        with prompt.prevent(Input.Changed):
            prompt.value = value
        prompt.display = True
        prompt.focus()
        self.refresh_title()

    def action_search(self) -> None:
        self.open_prompt("search")

    def action_filter(self) -> None:
        self.open_prompt("filter")

    def action_command_line(self) -> None:
        self.open_prompt("command")

    def close_prompt(self) -> None:
        self.filter.ok()
        self.filter.display = False
        self.timeline.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        prompt = self.filter
        if event.input is not prompt or prompt.mode is None:
            return
        prompt.ok()
        if not prompt.mode.regex:
            return
        try:
            pattern = compile_filter(event.value)
        except re.error as exc:
            prompt.error(f"invalid regex: {exc}")
            return
        prompt.mode.typed(self, pattern)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        # the value at enter, not the box's now: a key typed after enter can land in the box
        # before this message is handled
        if event.input is self.filter and self.filter.mode is not None:
            self.filter.mode.submitted(self, event.value)

    def on_filter_input_cancelled(self, event: FilterInput.Cancelled) -> None:
        if self.filter.mode is not None:
            self.filter.mode.cancelled(self)

    def start_search(self) -> None:
        self.finder.start()

    def back_to_search_origin(self) -> None:
        self.finder.back_to_origin()

    def matches(self) -> list[tuple[int, int]]:
        return self.finder.matches()

    def to_match(
        self, direction: int, *, include_current: bool = False, origin: bool = False
    ) -> bool:
        return self.finder.to_match(direction, include_current=include_current, origin=origin)

    def action_next_match(self) -> None:
        self.finder.step(1)

    def action_prev_match(self) -> None:
        self.finder.step(-1)

    def clear_filter(self) -> None:
        """Drop the timeline's filter (a row it hides is to be selected)."""
        self.timeline.set_filter(None)
        self.refresh_title()

    # -- export ------------------------------------------------------------------------------
    def action_export(self) -> None:
        """``e``: the step (or the filtered rows) to a JSON-lines file; asks where first.
        On the paused event's row: edit its tensor in focus (evaluate.py)."""
        if self.evaluator.edit_at_pause():
            return
        if self.current_step is None or self.store.data(self.current_step) is None:
            self.notify("no step in memory to export yet", timeout=3)
            return
        self.open_prompt("export")

    # -- y (sharing.py), H (run_history.py) --------------------------------------------------
    def selected_event(self) -> tuple[dict | None, str | None]:
        return self.sharing.selected_event()

    def action_copy(self) -> None:
        self.sharing.copy()

    def action_history(self) -> None:
        self.history_plot.open()

    # -- misc --------------------------------------------------------------------------------
    def action_stat_mode(self) -> None:
        mode = "mean" if self.timeline.stat_mode == "norm" else "norm"
        self.timeline.set_stat_mode(mode)
        self.notify("stat column: " + ("mean±std" if mode == "mean" else "norm"), timeout=2)

    # -- moving (navigation.py) --------------------------------------------------------------
    def go(self, loc: Location, *, record: bool = True) -> None:
        self.nav.go(loc, record=record)

    def select_in_timeline(self, kind: str | None, seq: int) -> bool:
        return self.nav.select_in_timeline(kind, seq)

    def run_command(self, text: str) -> str | None:
        """Run a ``:`` command; None when it went, else the one-line reason it did not."""
        return self.nav.run_command(text)

    def on_detail_panel_follow(self, event: DetailPanel.Follow) -> None:
        self.nav.follow_link(event.link)

    def action_detail_link(self, i: int) -> None:
        """A click on link ``i`` of the detail."""
        self.detail.follow(i)

    def action_back(self) -> None:
        self.nav.back()

    # -- stepping (stepping.py) --------------------------------------------------------------
    def action_pause(self) -> None:
        self.stepping.pause()

    def action_step(self) -> None:
        self.stepping.key("s", "step")

    def action_next(self) -> None:
        self.stepping.key("n", "next")

    def action_continue(self) -> None:
        self.stepping.key("c", "continue")

    def action_step_back(self) -> None:
        self.stepping.key("S")

    def action_prev(self) -> None:
        self.stepping.key("N")

    def action_continue_back(self) -> None:
        self.stepping.key("C")

    def action_aten_next(self) -> None:
        self.stepping.aten_next()

    def action_eager_check(self) -> None:
        self.stepping.eager_check()

    def action_break_here(self) -> None:
        self.stepping.break_here()

    def action_breakpoints(self) -> None:
        self.stepping.breakpoints()

    # -- the pause (pause.py) and its values (values.py) -------------------------------------
    def is_paused_row(self, row: Row | PendingRow) -> bool:
        return self.pause.is_paused_row(row)

    def sync_pause_marks(self) -> None:
        self.pause.sync()

    def select_paused(self) -> bool:
        return self.pause.select()

    def values_for(self, pause: dict) -> ValuesView:
        return self.pause.values_for(pause)

    def action_values(self) -> None:
        self.tensor_values.cycle()

    def action_next_slice(self) -> None:
        self.tensor_values.next_slice()

    def action_prev_slice(self) -> None:
        self.tensor_values.prev_slice()

    def action_first_nan(self) -> None:
        self.tensor_values.first_nan()

    # -- p / e at a pause (evaluate.py) ------------------------------------------------------
    def action_evaluate(self) -> None:
        self.evaluator.open()

    def evaluate(self, text: str) -> None:
        self.evaluator.evaluate(text)

    def edit(self, text: str) -> None:
        self.evaluator.edit(text)

    def cancel_evaluation(self) -> None:
        self.evaluator.cancel()

    # -- several sources (lanes.py) ----------------------------------------------------------
    def action_mark(self) -> None:
        self.lane_view.mark()

    def action_compare(self) -> None:
        self.lane_view.compare()
