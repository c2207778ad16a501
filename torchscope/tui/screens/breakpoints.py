"""Breakpoints: ``b`` makes one from the selected event, ``B`` lists them all.

Both only talk to the job through ``TorchscopeApp.command``; the list shows what the job's
latest ``state`` says (every stepping reply carries it), so it is the job's list, not a copy
the UI keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, DataTable, Input, OptionList, Static
from textual.widgets.option_list import Option

from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec
from torchscope.protocol.events import GRAD
from torchscope.tui.format import short_name, short_source
from torchscope.tui.stepping import spec_from_event, spec_text

if TYPE_CHECKING:
    from torchscope.tui.app import TorchscopeApp

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
        name = ev.get("node") if ev.get("kind") == GRAD else ev.get("name")
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


class BreakpointsScreen(ModalScreen[None]):
    """The job's breakpoints: id, enabled, hits, conditions. Add one by typing a condition in
    ``--break-on`` syntax; enable/disable; delete."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("space,e", "toggle", "Enable/disable"),
        Binding("d,delete", "delete", "Delete"),
        Binding("a", "add", "Add"),
    ]

    @property
    def tapp(self) -> TorchscopeApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        with Vertical(id="bpl-box"):
            yield Static("[b]Breakpoints[/]", id="bpl-title")
            yield DataTable(id="bpl-table", cursor_type="row", zebra_stripes=False)
            yield Static("", id="bpl-empty")
            yield Input(
                placeholder="add: nan, inf, anynan, op:REGEX, module:REGEX, line:FILE:LINE, "
                "gradnorm:X, step:N, from:N — joined by ','",
                id="bpl-input",
            )
            yield Static("", id="bpl-error")
            yield Static(
                "[dim]space/e enable·disable · d delete · a add (enter in the box) · esc close[/]",
                id="bpl-help",
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("id", key="id")
        table.add_column("on", key="on")
        table.add_column("hits", key="hits")
        table.add_column("condition", key="condition")
        self.refresh_list()
        table.focus()
        self.tapp.command("break_list")

    # -- the list ----------------------------------------------------------------------------
    def refresh_list(self) -> None:
        """Show what the job's latest state says."""
        table = self.query_one(DataTable)
        keep = self.current_id()
        table.clear()
        bps = self.tapp.store.stepper.breakpoints
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
        bps = self.tapp.store.stepper.breakpoints
        row = table.cursor_row
        if table.row_count == 0 or not 0 <= row < len(bps):
            return None
        return bps[row]["id"]

    def action_toggle(self) -> None:
        bp_id = self.current_id()
        if bp_id is None:
            return
        bp = self.tapp.store.stepper.breakpoint(bp_id) or {}
        self.tapp.command("break_enable", bp=bp_id, enabled=not bp.get("enabled", True))

    def action_delete(self) -> None:
        bp_id = self.current_id()
        if bp_id is None:
            return
        self.tapp.command(
            "break_delete",
            bp=bp_id,
            then=lambda ok, _: ok and self.notify(f"breakpoint {bp_id} deleted", timeout=2),
        )

    # -- adding ------------------------------------------------------------------------------
    def action_add(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        error = self.query_one("#bpl-error", Static)
        if not text:
            self.query_one(DataTable).focus()
            return
        try:
            spec = parse_break_spec(text)
        except BreakpointError as exc:
            error.update(f"[b $text-error]{escape(str(exc))}[/]")
            error.add_class("-shown")
            return

        def done(ok: bool, payload: Any) -> None:
            if ok:
                self.query_one(Input).value = ""
                error.update("")
                error.remove_class("-shown")
                self.query_one(DataTable).focus()
            else:
                error.update(f"[b $text-error]{escape(str(payload))}[/]")
                error.add_class("-shown")

        self.tapp.command("break_add", then=done, **spec)

    def on_input_changed(self, event: Input.Changed) -> None:
        error = self.query_one("#bpl-error", Static)
        if error.has_class("-shown"):
            error.update("")
            error.remove_class("-shown")

    def action_close(self) -> None:
        self.dismiss(None)
