"""Breakpoints: ``b`` makes one from the selected event, ``B`` lists them all.

Both only talk to the job through the app's ``Host.command``; the list shows what the job's
latest ``state`` says (every stepping reply carries it), so it is the job's list, not a copy
the UI keeps.
"""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, DataTable, Input, OptionList, Static
from textual.widgets.option_list import Option

from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec
from torchscope.session.format import short_name, short_source
from torchscope.session.stepper_view import event_name, spec_from_event, spec_text
from torchscope.tui.screens.host import Host, host_of, subscribe

CHOICES = (
    ("op", "same op/node name"),
    ("module", "same module"),
    ("source", "same source line"),
)


class BreakHereScreen(ModalScreen[dict | None]):
    """A breakpoint from one event: same name, same module or same line; optionally AND
    "a NaN/Inf first appears here". Dismisses with the spec, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("n", "toggle_nan", "AND nan"),
    ]

    def __init__(self, event: dict, cwd: str | None = None) -> None:
        super().__init__()
        self.event = event
        self.cwd = cwd

    def compose(self) -> ComposeResult:
        ev = self.event
        name = event_name(ev)
        options = []
        for choice, label in CHOICES:
            spec = spec_from_event(ev, choice)
            if spec is None:
                shown = "(none)"
            elif choice == "source":
                shown = f"line:{short_source(spec['source'], self.cwd)}"
            else:
                shown = spec_text(spec)
            options.append(Option(f"{label:<18} {shown}", id=choice, disabled=spec is None))
        with Vertical(id="bp-box"):
            yield Static(
                f"[b]Breakpoint at {escape(short_name(str(name or '?')))}[/]", id="bp-title"
            )
            yield Static("stop wherever the job reaches", classes="bp-label")
            yield OptionList(*options, id="bp-choices", markup=False)
            yield Checkbox("AND a NaN/Inf first appears there (nan)", id="bp-nan")
            yield Static("", id="bp-preview")
            with Horizontal(id="bp-buttons"):
                yield Button("Add", variant="primary", id="bp-add")
                yield Button("Cancel", id="bp-cancel")
            yield Static("[dim]↑↓ choose · n toggle nan · enter add · esc cancel[/]", id="bp-help")

    def on_mount(self) -> None:
        choices = self.query_one(OptionList)
        for i, (choice, _) in enumerate(CHOICES):
            if spec_from_event(self.event, choice) is not None:
                choices.highlighted = i
                break
        choices.focus()
        self._preview()

    def spec(self) -> dict[str, Any] | None:
        choices = self.query_one(OptionList)
        if choices.highlighted is None:
            return None
        choice = CHOICES[choices.highlighted][0]
        return spec_from_event(self.event, choice, self.query_one(Checkbox).value)

    def _preview(self) -> None:
        spec = self.spec()
        text = f"--break-on {spec_text(spec)}" if spec else "(nothing to break on)"
        self.query_one("#bp-preview", Static).update(f"[dim]{escape(text)}[/]")

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self._preview()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.action_add()

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        self._preview()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "bp-add":
            self.action_add()
        else:
            self.action_cancel()

    def action_toggle_nan(self) -> None:
        box = self.query_one(Checkbox)
        box.value = not box.value

    def action_add(self) -> None:
        spec = self.spec()
        if spec is None:
            self.notify("this event has nothing to break on", severity="warning")
            return
        self.dismiss(spec)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConditionBox(Input):
    """The box conditions are typed in: while it is empty, space is not a character (no
    condition starts with one) and goes to the list, as its hint says."""

    def check_consume_key(self, key: str, character: str | None) -> bool:
        if key == "space" and not self.value:
            return False
        return super().check_consume_key(key, character)


class BreakpointsScreen(ModalScreen[None]):
    """The job's breakpoints: id, enabled, hits, conditions. Add one by typing a condition in
    ``--break-on`` syntax; enable/disable; delete.

    Typing always goes to the input box, wherever the focus is: the list takes no letters,
    only ``space`` (enable/disable) and ``delete`` (which asks: press it again to delete),
    and ``ctrl+z`` adds the last deleted breakpoint back."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        # priority: before the box takes it
        Binding("space", "toggle_enabled", "Enable/disable", priority=True),
        Binding("delete", "delete", "Delete", priority=True),
        Binding("ctrl+z", "undo", "Undo delete"),
        Binding("down", "list_down", "Down", show=False),
        Binding("up", "list_up", "Up", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.confirm: int | None = None  # the id a first `delete` asked about
        self.deleted: dict[str, Any] | None = None  # the last deleted, for ctrl+z

    @property
    def host(self) -> Host:
        return host_of(self)

    def compose(self) -> ComposeResult:
        with Vertical(id="bpl-box"):
            yield Static("[b]Breakpoints[/]", id="bpl-title")
            yield DataTable(id="bpl-table", cursor_type="row", zebra_stripes=False)
            yield Static("", id="bpl-empty")
            yield ConditionBox(
                placeholder="add: nan, inf, anynan, op:REGEX, node:REGEX, module:REGEX, "
                "line:FILE:LINE, gradnorm:X, step:N, from:N — joined by ','; last, "
                ",log:EXPR or ,edit:EXPR acts at each hit instead of pausing",
                id="bpl-input",
                select_on_focus=False,  # a letter typed in the list must not be selected
            )
            yield Static("", id="bpl-error")
            yield Static(
                "[dim]type a condition + enter: add · ↑↓ choose · with the box empty: space "
                "enable/disable, delete (twice) delete · ctrl+z undo · esc close[/]",
                id="bpl-help",
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("id", key="id")
        table.add_column("on", key="on")
        table.add_column("hits", key="hits")
        table.add_column("condition", key="condition")
        self.refresh_list()
        self.query_one(Input).focus()
        subscribe(self.host.breakpoints_changed, self, lambda _: self.refresh_list())
        self.host.command("break_list")

    # -- the list ----------------------------------------------------------------------------
    def refresh_list(self) -> None:
        """Show what the job's latest state says."""
        table = self.query_one(DataTable)
        keep = self.current_id()
        table.clear()
        bps = self.host.store.stepper.breakpoints
        for bp in bps:
            on = "✓" if bp.get("enabled", True) else "✗"
            table.add_row(
                str(bp["id"]), on, str(bp.get("hits", 0)), spec_text(bp), key=str(bp["id"])
            )
        empty = self.query_one("#bpl-empty", Static)
        empty.update("" if bps else "[dim]no breakpoints: type a condition below[/]")
        empty.display = not bps
        if keep is not None:
            for row, bp in enumerate(bps):
                if bp["id"] == keep:
                    table.move_cursor(row=row)

    def current_id(self) -> int | None:
        table = self.query_one(DataTable)
        bps = self.host.store.stepper.breakpoints
        row = table.cursor_row
        if table.row_count == 0 or not 0 <= row < len(bps):
            return None
        return bps[row]["id"]

    def _say(self, text: str, *, error: bool = False) -> None:
        line = self.query_one("#bpl-error", Static)
        line.update(f"[b $text-error]{escape(text)}[/]" if error else escape(text))
        line.set_class(bool(text), "-shown")

    def on_key(self, event) -> None:
        if event.key != "delete" and self.confirm is not None:
            self.confirm = None  # any other key keeps the breakpoint
            self._say("")
        box = self.query_one(Input)
        if box.has_focus or not event.is_printable or event.character in (None, " "):
            return
        # A letter typed while the list has the focus belongs to the box, not to the list.
        event.stop()
        event.prevent_default()
        box.focus()
        box.insert_text_at_cursor(event.character)

    def action_list_down(self) -> None:
        self.query_one(DataTable).action_cursor_down()

    def action_list_up(self) -> None:
        self.query_one(DataTable).action_cursor_up()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # In a box with text, space is a character and delete edits it; in an empty box (where
        # the focus starts) there is nothing to edit, and they act on the list.
        box = self.query_one(Input)
        return not (action in ("toggle_enabled", "delete") and box.has_focus and box.value)

    def action_toggle_enabled(self) -> None:
        bp_id = self.current_id()
        if bp_id is None:
            return
        bp = self.host.store.stepper.breakpoint(bp_id) or {}
        self.host.command("break_enable", bp=bp_id, enabled=not bp.get("enabled", True))

    def action_delete(self) -> None:
        bp_id = self.current_id()
        if bp_id is None:
            return
        bp = self.host.store.stepper.breakpoint(bp_id) or {}
        if self.confirm != bp_id:
            self.confirm = bp_id
            self._say(f"delete breakpoint {bp_id} ({spec_text(bp)})? delete again: yes")
            return
        self.confirm = None

        def done(ok: bool, _: Any) -> None:
            if ok:
                self.deleted = bp
                self._say(f"breakpoint {bp_id} deleted · ctrl+z adds it back")

        self.host.command("break_delete", bp=bp_id, then=done)

    def action_undo(self) -> None:
        bp = self.deleted
        if bp is None:
            self._say("nothing to undo")
            return
        spec = parse_break_spec(spec_text(bp))
        self.deleted = None

        def done(ok: bool, _: Any) -> None:
            if ok:
                self._say(f"added back: {spec_text(spec)}")

        self.host.command("break_add", then=done, **spec)

    # -- adding ------------------------------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if not text:
            self.query_one(DataTable).focus()
            return
        try:
            spec = parse_break_spec(text)
        except BreakpointError as exc:
            self._say(str(exc), error=True)
            return

        def done(ok: bool, payload: Any) -> None:
            if ok:
                self.query_one(Input).value = ""
                self._say("")
            else:
                self._say(str(payload), error=True)

        self.host.command("break_add", then=done, **spec)

    def on_input_changed(self, event: Input.Changed) -> None:
        if self.query_one("#bpl-error", Static).has_class("-shown"):
            self._say("")

    def action_close(self) -> None:
        self.dismiss(None)
