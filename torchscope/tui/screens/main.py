"""The one screen, for live sessions and replays alike.

It reads only the app's :class:`~torchscope.tui.store.EventStore` and asks the source for steps
that are not in memory (``request_step``); whether a file or a socket answers is not its
concern. ``apply_changes`` is called by the app's timer, once per batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, Input, Label, OptionList, ProgressBar, Tree

from torchscope.protocol.events import GRAD, OP, Event
from torchscope.tui.store import EVICTED, LOADING, ON_DISK, Changes, EventStore, compile_filter
from torchscope.tui.widgets.alert_list import AlertList
from torchscope.tui.widgets.detail_panel import DetailPanel
from torchscope.tui.widgets.filter_input import FilterInput
from torchscope.tui.widgets.graph_tree import GraphTree
from torchscope.tui.widgets.op_timeline import OpTimeline
from torchscope.tui.widgets.status_bar import StatusBar
from torchscope.tui.widgets.step_list import StepList
from torchscope.tui.widgets.virtual_list import VirtualList

if TYPE_CHECKING:
    from torchscope.tui.app import TorchscopeApp

_HISTORY = 64


@dataclass(frozen=True)
class Location:
    """Where a jump starts or lands."""

    view: str  # "timeline" or "graph"
    step: int
    kind: str | None = None  # op / grad (timeline); None: whichever has this seq
    seq: int | None = None
    node: int | None = None  # graph


class MainScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("g", "toggle_graph", "Graph"),
        Binding("a", "alerts", "Alerts"),
        Binding("slash", "filter", "Filter"),
        Binding("backspace", "back", "Back"),
        Binding("f", "follow", "Follow"),
        Binding("left_square_bracket", "prev_step", "Prev step", show=False),
        Binding("right_square_bracket", "next_step", "Next step", show=False),
        Binding("m", "stat_mode", "Norm/mean", show=False),
        Binding("escape", "escape", "Timeline", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(id="main")
        self.current_step: int | None = None
        self.follow = False
        self.history: list[Location] = []
        self.pending: Location | None = None
        self.center = "timeline"
        self._progress_visible = False
        self._detail_pending = False
        self.ready = False

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
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.steps = self.query_one(StepList)
        self.timeline = self.query_one(OpTimeline)
        self.graph = self.query_one(GraphTree)
        self.detail = self.query_one(DetailPanel)
        self.alerts = self.query_one(AlertList)
        self.filter = self.query_one(FilterInput)
        self.switch = self.query_one(ContentSwitcher)
        self.status_bar = self.query_one(StatusBar)
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

    def on_resize(self) -> None:
        self.set_class(self.size.width < 110, "-narrow")

    def _title(self) -> None:
        step = self.current_step
        info = self.store.info(step) if step is not None else None
        title = "Timeline" if step is None else f"Step {step}"
        if info is not None:
            title += f" · {info.n_ops:,} ops · {info.nodes:,} nodes"
        self.timeline.border_title = title
        sub = []
        if self.timeline.pattern is not None:
            sub.append(f"/{self.timeline.pattern.pattern}/ {self.timeline.row_count():,} shown")
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
        if ch.steps_added or ch.steps_changed or ch.evicted:
            self.steps.refresh_rows()
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
            if step in ch.loaded:
                self.show_step(step, keep_position=True)
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
        if ch.progress is not None:
            done, total, label = ch.progress
            self._show_progress(label, done, total)
        elif ch.progress_done:
            self._show_progress(None)
        for err in ch.errors:
            self.notify(err, severity="error", timeout=8)
        if step is not None and (step in ch.steps_changed or step in ch.events_changed):
            self._title()

    def refresh_status(self) -> None:
        app = self.tapp
        self.status_bar.show(
            app.status,
            rate=app.rate.rate(),
            follow=self.follow if self.live else None,
            step=self.current_step,
            resident=self.store.resident_events,
            steps=len(self.store.order),
        )

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
        if data is None:
            self.detail.show_message(message)
        self._title()
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
        if not self.live:
            self.notify("replay: there is nothing to follow")
            return
        self._set_follow(not self.follow)

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
                self.set_timer(0.2, self._show_detail)

    def _show_detail(self) -> None:
        self._detail_pending = False
        row = self.timeline.current_row()
        if row is not None and self.current_step is not None:
            self.detail.show_row(self.store, self.store.data(self.current_step), row)

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
        if self.center == "graph":
            self._show_timeline_from_graph()

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
        self.graph.focus()

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
            self.notify(f"{node.get('name')} #{node.get('id')}: no forward op recorded")

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
        if row.kind == OP:
            grads = data.grads_of_op(row.seq)
            ids = data.nodes_of_op(row.seq)
            if grads:
                self._go(Location("timeline", self.current_step, GRAD, grads[0].seq))
                if len(ids) > 1:
                    names = ", ".join(g.name for g in grads[:6])
                    self.notify(f"{row.name} created {len(ids)} nodes: {names}", timeout=4)
            elif ids:
                self._go(Location("graph", self.current_step, node=ids[0]))
                if all(data.graph_of_node(i) is not None for i in ids):
                    self.notify("its node did not run in this backward call", timeout=4)
                else:
                    self.notify("no backward has reached this op yet", timeout=4)
            else:
                self.notify(f"{row.name} created no autograd node", timeout=4)
        else:
            op_seq = row.op_seq
            if op_seq is not None and data.op(op_seq) is not None:
                self._go(Location("timeline", self.current_step, OP, op_seq))
            elif op_seq is not None:
                self.notify(f"op #{op_seq} that created {row.name} is not in this step")
            else:
                label = f"parameter {row.param}" if row.param else "no forward op recorded"
                self.notify(f"{row.name}: {label}", timeout=4)

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
        if event.control is self.alerts and 0 <= event.option_index < len(self.alerts.alerts):
            self.detail.show_alert(self.alerts.alerts[event.option_index])

    def on_alert_list_jump(self, event: AlertList.Jump) -> None:
        self.jump_to_alert(event.alert)

    def jump_to_alert(self, alert: Event) -> None:
        step, seq = alert.get("step"), alert.get("event_seq")
        if type(step) is not int or type(seq) is not int or step not in self.store:
            self.notify("this alert does not name an event", severity="warning")
            return
        # forward / input alerts name an op, backward ones a node: the seq says which.
        self._go(Location("timeline", step, None, seq))

    # -- filter ------------------------------------------------------------------------------
    def action_filter(self) -> None:
        self.filter.display = True
        if self.center == "graph":
            self._show_timeline_from_graph()
        self.filter.focus()

    def _apply_filter(self, pattern: re.Pattern[str] | None) -> None:
        self.timeline.set_filter(pattern)
        if pattern is None:
            self.filter.value = ""
        self._title()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input is not self.filter:
            return
        try:
            pattern = compile_filter(event.value)
        except re.error as exc:
            self.filter.add_class("-invalid")
            self.filter.border_title = f"invalid regex: {exc}"
            return
        self.filter.remove_class("-invalid")
        self.filter.border_title = ""
        self.timeline.set_filter(pattern)
        self._title()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input is not self.filter:
            return
        if self.filter.has_class("-invalid"):
            self.notify(self.filter.border_title or "invalid regex", severity="error")
            return
        self.filter.display = False
        self.timeline.focus()

    def on_filter_input_cancelled(self, event: FilterInput.Cancelled) -> None:
        self.filter.remove_class("-invalid")
        self.filter.border_title = ""
        self._apply_filter(None)
        self.filter.display = False
        self.timeline.focus()

    # -- misc --------------------------------------------------------------------------------
    def action_stat_mode(self) -> None:
        mode = "mean" if self.timeline.stat_mode == "norm" else "norm"
        self.timeline.set_stat_mode(mode)
        self.notify("stat column: " + ("mean±std" if mode == "mean" else "norm"), timeout=2)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Replays have nothing to follow.
        return not (action == "follow" and not self.live)
