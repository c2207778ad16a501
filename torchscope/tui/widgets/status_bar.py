"""One line of session state: mode, pid, rank, step, events/s, dropped, paused (why, and
before or after which op or node), what was asked of the job's next step, breakpoints,
follow."""

from __future__ import annotations

import os
from typing import Any

from textual.content import Content
from textual.markup import escape
from textual.widgets import Static

from torchscope.session.format import plural
from torchscope.session.stepper_view import StepperView, pause_story
from torchscope.tui import glyphs


def _rate(x: float) -> str:
    if x >= 10_000:
        return f"{x / 1000:.0f}k"
    if x >= 1000:
        return f"{x / 1000:.1f}k"
    return f"{x:.0f}"


def _plain(markup: str) -> str:
    return Content.from_markup(markup).plain


def fit_parts(parts: list[tuple[int, str]], width: int, sep: str = " │ ") -> Content:
    """Join ``(priority, markup)`` parts in their order, leaving out the least important
    (highest number) ones until the line fits ``width``; what must stay (priority 0) is
    shortened last, with an ellipsis."""
    kept = [(p, Content.from_markup(m)) for p, m in parts]

    def length(items: list[tuple[int, Content]]) -> int:
        return sum(c.cell_length for _, c in items) + len(sep) * max(0, len(items) - 1)

    while len(kept) > 1 and length(kept) > width:
        worst = max(p for p, _ in kept)
        if worst == 0:
            break
        # the last of the least important goes first
        i = max(i for i, (p, _) in enumerate(kept) if p == worst)
        del kept[i]
    line = Content(sep).join(c for _, c in kept)
    if width > 0 and line.cell_length > width:
        line = line.truncate(width, ellipsis=True)
    return line


class StatusBar(Static):
    """Rendered from the merged status the source reports plus what the app measures. At any
    width it keeps what matters: live or replay, paused and why, where; then the rest as room
    allows."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=True)
        self._last = ""
        self._last_content: Content | None = None
        self._parts: list[tuple[int, str]] = []
        self._note: str | None = None  # what the UI is doing for a moment ("looking in…")

        self._shown: tuple[dict[str, Any], dict[str, Any]] | None = None  # show()'s last args

    def note(self, text: str | None) -> None:
        """A word on what the UI is doing now, beside the state, until replaced by None."""
        self._note = text
        if self._shown is not None:
            self.show(self._shown[0], **self._shown[1])

    def on_resize(self) -> None:
        self._render_parts()

    def _render_parts(self) -> None:
        width = self.content_region.width or self.size.width or 80
        line = fit_parts(self._parts, width)
        if line.plain != self._last or line != self._last_content:
            self._last = line.plain
            self._last_content = line
            self.update(line, layout=False)

    def show(
        self,
        status: dict[str, Any],
        *,
        rate: float,
        follow: bool | None,
        step: Any,
        resident: int,
        steps: int,
        stepper: StepperView | None = None,
        asked: str | None = None,
        edits: int = 0,
    ) -> None:
        self._shown = (
            status,
            dict(
                rate=rate,
                follow=follow,
                step=step,
                resident=resident,
                steps=steps,
                stepper=stepper,
                asked=asked,
                edits=edits,
            ),
        )
        parts: list[tuple[int, str]] = []

        def add(priority: int, markup: str) -> None:
            parts.append((priority, markup))

        mode = status.get("mode", "replay")
        state = status.get("state")
        if mode == "live":
            if status.get("connected"):
                add(0, "[b $success]● LIVE[/] connected")
            elif state == "ended":
                add(0, "[b $warning]○ LIVE[/] session ended")
            else:
                text = "disconnected" if state != "connecting" else "connecting…"
                add(0, f"[b $error]○ LIVE[/] {text}")
        else:
            name = os.path.basename(str(status.get("file") or "")) or "trace"
            add(0, f"[b $accent]REPLAY[/] {escape(name)}")
            if state == "error":
                add(0, "[b $error]unreadable[/]")
            elif status.get("truncated"):
                add(1, "[$warning]cut short[/]")
            elif status.get("damaged"):
                add(1, "[$warning]index damaged (read by scanning)[/]")
        if status.get("error") and (state in ("unreachable", "disconnected", "error")):
            add(0, f"[$error]{escape(str(status['error']))}[/]")
        pause = stepper.paused if stepper is not None else None
        if pause is not None:
            add(0, f"[b $warning]{glyphs.pause()}[/] {escape(pause_story(pause, stepper))}")
        elif status.get("paused"):
            add(0, f"[b $warning]{glyphs.pause()} PAUSED[/]")
        elif stepper is not None and stepper.mode in ("pause", "step", "next"):
            add(1, f"[$warning]{'pausing' if stepper.mode == 'pause' else stepper.mode}…[/]")
        if self._note:
            add(1, f"[$accent]{escape(self._note)}[/]")
        if asked:  # what @ / E asked of the job's next step
            add(1, f"[$accent]{escape(asked)}[/]")
        if edits:  # from the first edit on, every number after it is not the run's own
            add(0, f"[b $warning]✎ {plural(edits, 'edit')}: numbers changed by hand[/]")
        if step is not None:
            add(1, f"step {escape(str(step))}")
        if stepper is not None and stepper.breakpoints:
            on = sum(1 for b in stepper.breakpoints if b.get("enabled", True))
            n = len(stepper.breakpoints)
            text = f"{n} breakpoint{'s' if n != 1 else ''}"
            add(2, text + (f" ({on} on)" if on != n else ""))
        tracing = status.get("tracing") if mode == "live" and status.get("connected") else None
        if tracing == "dormant":
            add(1, "[$text-muted]dormant[/]")
        elif tracing == "arming":
            add(1, "[$warning]arming at the next step…[/]")
        elif tracing == "traced":
            add(3, "traced")
        if follow is not None:
            add(2, "[b $success]following[/]" if follow else "[$warning]following off (f)[/]")
        if mode == "live":
            dropped = (status.get("dropped") or 0) + (status.get("ui_dropped") or 0)
            dropped += status.get("lost") or 0  # the stream's drops for this UI alone
            gaps = status.get("gaps") or 0
            style = "$error" if dropped or gaps else "$text-muted"
            text = f"dropped {dropped}" + (f" (gaps {gaps})" if gaps else "")
            add(2 if dropped or gaps else 6, f"[{style}]{text}[/]")
        job_step = status.get("step") if mode == "live" else None
        if job_step is not None:
            add(3, f"job step {escape(str(job_step))}")
        if status.get("pid") is not None:
            add(4, f"pid {escape(str(status['pid']))}")
        if status.get("rank") is not None:
            add(4, f"rank {escape(str(status['rank']))}")
        add(5, plural(steps, "step"))
        if mode == "live":
            add(5, f"{_rate(rate)} ev/s")
        else:
            total = status.get("events_total")
            if total is not None:
                add(5, plural(total, "event"))
        add(7, f"[$text-muted]{resident:,} in memory[/]")
        self._parts = parts
        self._render_parts()

    @property
    def full_text(self) -> str:
        """Everything the bar would say with room for all of it (tests, help)."""
        return _plain(" │ ".join(m for _, m in self._parts))
