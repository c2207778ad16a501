"""``y``: copy something about the selected event to the clipboard (OSC 52, through
``App.copy_to_clipboard``: it works over ssh, in tmux with ``set-clipboard on``, in most
terminals but macOS Terminal).

What can be copied is worked out without textual (:func:`copy_choices`, tested on its own);
the screen is a small menu: a letter copies at once, ``↑↓`` + ``enter`` too, ``esc`` cancels.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from torchscope.protocol.events import GRAD, Event
from torchscope.protocol.jsontext import to_jsonl
from torchscope.session.format import unravel
from torchscope.session.stepper_view import event_name, spec_from_event, spec_text

#: (key, what, text): what the menu offers; ``what`` is also the notification's wording.
Choice = tuple[str, str, str]


def _num(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    return str(v)


def values_text(values: list, shape: list[int] | None = None, start: int = 0) -> str:
    """Values as nested rows (Python/NumPy literal style, ``nan``/``inf`` as words): a whole
    2-D tensor as ``[[1.0, 2.0], [3.0, nan]]``; a slice of a bigger tensor as its rows of the
    last dimension, one per line, each led by its index."""
    if not values:
        return "[]"
    dims = [d for d in shape or [] if type(d) is int]
    whole = start == 0 and dims and math.prod(dims) == len(values)
    if not dims or len(dims) == 1:
        body = "[" + ", ".join(_num(v) for v in values) + "]"
        return body if whole or not dims else f"[{start}:{start + len(values)}] {body}"
    if whole:

        def nest(flat: list, shp: list[int]) -> str:
            if len(shp) == 1:
                return "[" + ", ".join(_num(v) for v in flat) + "]"
            step = len(flat) // max(1, shp[0])
            inner = [nest(flat[i * step : (i + 1) * step], shp[1:]) for i in range(shp[0])]
            return "[" + ", ".join(inner) + "]"

        return nest(values, dims)
    last = max(1, dims[-1])
    lines = []
    i = 0
    while i < len(values):
        flat = start + i
        n = min(last - flat % last, len(values) - i)
        idx = unravel(flat, dims)
        lead = ",".join(map(str, idx[:-1]))
        col = idx[-1]
        label = f"[{lead},{col}:]" if col else f"[{lead},:]"
        lines.append(f"{label} [" + ", ".join(_num(v) for v in values[i : i + n]) + "]")
        i += n
    return "\n".join(lines)


def _first_values(ev: dict) -> tuple[str, list, list[int] | None] | None:
    """The first tensor of the event that carries its values: what it made (outputs,
    grad_inputs), else what it got."""
    groups = ("grad_inputs", "grad_outputs") if ev.get("kind") == GRAD else ("outputs", "inputs")
    for group in groups:
        sums = ev.get(group)
        if not isinstance(sums, list):
            continue
        for i, s in enumerate(sums):
            if isinstance(s, dict) and isinstance(s.get("values"), list) and s["values"]:
                shape = s.get("shape") if isinstance(s.get("shape"), list) else None
                return f"{group}[{i}]", s["values"], shape
    return None


def copy_choices(
    ev: dict | None,
    *,
    module: str | None = None,
    fetched: tuple[str, dict] | None = None,
    alert: Event | None = None,
) -> list[Choice]:
    """What ``y`` offers for an event (an op or grad; ``module``: a node's module, that of
    the op that made it), the values fetched from a paused job (``(label, inspect result)``)
    and an alert."""
    out: list[Choice] = []
    if alert is not None:
        out.append(("a", "the alert", str(alert.get("message", ""))))
    if fetched is not None:
        label, result = fetched
        vals = result.get("values")
        if isinstance(vals, list):
            raw = result.get("start")
            start = raw if type(raw) is int else 0
            shape = result.get("shape") if isinstance(result.get("shape"), list) else None
            out.append(
                (
                    "v",
                    f"values of {label} [{start}:{start + len(vals)}]",
                    values_text(vals, shape, start),
                )
            )
    if ev:
        source = ev.get("source")
        if isinstance(source, str) and source:
            out.append(("s", "the source path:line", source))
        spec = spec_from_event(ev, "op")
        if spec is not None:
            out.append(("b", "a --break-on spec (same name)", spec_text(spec)))
        with_module = dict(ev)
        if module and not with_module.get("module"):
            with_module["module"] = module
        spec = spec_from_event(with_module, "module")
        if spec is not None:
            out.append(("m", "a --break-on spec (same module)", spec_text(spec)))
        spec = spec_from_event(ev, "source")
        if spec is not None:
            out.append(("l", "a --break-on spec (same line)", spec_text(spec)))
        name = event_name(ev)
        if name != "?":
            out.append(("n", "the name", name))
        if fetched is None:
            found = _first_values(ev)
            if found is not None:
                label, vals, shape = found
                out.append(("v", f"values of {label}", values_text(vals, shape)))
        if ev.get("seq") is not None:
            out.append(("j", "the event as a JSON line", to_jsonl(Event(ev))))
    return out


class CopyScreen(ModalScreen[Choice | None]):
    """Pick what to copy; dismisses with the choice, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("y", "cancel", "Cancel", show=False),
    ]

    def __init__(self, title: str, choices: list[Choice]) -> None:
        super().__init__()
        self.title_text = title
        self.choices = choices

    def compose(self) -> ComposeResult:
        options = []
        room = max(12, min(48, self.app.size.width - 50))
        for key, what, text in self.choices:
            preview = " ".join(text.split())
            if len(preview) > room:
                preview = preview[: room - 1] + "…"
            options.append(Option(f"{key}  {what:<32} {preview}"))
        with Vertical(id="copy-box"):
            yield Static(f"[b]Copy · {escape(self.title_text)}[/]", id="copy-title")
            yield OptionList(*options, id="copy-choices", markup=False)
            yield Static(
                "[dim]a letter or ↑↓ enter: copy (OSC 52) · esc: cancel[/]", id="copy-help"
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_key(self, event: Any) -> None:
        for choice in self.choices:
            if event.character == choice[0]:
                event.stop()
                self.dismiss(choice)
                return

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self.choices[event.option_index])

    def action_cancel(self) -> None:
        self.dismiss(None)
