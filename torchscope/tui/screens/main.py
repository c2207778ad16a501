"""The one screen, for live sessions and replays alike.

It reads only the app's :class:`~torchscope.tui.store.EventStore` and asks the source for steps
that are not in memory (``request_step``); whether a file or a socket answers is not its
concern. ``apply_changes`` is called by the app's timer, once per batch.

Step-through keys (live): ``space`` pause, ``s`` step, ``n`` next step, ``c`` continue, ``b``
breakpoint from the selected event, ``B`` the breakpoint list, ``v`` / ``<`` / ``>`` values of
the paused event's tensors. They go to the job through ``TorchscopeApp.command``; the job's
answers come back through the store (its ``stepper`` view) and ``apply_changes``. A replay
refuses them with a message.

``@`` and ``E`` ask a live job for more in its next step: ``arm`` with ``next=1`` and
``also`` (a hold beside the UI's own, which stays): at the aten level (inside the selected
row's module, or everywhere), or with each compiled module's call run once more eagerly and
compared. The status bar says what was asked until that step is over.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Input, Label, OptionList, ProgressBar, Tree

from torchscope.protocol.breakpoints import BreakpointError
from torchscope.protocol.events import ATEN, GRAD, OP, Event
from torchscope.tui import keys
from torchscope.tui.format import plural, short_name
from torchscope.tui.keys import Hint, bindings, hint
from torchscope.tui.replay_stepping import Landed, NeedStep, ReplayCursor, Stay
from torchscope.tui.screens.breakpoints import BreakHereScreen, BreakpointsScreen
from torchscope.tui.stepping import (
    ValuesView,
    default_choice,
    event_name,
    pause_event,
    pause_key,
    spec_text,
    tensor_choices,
)
from torchscope.tui.store import (
    EVICTED,
    FLAG_INF_IN,
    FLAG_INF_OUT,
    FLAG_NAN_IN,
    FLAG_NAN_OUT,
    LOADING,
    ON_DISK,
    AtenRow,
    Changes,
    EventStore,
    FieldPattern,
    PendingRow,
    Row,
    compile_filter,
)
from torchscope.tui.widgets.alert_list import AlertList
from torchscope.tui.widgets.detail_panel import DetailPanel, Link
from torchscope.tui.widgets.filter_input import FilterInput
from torchscope.tui.widgets.graph_tree import GraphTree
from torchscope.tui.widgets.key_bar import KeyBar
from torchscope.tui.widgets.op_timeline import OpTimeline
from torchscope.tui.widgets.source_bar import SourceBar
from torchscope.tui.widgets.status_bar import StatusBar
from torchscope.tui.widgets.step_list import StepList
from torchscope.tui.widgets.virtual_list import VirtualList

if TYPE_CHECKING:
    from torchscope.tui.app import TorchscopeApp

_HISTORY = 64
# A row's NaN/Inf flags (its other flags, FLAG_ACCUMULATE, say nothing of its values).
NAN_INF = FLAG_NAN_IN | FLAG_INF_IN | FLAG_NAN_OUT | FLAG_INF_OUT


@dataclass(frozen=True)
class Location:
    """Where a jump starts or lands."""

    view: str  # "timeline" or "graph"
    step: int
    kind: str | None = None  # op / grad (timeline); None: whichever has this seq
    seq: int | None = None
    node: int | None = None  # graph


class MainScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = bindings("main")  # all of them in keys.py

    def __init__(self, *, live: bool = False, at_origin: bool = True) -> None:
        super().__init__(id="main")
        self.at_origin = at_origin
        self.values: ValuesView | None = None
        self._pending: tuple[Any, PendingRow] | None = None
        self.current_step: int | None = None
        self.follow = False
        self.history: list[Location] = []
        self.pending: Location | None = None
        self.center = "timeline"
        self._progress_visible = False
        self._count_progress: tuple[float, float, str] | None = None
        self._detail_pending = False
        self.ready = False
        self.search: FieldPattern | None = None
        self._search_origin: tuple[str, int] | None = None
        self._match_cache: tuple[tuple, list[int]] | None = None
        # what @ / E asked of the job's next step: (text, answered, the job's step then)
        self.asked: tuple[str, bool, int | None] | None = None
        # a recording's cursor (its store, the cursor) and the move waiting for a step to load
        self._replay: tuple[EventStore, ReplayCursor] | None = None
        self._replay_wait: tuple[str, int] | None = None
        self._replay_landing: Landed | None = None  # landed in a step still loading
        # stores whose recording was opened at its first NaN/Inf origin (or that the user
        # moved in before one was counted): each recording opens there once
        self._opened: set[int] = set()

    @property
    def tapp(self) -> TorchscopeApp:
        return self.app  # type: ignore[return-value]

    @property
    def store(self) -> EventStore:
        return self.tapp.store

    @property
    def live(self) -> bool:
        return self.tapp.source.mode == "live"

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
        self.steps.bind_store(self.store)
        self.steps.border_title = "Steps"
        self.alerts.border_title = "Alerts"
        self.detail.border_title = "Detail"
        self.graph.border_title = "Backward graph"
        self.timeline.live = self.live
        self.follow = self.live
        self.timeline.follow = self.follow
        self._title()
        self.detail.show_message("select an op or a backward node")
        self.timeline.set_step(self.store, None, None, "waiting for events…")
        self.timeline.focus()
        self.refresh_status()
        self.ready = True

    def restart(self) -> None:
        """Start over on a fresh store (the followed job began a new run)."""
        self.current_step = None
        self.history = []
        self.pending = None
        self._pending = None
        self.values = None
        self.follow = self.live
        self.timeline.follow = self.follow
        self.steps.bind_store(self.store)
        self.set_class(self.store.has_aten, "-aten")
        self.steps.refresh_rows()
        self.alerts.set_alerts(self.store.alerts)  # the old run's alerts went with its store
        if self.center == "graph":
            self.center = "timeline"
            self.switch.current = "timeline"
        self.detail.show_message("select an op or a backward node")
        self.timeline.set_step(self.store, None, None, "new run: waiting for events…")
        self._title()
        self.refresh_status()

    #: Below these widths the layout changes: the detail goes under the timeline (stacked:
    #: both get the full width), narrower side panels, then (compact) the steps/alerts
    #: column folds away (shown alone while it has the focus).
    WIDE = 150
    NARROW = 120
    COMPACT = 100

    def on_resize(self) -> None:
        width = self.size.width
        self.set_class(self.COMPACT <= width < self.WIDE, "-stacked")
        self.set_class(width < self.NARROW, "-narrow")
        self.set_class(width < self.COMPACT, "-compact")
        self._side_for_focus()
        self.call_after_refresh(self._steps_sparkline)

    def _side_for_focus(self) -> None:
        focused = self.focused
        side = focused is not None and focused in (self.steps, self.alerts)
        self.set_class(side and self.has_class("-compact"), "-side")

    def on_descendant_blur(self, event: events.DescendantBlur) -> None:
        self.call_after_refresh(self._side_for_focus)

    MAX_CLASSES = ("-max-center", "-max-detail", "-max-steps", "-max-alerts")

    @property
    def maximised(self) -> str | None:
        """Which panel ``+`` maximised ("center", "detail", "steps", "alerts"), if any."""
        return next((c[5:] for c in self.MAX_CLASSES if self.has_class(c)), None)

    def action_maximize_panel(self) -> None:
        """lazygit's ``+``: the focused panel takes the whole screen; again (or esc): back."""
        if self.maximised is not None:
            self._restore()
            return
        focus = self.focused
        if focus is self.detail or (focus is not None and self.detail in focus.ancestors):
            panel = "detail"
        elif focus is self.steps:
            panel = "steps"
        elif focus is self.alerts:
            panel = "alerts"
        else:
            panel = "center"
        self.add_class(f"-max-{panel}")
        self.refresh_status()
        self.call_after_refresh(self._steps_sparkline)

    def _restore(self) -> None:
        self.remove_class(*self.MAX_CLASSES)
        self.refresh_status()
        self.call_after_refresh(self._steps_sparkline)

    def hints(self) -> list[Hint]:
        """The key bar, most useful first (it shows what fits)."""
        live = self.live
        paused = self.store.stepper.paused is not None
        focus = self.focused
        out: list[Hint] = []
        if paused:
            out += [hint("step"), hint("next"), hint("continue")]
            if not live:
                out += [hint("step_back")]
        elif live:
            out += [hint("pause"), hint("continue")]
        out += self.tapp.lane_hints()  # several sources: 1-9, o, x
        out += [hint("break_here"), hint("breakpoints")]
        out += [hint("search")]
        if focus is not self.graph:
            out += [hint("toggle_graph")]
        out += [hint("alerts")]
        if paused and live:
            out += [hint("values")]
        if focus is self.graph:
            out += [
                hint("enter", "op"),
                hint("toggle_graph", "timeline"),
                hint("group_modules", "chains" if self.graph.by_module else None),
            ]
        elif focus is self.alerts:
            out += [hint("enter", "go to alert")]
        elif focus is self.detail:
            out += [("↑↓", "link", "link"), hint("enter", "follow"), hint("escape", "timeline")]
        else:
            out += [hint("enter")]
        if self.search is not None or (focus is self.graph and self.graph.search is not None):
            out += [hint("next_match")]
        out += [hint("command_line"), hint("prev_step")]
        out += [hint("back")]
        out += [hint("maximize_panel", "restore" if self.maximised is not None else None)]
        if live:
            out += [hint("follow")]
        row = self.timeline.current_row() if self.ready else None
        if paused or (row is not None and row.flags & NAN_INF):
            out += [hint("first_nan")]
        out += [hint("copy"), hint("export")]
        out += [hint("filter"), hint("tab"), hint("stat_mode"), hint("↑↓ j k")]
        if self.store.has_aten:
            out += [hint("unfold_all", "fold aten" if self.timeline.unfold_all else None)]
        return out

    def help_section(self) -> str | None:
        """The help's section for the focused panel (``?`` shows it right after stepping)."""
        focus = self.focused
        if focus is self.graph:
            return keys.GRAPH
        if focus is self.detail:
            return keys.DETAIL
        if focus is self.alerts:
            return keys.ALERTS
        if focus is self.timeline:
            return keys.TIMELINE
        return None

    def _title(self) -> None:
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
            sub.append(self._search_text())
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
        if ch.steps_added or ch.steps_changed or ch.evicted or ch.removed:
            self.set_class(store.has_aten, "-aten")  # room for the steps' aten call counts
            self.steps.refresh_rows()
            self._steps_sparkline()
        if self.current_step in ch.removed:  # an empty trailing step, dropped
            self.current_step = None
            if self.pending is not None and self.pending.step in ch.removed:
                self.pending = None
        if self.current_step is None and store.order:
            first = store.newest_step if self.follow else store.order[0]
            self.show_step(first)
        elif (
            self.follow
            and store.newest_step is not None
            and (store.newest_step != self.current_step)
        ):
            self.show_step(store.newest_step)
        step = self.current_step
        if step is not None:
            if step in ch.loaded or step in ch.started:
                self.show_step(step, keep_position=True)
            elif step in ch.evicted and store.data(step) is None:
                self.show_step(step)  # its load was given up: ask again
            elif step in ch.events_changed:
                self.timeline.data_changed()
                if self.center == "graph":
                    self.graph.set_step(store, store.data(step))
            elif step in ch.steps_changed:
                info = store.info(step)
                if info is not None and info.state == EVICTED and store.data(step) is None:
                    self.show_step(step)
        if ch.alerts_added:
            self.alerts.set_alerts(store.alerts)
        if self.pending is not None and self.pending.step in ch.loaded:
            loc, self.pending = self.pending, None
            self._land(loc)
        if not self.live:
            if ch.alerts_added:
                self._open_at_first_origin()
            self._replay_loaded(ch)
        if ch.progress is not None:
            self._count_progress = ch.progress
        elif ch.progress_done:
            self._count_progress = None
        if ch.progress is not None or ch.progress_done or ch.events_changed or ch.evicted:
            self._update_progress()
        for err in ch.errors:
            self.notify(err, severity="error", timeout=8)
        if step is not None and (step in ch.steps_changed or step in ch.events_changed):
            self._title()
        if ch.paused_changed:
            self._pause_changed()
        elif self.store.stepper.paused is not None and (
            self.current_step in ch.events_changed or ch.loaded
        ):
            self._sync_pause_marks()  # the paused event's row may have come

    def refresh_status(self) -> None:
        self.key_bar.show(self.hints())
        app = self.tapp
        self.status_bar.show(
            app.status,
            rate=app.rate.rate(),
            follow=self.follow if self.live else None,
            step=self.current_step,
            resident=self.store.resident_events,
            steps=len(self.store.order),
            stepper=self.store.stepper,
            asked=self._asked_text(),
        )

    def _asked_text(self) -> str | None:
        """The status bar's word on what @ / E asked, until the step it asked for is over
        (the job's step two past the one it answered in)."""
        if self.asked is None:
            return None
        text, answered, then = self.asked
        if not answered:
            return f"asking: {text}…"
        now = self.tapp.status.get("step") if self.live else None
        if type(now) is int and type(then) is int and now >= then + 2:
            self.asked = None
            return None
        return f"asked: {text}"

    def _steps_sparkline(self, *, force: bool = False) -> None:
        """The steps panel's subtitle: gradient norms (or losses) across all steps."""
        key = (self.store.overview_version, len(self.store.order), self.steps.size.width)
        if key == getattr(self, "_spark_key", None) and not force:
            return
        self._spark_key = key
        self.steps.border_subtitle = self.steps.sparkline(max(0, self.steps.size.width - 6))

    def _update_progress(self) -> None:
        """The progress row: the shown step streaming in, else the source's own progress (a
        scan, the count pass)."""
        step = self.current_step
        loading = self.store.loading.get(step) if step is not None else None
        if loading is not None:
            done, total, events = loading
            info = self.store.info(step)
            expect = info.n_events if info is not None and info.counted else 0
            if expect >= events > 0:
                self._show_progress(
                    f"loading step {step}: {events:,} of {expect:,} events", events, expect
                )
            else:
                self._show_progress(
                    f"loading step {step}: {events:,} events, part {done} of {total}", done, total
                )
        elif self._count_progress is not None:
            done, total, label = self._count_progress
            self._show_progress(label, done, total)
        else:
            self._show_progress(None)

    def _show_progress(self, label: str | None, done: float = 0, total: float = 0) -> None:
        row = self.query_one("#progress-row")
        if label is None:
            row.display = False
            self._progress_visible = False
            return
        row.display = True
        self._progress_visible = True
        self.query_one("#progress-label", Label).update(label)
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)

    # -- steps -------------------------------------------------------------------------------
    def show_step(self, step: int, *, keep_position: bool = False) -> None:
        store = self.store
        if step not in store:
            return
        self.current_step = step
        store.pin({step})
        self.steps.select_step(step)
        data = store.data(step)
        message = ""
        if data is None:
            info = store.steps[step]
            source = self.tapp.source
            if info.state in (ON_DISK, LOADING) or (
                info.state == EVICTED and source.can_reload and info.state != LOADING
            ):
                if info.state != LOADING:
                    store.mark_loading(step)
                    source.request_step(step)
                    self.steps.refresh_rows()
                message = f"loading step {step}…"
            else:
                message = (
                    f"step {step} is no longer in memory "
                    "(the UI keeps the newest steps; record the job to replay older ones)"
                )
        keep = self.timeline.current_row() if keep_position else None
        self.timeline.set_step(store, step, data, message)
        if keep is not None:
            self.timeline.select(keep.kind, keep.seq, center=True)
        if self.center == "graph":
            self.graph.set_step(store, data, message)
        self._sync_pause_marks()
        if data is None and self.timeline.pending is None:
            self.detail.show_message(message)
        elif data is not None and self.timeline.row_count() == 0:
            self.detail.show_message(self.timeline.empty_text())
        self._title()
        self._update_progress()
        self.refresh_status()

    def action_prev_step(self) -> None:
        self._step_by(-1)

    def action_next_step(self) -> None:
        self._step_by(1)

    def _step_by(self, delta: int) -> None:
        order = self.store.order
        if not order:
            return
        i = self.store.step_index(self.current_step) if self.current_step is not None else None
        i = 0 if i is None else max(0, min(len(order) - 1, i + delta))
        self._set_follow(False)
        self.show_step(order[i])

    # -- follow ------------------------------------------------------------------------------
    def _set_follow(self, on: bool) -> None:
        if not self.live:
            on = False
        if on == self.follow:
            return
        self.follow = on
        self.timeline.follow = on
        if on and self.store.newest_step is not None:
            if self.store.newest_step != self.current_step:
                self.show_step(self.store.newest_step)
            self.timeline.data_changed()
        self._title()
        self.refresh_status()

    def action_follow(self) -> None:
        """Follow the newest step (live). Pressed while following, it stays on (any move in
        the timeline turns it off; ``end`` or ``f`` turn it on again)."""
        if not self.live:
            self.notify(
                "f follows a live job's newest step; a recording does not grow "
                "([ ] or :N move between steps)",
                timeout=4,
            )
            return
        if self.follow:
            newest = self.store.newest_step
            if newest is not None and newest != self.current_step:
                self.show_step(newest)
            self.timeline.data_changed()  # back to the newest row
            self.notify("following the newest step (any move stops it)", timeout=2)
            return
        self._set_follow(True)

    def on_op_timeline_follow_changed(self, event: OpTimeline.FollowChanged) -> None:
        self._set_follow(event.following)

    # -- list events -------------------------------------------------------------------------
    def on_virtual_list_highlighted(self, event: VirtualList.Highlighted) -> None:
        if event.widget is self.steps:
            step = self.steps.step_at(event.index)
            if event.user and step is not None and step != self.current_step:
                if step != self.store.newest_step:
                    self._set_follow(False)
                self.show_step(step)
        elif event.widget is self.timeline:
            if event.user:
                self._show_detail()
            elif not self._detail_pending:
                # Moves made for the user (follow mode, at up to 30 per second) refresh the
                # detail at most a few times a second: a detail re-layout is the costly part.
                self._detail_pending = True
                self.set_timer(0.2, self._show_followed_detail)

    def _show_followed_detail(self) -> None:
        self._detail_pending = False
        # The user has since opened the graph or gone to the alerts: what they look at there
        # owns the detail now.
        if self.center == "timeline" and not self.alerts.has_focus:
            self._show_detail()

    def _show_detail(self) -> None:
        self._detail_pending = False
        row = self.timeline.current_row()
        if row is None or (self.current_step is None and not row.pending):
            return
        data = self.store.data(self.current_step)
        pause = self.store.stepper.paused
        if pause is not None and self._is_paused_row(row):
            self.detail.show_row(self.store, data, row, pause, self._values_for(pause))
        else:
            self.detail.show_row(self.store, data, row)

    def on_virtual_list_selected(self, event: VirtualList.Selected) -> None:
        if event.widget is self.steps:
            self.timeline.focus()
        elif event.widget is self.timeline:
            row = self.timeline.row(event.index)
            if row is not None:
                self._jump_from_row(row)

    # -- graph -------------------------------------------------------------------------------
    def action_toggle_graph(self) -> None:
        if self.center == "graph":
            self._show_timeline_from_graph()
        else:
            self._show_graph()

    def action_escape(self) -> None:
        """Back to the timeline, from wherever: a maximised panel, the graph, a side panel."""
        if self.maximised is not None:
            self._restore()
            return
        if self.center == "graph":
            self._show_timeline_from_graph()
        elif self.search is not None and self.timeline.has_focus:
            self.search = None  # esc in the timeline ends a search
            self._title()
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
            self._show_detail()
        self._title()
        self.refresh_status()

    def action_group_modules(self) -> None:
        """``M`` in the graph: group its nodes by module ⇄ chains."""
        if self.center != "graph":
            self.notify("M groups the backward graph by module: g opens the graph", timeout=3)
            return
        by_module = self.graph.toggle_grouping()
        self.notify(
            "graph: module tree with each module's gradient norm (→ opens one)"
            if by_module
            else "graph: chains of nodes",
            timeout=2,
        )
        self._graph_title()
        self.refresh_status()

    def _graph_title(self) -> None:
        graph = self.graph
        sub = ["by module (M: chains)" if graph.by_module else "M: by module"]
        if graph.node_filter is not None:
            kept = graph.shown_count()
            shown = plural(kept, "node")
            sub.insert(0, f"filter /{graph.node_filter.pattern}/ {shown} (| esc: clear)")
        if graph.search is not None:
            n = len(graph.matches)
            at = f"{graph.match_at + 1}/{n}" if n and graph.match_at >= 0 else plural(n, "match")
            sub.insert(0, f"search /{graph.search.pattern}/ {at}")
        graph.border_subtitle = " · ".join(sub)

    def _show_graph(self, node: int | None = None) -> None:
        step = self.current_step
        data = self.store.data(step)
        self.center = "graph"
        self.switch.current = "graph"
        self.graph.set_step(self.store, data, "" if data else self.timeline.message)
        if node is None:
            row = self.timeline.current_row()
            if row is not None and data is not None:
                if row.kind == GRAD:
                    node = row.node_id
                else:
                    ids = data.nodes_of_op(row.seq)
                    node = ids[0] if ids else None
        if node is not None:
            self.graph.reveal(node)
        self._graph_title()
        self.graph.focus()
        hit = self.graph.node_at_cursor()  # the detail follows the graph's cursor from here
        if hit is not None and data is not None:
            self.detail.show_node(self.store, data, *hit)

    def _show_timeline_from_graph(self) -> None:
        node = self.graph.current_node_id()
        self.center = "timeline"
        self.switch.current = "timeline"
        data = self.store.data(self.current_step)
        if node is not None and data is not None:
            grads = data.grads_of_node(node)
            if grads:
                self._select_in_timeline(GRAD, grads[0].seq)
        self.timeline.focus()

    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        if event.control is not self.graph:
            return
        hit = self.graph.node_at_cursor()
        data = self.store.data(self.current_step)
        if hit is not None and data is not None:
            node, call = hit
            self.detail.show_node(self.store, data, node, call)

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        if event.control is not self.graph:
            return
        hit = self.graph.node_at_cursor()
        if hit is None or self.current_step is None:
            return
        node, _ = hit
        op_seq = node.get("op_seq")
        data = self.store.data(self.current_step)
        if isinstance(op_seq, int) and data is not None and data.op(op_seq) is not None:
            self._go(Location("timeline", self.current_step, OP, op_seq))
        elif node.get("param"):
            self.notify(f"{node.get('name')} accumulates into parameter {node['param']}")
        else:
            self.notify(f"{node.get('name')} (node id {node.get('id')}): no forward op recorded")

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
            self._set_follow(False)
            self.show_step(loc.step)
        if self.store.data(loc.step) is None:
            self.pending = loc
            return
        self._land(loc)

    def _land(self, loc: Location) -> None:
        if loc.view == "graph":
            self._show_graph(loc.node)
            return
        if self.center == "graph":
            self.center = "timeline"
            self.switch.current = "timeline"
        if loc.seq is not None and not self._select_in_timeline(loc.kind, loc.seq):
            self.notify(f"event #{loc.seq} is not in step {loc.step}", severity="warning")
        self.timeline.focus()

    def _select_in_timeline(self, kind: str | None, seq: int) -> bool:
        if self.follow:
            self._set_follow(False)
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

    # -- alerts ------------------------------------------------------------------------------
    def action_alerts(self) -> None:
        if not self.store.alerts:
            self.notify("no alerts: no NaN/Inf has appeared", timeout=3)
        self.alerts.focus()

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        # Only while the user is in the list: a new alert highlights itself, and must not take
        # the detail away from the event being looked at (or the job's pause).
        if event.control is self.alerts and self.alerts.has_focus:
            self._show_alert(event.option_index)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        if event.widget is self.alerts and self.alerts.highlighted is not None:
            self._show_alert(self.alerts.highlighted)
        self._side_for_focus()
        if self.ready:
            self.key_bar.show(self.hints())

    def _show_alert(self, index: int) -> None:
        if 0 <= index < len(self.alerts.alerts):
            origin = self.alerts.alerts[index]
            self.detail.show_alert(origin, self.alerts.knock_on_of(origin))

    def on_alert_list_jump(self, event: AlertList.Jump) -> None:
        self.jump_to_alert(event.alert)

    def jump_to_alert(self, alert: Event) -> None:
        step, seq = alert.get("step"), alert.get("event_seq")
        if type(step) is not int or type(seq) is not int or step not in self.store:
            self.notify("this alert does not name an event", severity="warning")
            return
        # forward / input alerts name an op, backward ones a node: the seq says which.
        self._go(Location("timeline", step, None, seq))

    # -- search, filter, go to ---------------------------------------------------------------
    def _open_prompt(self, mode: str) -> None:
        if mode == "search" and self.center == "graph":
            mode = "graph"  # / in the graph searches its nodes
        elif mode == "filter" and self.center == "graph":
            mode = "graph-filter"  # | keeps the nodes it matches
        elif self.center == "graph":
            self._show_timeline_from_graph()
        prompt = self.filter
        prompt.set_mode(mode)
        if mode == "search":
            row = self.timeline.current_row()
            self._search_origin = (row.kind, row.seq) if row is not None else None
            self.search = None
            value = ""
        elif mode == "filter":
            pattern = self.timeline.pattern
            value = pattern.pattern if pattern is not None else ""
        elif mode == "graph":
            self.graph.set_search(None)
            self._graph_title()
            value = ""
        elif mode == "graph-filter":
            keep = self.graph.node_filter
            value = keep.pattern if keep is not None else ""
        elif mode == "export":
            from torchscope.tui.export_view import default_path

            assert self.current_step is not None
            value = default_path(self.current_step, self.timeline.pattern is not None)
            self._export_confirm: str | None = None
        else:
            value = ""
        with prompt.prevent(Input.Changed):
            prompt.value = value
        prompt.display = True
        prompt.focus()
        self._title()

    def action_search(self) -> None:
        self._open_prompt("search")

    def action_filter(self) -> None:
        self._open_prompt("filter")

    def action_command_line(self) -> None:
        self._open_prompt("command")

    def _close_prompt(self) -> None:
        self.filter.ok()
        self.filter.display = False
        self.timeline.focus()

    def _apply_filter(self, pattern: FieldPattern | None) -> None:
        self.timeline.set_filter(pattern)
        self._title()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input is not self.filter or self.filter.mode in ("command", "export"):
            if event.input is self.filter:
                self.filter.ok()
            return
        try:
            pattern = compile_filter(event.value)
        except re.error as exc:
            self.filter.error(f"invalid regex: {exc}")
            return
        self.filter.ok()
        if self.filter.mode == "graph":
            found = self.graph.set_search(pattern)
            if pattern is not None and not found:
                self.filter.error(f"no node matches /{pattern.pattern}/")
            self._graph_title()
            return
        if self.filter.mode == "graph-filter":
            kept = self.graph.set_filter(pattern)
            if pattern is not None and not kept:
                self.filter.error(f"no node matches /{pattern.pattern}/")
            self._graph_title()
            return
        if self.filter.mode == "filter":
            self.timeline.set_filter(pattern)
        else:
            self.search = pattern
            if pattern is None:
                self._back_to_search_origin()
            elif not self._to_match(1, include_current=True, origin=True):
                self.filter.error(f"no match for /{pattern.pattern}/ in this step")
        self._title()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input is not self.filter:
            return
        prompt = self.filter
        if prompt.mode == "export":
            self._export_to(prompt.value)
            return
        if prompt.mode in ("graph", "graph-filter"):
            prompt.ok()
            prompt.display = False
            self.graph.focus()
            self._graph_title()
            return
        if prompt.mode == "command":
            problem = self.run_command(prompt.value)
            if problem:
                prompt.error(problem)
                return
            prompt.ok()
            prompt.display = False
            if self.focused is None or self.focused is prompt:
                (self.graph if self.center == "graph" else self.timeline).focus()
            return
        if prompt.has_class("-invalid") and not prompt.border_title.startswith("no match"):
            self.notify(prompt.border_title or "invalid regex", severity="error")
            return
        self._close_prompt()
        if prompt.mode == "search" and self.search is not None:
            if not self._matches():
                self.notify(f"no match for /{self.search.pattern}/ in this step", timeout=3)
            self._title()

    def on_filter_input_cancelled(self, event: FilterInput.Cancelled) -> None:
        mode = self.filter.mode
        if mode in ("graph", "graph-filter"):
            self.filter.ok()
            self.filter.display = False
            if mode == "graph":
                self.graph.set_search(None)
            else:
                self.graph.set_filter(None)
            self.graph.focus()
            self._graph_title()
            return
        self._close_prompt()
        if mode == "filter":
            self._apply_filter(None)
        elif mode == "search":
            self.search = None
            self._back_to_search_origin()
            self._title()

    def _back_to_search_origin(self) -> None:
        origin = self._search_origin
        if origin is not None:
            self.timeline.select(*origin)

    def _matches(self) -> list[tuple[int, int]]:
        """Where the search matches in the timeline: rows and aten calls, folded or not (see
        ``OpTimeline.match_positions``); cached per step view."""
        if self.search is None:
            return []
        tl = self.timeline
        data = tl.data
        if data is None:
            return []
        shown = tl.row_count() - tl.calls_shown()  # the rows the filter keeps, and the pending
        key = (id(data), len(data.rows), len(data.aten), data.reorders, self.search, shown)
        key += (tl.pattern,)
        if self._match_cache is not None and self._match_cache[0] == key:
            return self._match_cache[1]
        found = tl.match_positions(self.search)
        self._match_cache = (key, found)
        return found

    def _to_match(
        self, direction: int, *, include_current: bool = False, origin: bool = False
    ) -> bool:
        """Move the cursor to the next (1) or previous (-1) match, wrapping around."""
        found = self._matches()
        if not found:
            return False
        tl = self.timeline
        cur = tl.position(tl.cursor)
        if origin and self._search_origin is not None:
            index = tl.index_of(*self._search_origin)
            cur = tl.position(index if index is not None else 0)
        if direction > 0:
            after = bisect.bisect_left if include_current else bisect.bisect_right
            i = after(found, cur)
            wrapped = i >= len(found)
            target = found[0] if wrapped else found[i]
        else:
            i = bisect.bisect_left(found, cur) - 1
            wrapped = i < 0
            target = found[-1] if wrapped else found[i]
        if wrapped and not origin:
            self.notify(
                "search wrapped" + (" to the top" if direction > 0 else " to the bottom"), timeout=2
            )
        self._set_follow(False)
        tl.go_to_position(target)
        self._show_detail()
        self._title()
        return True

    def action_next_match(self) -> None:
        self._step_match(1)

    def action_prev_match(self) -> None:
        self._step_match(-1)

    def _step_match(self, direction: int) -> None:
        if self.center == "graph" and self.graph.search is not None:
            moved = self.graph.next_match(direction)
            if moved is None:
                self.notify(f"no node matches /{self.graph.search.pattern}/", timeout=3)
            elif moved[2]:
                self.notify("search wrapped", timeout=2)
            self._graph_title()
            return
        if self.search is None:
            self.notify("/ searches first (then ctrl+n / ctrl+p: next / previous match)", timeout=3)
            return
        if self.center == "graph":
            self._show_timeline_from_graph()
        if not self._to_match(direction):
            self.notify(f"no match for /{self.search.pattern}/ in this step", timeout=3)

    def _search_text(self) -> str:
        if self.search is None:
            return ""
        found = self._matches()
        cur = self.timeline.position(self.timeline.cursor)
        i = bisect.bisect_left(found, cur)
        at = (
            f"{i + 1}/{len(found)}"
            if i < len(found) and found[i] == cur
            else plural(len(found), "match")
        )
        return f"search /{self.search.pattern}/ {at}"

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
        self._set_follow(False)
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

    # -- step-through ------------------------------------------------------------------------
    def _is_paused_row(self, row: Row | PendingRow) -> bool:
        if row.pending:
            return True
        key = self.timeline.paused_key
        return key is not None and key == (row.kind, row.seq)

    def _pending_row(self, pause: dict) -> PendingRow:
        """One PendingRow per pause (the detail panel knows rows by identity)."""
        key = pause_key(pause)
        if self._pending is None or self._pending[0] != key:
            self._pending = (key, PendingRow(pause_event(pause)))
        return self._pending[1]

    def _sync_pause_marks(self) -> None:
        """Mark the paused event in the timeline: its row, or a pending row when it has none
        (a job paused before an op or node runs)."""
        pause = self.store.stepper.paused
        if pause is None:
            self._pending = None
            self.timeline.set_paused(None, None)
            return
        ev = pause_event(pause)
        step = pause.get("step")
        if type(step) is not int:
            step = ev.get("step")
        here = self.current_step
        if not (type(step) is not int or here is None or step == here or step not in self.store):
            self.timeline.set_paused(None, None)  # paused in another step than the one shown
            return
        kind = ev.get("kind") if ev.get("kind") in (GRAD, ATEN) else OP
        seq = ev.get("seq")
        data = self.store.data(here)
        if data is not None and type(seq) is int and data.has_row(kind, seq):
            self.timeline.set_paused((kind, seq), None)
        else:
            self.timeline.set_paused(None, self._pending_row(pause))

    def _pause_changed(self) -> None:
        """The job paused somewhere else, or went on."""
        stepper = self.store.stepper
        pause = stepper.paused
        if pause is None:
            self.values = None
            self._sync_pause_marks()
            if stepper.resumed_by == "lease":
                self.notify(
                    "the job resumed by itself: its lease ran out", severity="warning", timeout=6
                )
            self._show_detail()
            self.refresh_status()
            return
        step = pause.get("step")
        if type(step) is not int:
            step = pause_event(pause).get("step")
        if type(step) is int and step in self.store and step != self.current_step:
            self.show_step(step)
        else:
            self._sync_pause_marks()
        if self.center == "graph":
            self.center = "timeline"
            self.switch.current = "timeline"
            self.timeline.focus()
        self._select_paused()
        self._show_detail()
        self.refresh_status()

    def _select_paused(self) -> bool:
        tl = self.timeline
        key = tl.paused_key
        # not shown: an aten call under a folded row (select unfolds it), or hidden by the
        # filter (then the filter goes)
        if key is not None and tl.paused_index() is None and not tl.select(*key) and tl.pattern:
            self._apply_filter(None)
            tl.select(*key)
        index = tl.paused_index()
        if index is None:
            return False
        tl.move_cursor(index, center=True)
        return True

    def _values_for(self, pause: dict) -> ValuesView:
        key = pause_key(pause)
        if self.values is None or self.values.key != key:
            self.values = ValuesView(key, tensor_choices(pause))
        return self.values

    def _command(self, cmd: str, **fields: Any) -> bool:
        return self.tapp.command(cmd, **fields)

    def action_pause(self) -> None:
        if not self.live:  # a recording: pause where the cursor is
            row = self.timeline.current_row() if self.current_step is not None else None
            if row is None or getattr(row, "pending", False):
                return
            self._replay_landed(self._cursor().place(self.current_step, row.kind, row.seq))
            return
        if self.store.stepper.paused is not None and not self.tapp.running_elsewhere():
            self.notify("already paused: s steps, n runs to the next step, c continues", timeout=3)
            return
        self._command("pause")  # the status bar says "pausing…" until the job has paused

    def action_step(self) -> None:
        self._step_key("s", "step")

    def action_next(self) -> None:
        self._step_key("n", "next")

    def action_continue(self) -> None:
        self._step_key("c", "continue")

    def action_step_back(self) -> None:
        self._step_key("S")

    def action_prev(self) -> None:
        self._step_key("N")

    def action_continue_back(self) -> None:
        self._step_key("C")

    def _step_key(self, key: str, command: str | None = None) -> None:
        """A stepping key: a command to a live job; in a recording, a move of its cursor."""
        if self.live:
            if command is None:
                self.notify(f"{key} steps back through a recording, not a running job", timeout=3)
            else:
                self._command(command)
            return
        cursor = self._cursor()
        try:
            cursor.set_breakpoints(self.store.stepper.breakpoints)
        except BreakpointError as exc:
            self.notify(str(exc), severity="error", timeout=5)
            return
        self._replay_answer(key, cursor.move(key))

    # -- a recording's cursor (replay_stepping.py) -------------------------------------------
    def _cursor(self) -> ReplayCursor:
        """The recording's cursor, one per store (each source of several has its own)."""
        if self._replay is None or self._replay[0] is not self.store:
            self._replay = (self.store, ReplayCursor(self.store))
            self._replay_wait = None
        return self._replay[1]

    def _replay_answer(self, key: str, answer: Any) -> None:
        if isinstance(answer, NeedStep):
            # Load that step, then make the same move again (apply_changes, when it arrives).
            self._replay_wait = (key, answer.step)
            store, source = self.store, self.tapp.source
            info = store.info(answer.step)
            if info is not None and info.state != LOADING:
                store.mark_loading(answer.step)
                source.request_step(answer.step)
            store.pin({s for s in (self.current_step, answer.step) if s is not None})
            self.status_bar.note(f"looking in step {answer.step}…")
        elif isinstance(answer, Stay):
            self._replay_wait = None
            self.notify(answer.note, timeout=3)
        elif isinstance(answer, Landed):
            self._replay_wait = None
            self._replay_landed(answer)

    def _replay_landed(self, landed: Landed) -> None:
        """Show the recording paused at the landed event, as a live pause is shown."""
        pos = landed.position
        self.status_bar.note(None)
        self._go(Location("timeline", pos.step, pos.kind, pos.seq))
        if self.store.data(pos.step) is None:  # shown once it is loaded (_replay_loaded)
            self._replay_landing = landed
            return
        self._replay_landing = None
        self.store.stepper.paused = landed.pause(self.store)
        self._sync_pause_marks()
        if landed.note:
            self.notify(landed.note, timeout=4)
        self._show_detail()
        self.refresh_status()

    def _open_at_first_origin(self) -> None:
        """A recording with alerts opens paused at its first NaN/Inf origin: once per
        recording, and only while the user has not gone anywhere yet (no jump, no pause)."""
        key = id(self.store)
        if key in self._opened or not self.at_origin:
            return
        if self.history or self.store.stepper.paused is not None:
            self._opened.add(key)
            return
        landed = self._cursor().open()
        if landed is None:
            return
        self._opened.add(key)
        self._replay_landed(landed)

    def _replay_loaded(self, ch: Changes) -> None:
        """A step the cursor waited for came (or was given up): the same move again."""
        landing = self._replay_landing
        if landing is not None and landing.position.step in ch.loaded:
            self._replay_landed(landing)
        wait = self._replay_wait
        if wait is not None and (wait[1] in ch.loaded or wait[1] in ch.evicted):
            self._replay_wait = None
            self._replay_answer(wait[0], self._cursor().move(wait[0]))

    # -- @ / E: the job's next step, traced more closely -------------------------------------
    def action_aten_next(self) -> None:
        """``@``: the job's next step traced at the aten level, inside the selected row's
        module (every call when nothing, or a row of the root module, is selected)."""
        _, module = self._selected_event()
        if module:
            text = f"next step at the aten level, inside {module}"
            aten = f"^{re.escape(module)}(\\.|$)"
        else:
            text, aten = "next step at the aten level, everywhere", ""
        self._ask_next_step("@", "tracing the next step at the aten level", text, aten=aten)

    def action_eager_check(self) -> None:
        """``E``: the job's next step with each compiled module's call run once more
        eagerly and compared (an alert per call says what differs)."""
        self._ask_next_step(
            "E",
            "checking the next step's compiled modules against eager",
            "next step: compiled modules checked against eager",
            eager_check=True,
        )

    def _ask_next_step(self, key: str, what: str, text: str, **fields: Any) -> None:
        """``arm`` the job for its next step, beside this UI's own hold (``also``)."""
        source = self.tapp.source
        if not source.can_command:
            why = "this is a recording" if not self.live else source.refusal
            self.notify(f"{key}: {what} needs a live job ({why})", timeout=4)
            return
        asked = (text, False, None)

        def answered(ok: bool, payload: Any) -> None:
            if self.asked is not asked:
                return  # asked again since
            if ok:
                step = self.tapp.status.get("step")
                self.asked = (text, True, step if type(step) is int else None)
                self.notify(f"asked the job: {text}", timeout=3)
            else:
                self.asked = None
                why = str(payload)
                if "not supported" in why:  # a trace(live=True) block has no agent to arm
                    why += " (a trace(live=True) block cannot be armed)"
                self.notify(f"{text}: refused: {why}", severity="warning", timeout=6)
            self.refresh_status()

        self.asked = asked
        if self.tapp.command("arm", next=1, also=True, quiet=True, then=answered, **fields):
            self.refresh_status()
        else:
            self.asked = None

    def action_break_here(self) -> None:
        if self.live and not self.tapp.can_command():  # a recording keeps its own
            return
        row = self.timeline.current_row()
        if row is None:
            self.notify("select an op or a backward node first", timeout=3)
            return
        ev = dict(row.event) if row.pending else dict(self.store.event(row))
        if not ev.get("module"):  # a node's module: that of the op that made it
            data = self.store.data(self.current_step)
            op = data.op(row.op_seq) if data is not None and row.op_seq is not None else None
            module = row.module or (op.module if op is not None else "")
            if module:
                ev["module"] = module
        self.app.push_screen(BreakHereScreen(ev, self.detail.cwd), self._break_chosen)

    def _break_chosen(self, spec: dict | None) -> None:
        if spec:
            text = spec_text(spec)
            self.tapp.command("break_add", then=lambda ok, result: self._added(ok, text), **spec)

    def _added(self, ok: bool, text: str) -> None:
        if ok:
            bps = self.store.stepper.breakpoints
            bp_id = max((b["id"] for b in bps), default=None)
            self.notify(f"breakpoint {bp_id}: {text}", timeout=3)

    def action_breakpoints(self) -> None:
        if self.live and not self.tapp.can_command():  # a recording keeps its own
            return
        self.app.push_screen(BreakpointsScreen())

    def action_values(self) -> None:
        pause = self.store.stepper.paused
        if pause is None:
            if self.tapp.can_command():
                self.notify("values come from a paused job (space pauses it)", timeout=3)
            return
        values = self._values_for(pause)
        if not values.choices:
            self.notify("no tensor is held at this point", timeout=3)
            return
        row = self.timeline.current_row()
        if row is None or not self._is_paused_row(row):
            self._select_paused()
        if values.current < 0:
            values.current = default_choice(values.choices)
        else:
            values.current = (values.current + 1) % len(values.choices)
        values.start = 0
        values.mark = None
        self._fetch_values()

    def action_next_slice(self) -> None:
        values = self._values_ready()
        if values is None:
            return
        numel = values.numel
        if numel is not None and values.start + values.count >= numel:
            self.notify("that is the last slice", timeout=2)
            return
        values.start += values.count
        self._fetch_values()

    def action_prev_slice(self) -> None:
        values = self._values_ready()
        if values is None:
            return
        if values.start == 0:
            self.notify("that is the first slice", timeout=2)
            return
        values.start = max(0, values.start - values.count)
        self._fetch_values()

    def _values_ready(self) -> ValuesView | None:
        pause = self.store.stepper.paused
        values = self.values
        if pause is None or values is None or values.key != pause_key(pause):
            self.notify("v fetches values of the paused event first", timeout=3)
            return None
        if values.choice is None:
            self.notify("v fetches values first", timeout=3)
            return None
        return values

    def _fetch_values(self) -> None:
        values = self.values
        if values is None or values.choice is None:
            return
        group, index, _ = values.choice
        request = (values.key, values.current, values.start)
        values.requested = request
        values.note = None
        values.loading = True
        values.error = None
        values.result = None
        values.bump()
        self._show_detail()

        def arrived(ok: bool, payload: Any) -> None:
            if self.values is not values or values.requested != request:
                return  # another pause, tensor or slice was asked for since
            values.loading = False
            if ok and isinstance(payload, dict):
                values.result = payload
            else:
                values.error = str(payload)
            values.bump()
            self._show_detail()

        if not self.tapp.command(
            "inspect",
            group=group,
            index=index,
            start=values.start,
            count=values.count,
            then=arrived,
        ):
            values.loading = False
            values.error = self.tapp.source.refusal
            values.bump()
            self._show_detail()

    # -- ! : the first NaN/Inf value --------------------------------------------------------
    #: The search through a paused job's tensor asks for this many values at a time (the
    #: most one ``inspect`` answers), at most this many times.
    NAN_PAGE = 100_000
    NAN_PAGES = 64

    def action_first_nan(self) -> None:
        """``!``: the first NaN/Inf value. Paused: searched through the tensor the values
        section shows (or the first one whose stats count one), fetched page by page; else
        in the small values the event recorded."""
        pause = self.store.stepper.paused
        row = self.timeline.current_row()
        if pause is not None and row is not None and self._is_paused_row(row):
            values = self._values_for(pause)
            if values.choice is None or not _bad_count(values.choice[2]):
                bad = [i for i, c in enumerate(values.choices) if _bad_count(c[2])]
                if bad:
                    values.current = bad[0]
                    values.start = 0
            if values.choice is not None:
                self._search_nan(values)
                return
        self._recorded_nan()

    def _recorded_nan(self) -> None:
        from torchscope.tui.format import first_bad, index_text

        ev = self.detail.event
        if not ev:
            self.notify("! finds the first NaN/Inf of the selected op or node", timeout=3)
            return
        groups = (
            ("grad_outputs", "grad_inputs") if ev.get("kind") == GRAD else ("inputs", "outputs")
        )
        counted = None
        for group in groups:
            for i, s in enumerate(ev.get(group) or ()):
                if not isinstance(s, dict):
                    continue
                bad = first_bad(s.get("values"))
                shape = s.get("shape") if isinstance(s.get("shape"), list) else None
                if bad is not None:
                    self.notify(
                        f"first NaN/Inf: {group}[{i}] at {index_text(bad, shape)}", timeout=5
                    )
                    self._scroll_detail_to("first NaN/Inf at")
                    return
                if counted is None and _bad_count(s):
                    counted = f"{group}[{i}]"
        if counted is not None:
            where = (
                "v fetches them, ! finds it"
                if self.live
                else "pause the job there (b) to fetch them"
            )
            self.notify(
                f"{counted} holds NaN/Inf, but its values were not recorded (too many): {where}",
                timeout=6,
            )
        else:
            self.notify("no NaN/Inf in this event's tensors", timeout=3)

    def _scroll_detail_to(self, text: str) -> None:
        lines = str(self.detail.body.render()).split("\n")
        line = next((n for n, t in enumerate(lines) if text in t), None)
        if line is not None:
            self.detail.scroll_to(y=max(0, line - 4), animate=False)

    def _search_nan(self, values: ValuesView) -> None:
        from torchscope.tui.format import first_bad, index_text

        group, index, summary = values.choice  # type: ignore[misc]
        label = values.label()
        result = values.result
        if result is not None and isinstance(result.get("values"), list):
            bad = first_bad(result["values"])
            start = result.get("start") if type(result.get("start")) is int else values.start
            if bad is not None and (start == 0 or values.mark == start + bad):
                values.mark = start + bad
                values.note = None
                values.bump()
                self._show_detail()
                self.call_after_refresh(self.detail._scroll_to_values)
                return
        if not _bad_count(summary):
            self.notify(f"no NaN/Inf in {label} (its stats count none)", timeout=3)
            return
        shape = summary.get("shape") if isinstance(summary.get("shape"), list) else None
        token = object()
        values.requested = ("nan", token)
        values.mark = None

        def ask(page: int) -> None:
            values.note = f"looking for the first NaN/Inf… {page * self.NAN_PAGE:,} values read"
            values.bump()
            self._show_detail()
            ok = self.tapp.command(
                "inspect",
                group=group,
                index=index,
                start=page * self.NAN_PAGE,
                count=self.NAN_PAGE,
                then=lambda ok, payload: arrived(page, ok, payload),
            )
            if not ok:
                values.note = None
                values.bump()
                self._show_detail()

        def arrived(page: int, ok: bool, payload: Any) -> None:
            if self.values is not values or values.requested != ("nan", token):
                return  # another pause, tensor or slice was asked for since
            if (
                not ok
                or not isinstance(payload, dict)
                or not isinstance(payload.get("values"), list)
            ):
                values.note = f"the search stopped: {payload}"
                values.bump()
                self._show_detail()
                return
            vals = payload["values"]
            bad = first_bad(vals)
            if bad is not None:
                flat = page * self.NAN_PAGE + bad
                last = shape[-1] if shape and shape[-1] > 0 else 1
                values.mark = flat
                values.note = None
                values.start = max(0, flat - flat % last)
                self.notify(f"first NaN/Inf of {label}: {index_text(flat, shape)}", timeout=4)
                self._fetch_values()
                self.call_after_refresh(self.detail._scroll_to_values)
                return
            numel = payload.get("numel")
            end = (page + 1) * self.NAN_PAGE
            if (type(numel) is int and end >= numel) or len(vals) < self.NAN_PAGE:
                values.note = f"no NaN/Inf in the {min(end, numel or end):,} values now"
            elif page + 1 >= self.NAN_PAGES:
                values.note = f"no NaN/Inf in the first {end:,} values (the search stops there)"
            else:
                ask(page + 1)
                return
            values.bump()
            self._show_detail()

        ask(0)

    # -- export ------------------------------------------------------------------------------
    def action_export(self) -> None:
        """``e``: the step (or the filtered rows) to a JSON-lines file; asks where first."""
        if self.current_step is None or self.store.data(self.current_step) is None:
            self.notify("no step in memory to export yet", timeout=3)
            return
        self._open_prompt("export")

    def _export_to(self, text: str) -> None:
        import os

        from torchscope.tui.export_view import clean_path, snapshot, write_jsonl

        prompt = self.filter
        path = clean_path(text)
        step = self.current_step
        data = self.store.data(step)
        if not path:
            prompt.error("a file name, please")
            return
        if data is None or step is None:
            prompt.error("the step is no longer in memory")
            return
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            prompt.error(f"no such directory: {folder}")
            return
        if os.path.exists(path) and self._export_confirm != path:
            self._export_confirm = path
            prompt.error(f"{os.path.basename(path)} exists: enter again to overwrite")
            return
        view = self.timeline.view_indices()
        items = snapshot(data, view, self.timeline.filtered_calls())
        what = f"{'filtered rows' if view is not None else 'events'} of step {step}"
        prompt.ok()
        prompt.display = False
        self.timeline.focus()

        def write() -> None:
            try:
                n = write_jsonl(items, path)
            except OSError as exc:
                message = f"export failed: {exc.strerror or exc}: {path}"
                self.app.call_from_thread(self.notify, message, severity="error", timeout=6)
                return
            message = f"exported {n:,} {what} to {path}"
            self.app.call_from_thread(self.notify, message, timeout=6)

        self.run_worker(write, name="export", thread=True, exit_on_error=False)

    # -- copy (OSC 52) -----------------------------------------------------------------------
    def _selected_event(self) -> tuple[dict | None, str | None]:
        """The event the user looks at (the graph's node, else the timeline's row) and the
        module its op ran in."""
        data = self.store.data(self.current_step)
        if self.center == "graph" and self.focused is self.graph:
            hit = self.graph.node_at_cursor()
            if hit is None or data is None:
                return None, None
            node = hit[0]
            op = data.op(node.get("op_seq")) if type(node.get("op_seq")) is int else None
            module = op.module if op is not None else None
            grads = data.grads_of_node(node.get("id"))
            if grads:
                return dict(self.store.event(grads[0])), module
            stub = {"kind": GRAD, "node": node.get("name"), "node_id": node.get("id")}
            if node.get("source"):
                stub["source"] = node["source"]
            return stub, module
        row = self.timeline.current_row()
        if row is None:
            return None, None
        ev = dict(row.event) if row.pending else dict(self.store.event(row))
        module = row.module
        if not module and data is not None and row.op_seq is not None:
            op = data.op(row.op_seq)
            module = op.module if op is not None else None
        return ev, module or None

    def action_copy(self) -> None:
        from torchscope.tui.screens.copy import CopyScreen, copy_choices

        alert = None
        index = self.alerts.highlighted
        if self.focused is self.alerts and index is not None and index < len(self.alerts.alerts):
            alert = self.alerts.alerts[index]
        ev, module = (None, None) if alert is not None else self._selected_event()
        fetched = None
        values = self.values
        row = self.timeline.current_row()
        if (
            alert is None
            and values is not None
            and values.result is not None
            and values.choice is not None
            and row is not None
            and self._is_paused_row(row)
        ):
            fetched = (values.label(), values.result)
        choices = copy_choices(ev, module=module, fetched=fetched, alert=alert)
        if not choices:
            self.notify("nothing to copy here: select an op, a node or an alert", timeout=3)
            return
        name = "alert" if alert is not None else event_name(ev or {})
        self.app.push_screen(CopyScreen(short_name(name), choices), self._copied)

    def _copied(self, choice: tuple[str, str, str] | None) -> None:
        if not choice:
            return
        _, what, text = choice
        self.app.copy_to_clipboard(text)
        preview = " ".join(text.split())
        if len(preview) > 60:
            preview = preview[:59] + "…"
        self.notify(f"copied {what}: {preview}", timeout=4)

    # -- misc --------------------------------------------------------------------------------
    def action_stat_mode(self) -> None:
        mode = "mean" if self.timeline.stat_mode == "norm" else "norm"
        self.timeline.set_stat_mode(mode)
        self.notify("stat column: " + ("mean±std" if mode == "mean" else "norm"), timeout=2)


def _bad_count(summary: Any) -> int:
    """NaN + Inf values a tensor summary counts (0 when it says nothing)."""
    stats = summary.get("stats") if isinstance(summary, dict) else None
    if not isinstance(stats, dict):
        return 0
    return int(stats.get("nan") or 0) + int(stats.get("inf") or 0)
