"""Ask and change at a pause: ``p`` evaluates a Python expression in the paused job (on a
recording: over what its summaries kept), ``e`` on the paused event's row edits its tensor in
focus. The job runs both on its training thread (torchscope.tracer.armed.evaluate); the UI
only sends text and shows answers, and imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from textual.widgets import Input

from torchscope.protocol.expressions import ExpressionError, answer_text, evaluate_kept
from torchscope.session.rows import PendingRow
from torchscope.session.stepper_view import pause_key
from torchscope.tui.screens.main.context import ScreenCore

#: Values an answer shows at most (the job's ``count``).
if TYPE_CHECKING:
    from collections.abc import Callable

    from textual.timer import Timer

    from torchscope.session.rows import Row
    from torchscope.session.stepper_view import ValuesView
    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.filter_input import FilterInput


class EvaluateScreen(ScreenCore, Protocol):
    """The main screen, as ``p`` / ``e`` see it."""

    expressions: list[str]  # p / e: what was typed, for ↑↓
    filter: FilterInput
    host: Host
    values: ValuesView | None

    def close_prompt(self) -> None: ...

    def is_paused_row(self, row: Row | PendingRow) -> bool: ...

    @property
    def live(self) -> bool: ...

    def open_prompt(self, name: str) -> None: ...

    def refresh_status(self) -> None: ...

    def select_paused(self) -> bool: ...

    def set_timer(
        self,
        delay: float,
        callback: Callable[[], Any] | None = None,
        *,
        name: str | None = None,
        pause: bool = False,
    ) -> Timer: ...


ANSWER_VALUES = 16
#: Expressions kept for ↑↓ (a shell's history, this UI's life).
MAX_HISTORY = 200
#: How often the UI asks again for an answer the job is still computing.
POLL_SECONDS = 1.0

RECORDING_EDIT = (
    "a recording cannot be changed: e edits a tensor of a running job at its pause "
    "(select another row to export the step)"
)


class Asking:
    """An expression the job runs for this UI: its task once a reply names it, and whether
    escape cancelled it (sent as soon as the task is known)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.task: int | None = None
        self.cancelled = False


class Evaluate:
    def __init__(self, main: EvaluateScreen) -> None:
        self.main = main
        self.asking: Asking | None = None  # the one the box waits for

    def cancel(self) -> None:
        """Escape in the ``p`` or ``e`` box: the expression still running is interrupted
        (the job answers "interrupted after N s" and its pause holds as before)."""
        asking, self.asking = self.asking, None
        if asking is None or asking.cancelled:
            return
        asking.cancelled = True
        if asking.task is not None:
            self._send_cancel(asking)

    def _send_cancel(self, asking: Asking) -> None:
        def answered(ok: bool, payload: Any) -> None:
            if not ok:
                self.main.notify(f"{asking.text}: {payload}", severity="warning", timeout=8)
            elif isinstance(payload, dict) and not payload.get("pending"):
                self._show_answer(asking.text, payload)

        self.main.host.command("evaluate", cancel=asking.task, quiet=True, then=answered)

    def _pending(self, asking: Asking, payload: dict) -> bool:
        """A reply said "still running": note its task; False when escape cancelled it
        meanwhile (the cancel goes now; nobody polls it)."""
        asking.task = payload.get("pending")
        if asking.cancelled:
            self._send_cancel(asking)
            return False
        return True

    # -- p ------------------------------------------------------------------------------------
    def open(self) -> None:
        if self.main.live:
            if self.main.store.stepper.paused is None:
                self.main.notify(
                    "p runs an expression in the job at a pause (space pauses it, b sets a "
                    "breakpoint)",
                    timeout=4,
                )
                return
            row = self.main.timeline.current_row()
            if row is None or not self.main.is_paused_row(row):
                self.main.select_paused()
        elif self._kept_event() is None:
            self.main.notify("p: select an op or a backward node first", timeout=3)
            return
        self.main.open_prompt("evaluate")

    def evaluate(self, text: str) -> None:
        """Enter in the ``p`` box: the job's answer (or the recording's) in the box's title
        and as a notification; the box stays open for the next expression."""
        prompt = self.main.filter
        text = text.strip()
        if not text:
            prompt.error("an expression, please")
            return
        self._remember(text)
        with prompt.prevent(Input.Changed):
            prompt.value = ""
        if not self.main.live:
            ev = self._kept_event()
            if ev is None:
                prompt.error("select an op or a backward node first")
                return
            try:
                answer = evaluate_kept(text, ev, self._focus_choice())
            except ExpressionError as exc:
                prompt.error(str(exc))
                return
            self._show_answer(text, answer)
            return
        if self.main.store.stepper.paused is None:
            prompt.error("the job is not paused any more: expressions run at a pause")
            return
        key = pause_key(self.main.store.stepper.paused)
        prompt.border_title = f"{text} … asking the job (escape interrupts it)"
        asking = self.asking = Asking(text)

        def answered(ok: bool, payload: Any) -> None:
            if asking.cancelled:
                if isinstance(payload, dict) and payload.get("pending"):
                    self._pending(asking, payload)
                return  # the cancel's own reply shows the answer
            if not ok:
                self.asking = None
                prompt.error(f"{text}: {payload}")
                return
            if isinstance(payload, dict) and payload.get("pending"):
                if not self._pending(asking, payload):
                    return
                prompt.border_title = (
                    f"{text} … {payload.get('text') or 'still running'} (escape interrupts it)"
                )
                task = payload["pending"]

                def poll() -> None:
                    if asking.cancelled:
                        return
                    if pause_key(self.main.store.stepper.paused) != key:
                        self.asking = None
                        prompt.error(f"{text}: the pause ended before the answer came")
                        return
                    self.main.host.command("evaluate", poll=task, quiet=True, then=answered)

                self.main.set_timer(POLL_SECONDS, poll)
                return
            if self.asking is asking:
                self.asking = None
            self._show_answer(text, payload if isinstance(payload, dict) else {})

        fields = {"expr": text, "count": ANSWER_VALUES, **self._focus_fields()}
        self.main.host.command("evaluate", quiet=True, then=answered, **fields)

    def _show_answer(self, text: str, answer: dict[str, Any]) -> None:
        line = answer_text(answer)
        prompt = self.main.filter
        if answer.get("error"):
            prompt.error(f"{text}: {line}")
        else:
            prompt.ok()
            prompt.border_title = f"{text} = {line}"
        note = f"{text} = {line}"
        values = answer.get("values")
        if isinstance(values, list) and values and line != _values_text(values):
            note += f"\nfirst {len(values)} values: {_values_text(values)}"
        self.main.notify(
            note, severity="error" if answer.get("error") else "information", timeout=10
        )

    def _remember(self, text: str) -> None:
        history = self.main.expressions
        if not history or history[-1] != text:
            history.append(text)
            del history[:-MAX_HISTORY]
        self.main.filter._recalled = None

    # -- e --------------------------------------------------------------------------------------
    def edit_at_pause(self) -> bool:
        """``e`` on the paused event's row: the edit prompt (a live job) or why not (a
        recording). False elsewhere: ``e`` exports, as always."""
        pause = self.main.store.stepper.paused
        row = self.main.timeline.current_row()
        if pause is None or row is None or not self.main.is_paused_row(row):
            return False
        if not self.main.live:
            self.main.notify(RECORDING_EDIT, severity="warning", timeout=6)
            return True
        self.main.open_prompt("edit")
        choice = self._focus_choice()
        if choice is not None:
            self.main.filter.border_title = (self.main.filter.border_title or "").replace(
                "edit x", f"edit x = {choice[0]}[{choice[1]}]", 1
            )
        return True

    def edit(self, text: str) -> None:
        prompt = self.main.filter
        text = text.strip()
        if not text:
            prompt.error("a replacement, please (x * 0, x.clamp(-1, 1), torch.nan_to_num(x))")
            return
        self._remember(text)
        if self.main.store.stepper.paused is None:
            prompt.error("the job is not paused any more: edits apply at a pause")
            return
        prompt.border_title = f"{text} … asking the job (escape interrupts it)"
        asking = self.asking = Asking(text)

        def answered(ok: bool, payload: Any) -> None:
            if asking.cancelled:
                if isinstance(payload, dict) and payload.get("pending"):
                    self._pending(asking, payload)
                elif not ok:
                    self.main.notify(f"{text}: {payload}", severity="warning", timeout=8)
                return
            if not ok:
                self.asking = None
                prompt.error(str(payload))
                return
            if isinstance(payload, dict) and payload.get("pending"):
                if self._pending(asking, payload):
                    prompt.error(f"{text}: {payload.get('text')} (escape interrupts it)")
                    self._await_edit(asking, answered)
                return
            self.asking = None
            self.main.close_prompt()
            what = payload.get("text") if isinstance(payload, dict) else None
            self.main.notify(f"edited {what or text} (applied as the job goes on)", timeout=8)
            self.main.refresh_status()

        self.main.host.command("edit", expr=text, quiet=True, then=answered, **self._focus_fields())

    def _await_edit(self, asking: Asking, answered: Any) -> None:
        """An edit still running: asked again each second until it is done or cancelled."""

        def poll() -> None:
            if not asking.cancelled and asking.task is not None:
                self.main.host.command("edit", poll=asking.task, quiet=True, then=answered)

        self.main.set_timer(POLL_SECONDS, poll)

    # -- what the expression is about --------------------------------------------------------
    def _focus_choice(self) -> tuple[str, int] | None:
        """The tensor ``x`` names: the one ``v`` shows for this pause, if any."""
        pause = self.main.store.stepper.paused
        values = self.main.values
        if (
            pause is not None
            and values is not None
            and values.key == pause_key(pause)
            and values.choice is not None
        ):
            group, index, _ = values.choice
            return group, index
        return None

    def _focus_fields(self) -> dict[str, Any]:
        choice = self._focus_choice()
        return {"group": choice[0], "index": choice[1]} if choice is not None else {}

    def _kept_event(self) -> dict | None:
        """A recording: the selected row's event, as recorded."""
        row = self.main.timeline.current_row()
        if row is None:
            return None
        return dict(row.event) if isinstance(row, PendingRow) else dict(self.main.store.event(row))


def _values_text(values: list) -> str:
    from torchscope.protocol.events import number_text

    return "[" + ", ".join(number_text(v) for v in values) + "]"
